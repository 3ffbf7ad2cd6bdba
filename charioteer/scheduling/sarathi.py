"""SARATHI: chunked prefills with decode-maximal batching.

Strict mode (the paper): every batch holds exactly one prompt chunk of C tokens while any prompt
work is pending, plus as many running decodes as the batch cap and memory allow. Optionally C
shrinks so that C + decodes lands on a multiple of the hardware tile.

Token-budget mode (Sarathi-Serve, vLLM's chunked prefill): decodes first, then fill the token
budget with chunks, possibly from several prompts.
"""
from __future__ import annotations

from charioteer.request import Request
from charioteer.scheduling.base import Scheduler
from charioteer.scheduling.batch import Batch


class SarathiScheduler(Scheduler):
    name = "sarathi"

    def chunk_len(self, num_decodes: int) -> int:
        """Chunk size for a batch that already holds `num_decodes` decodes."""
        chunk = self.config.chunk_size
        tile = self.config.tile_size
        if tile:
            aligned = (chunk + num_decodes) // tile * tile - num_decodes
            if aligned >= 1:
                chunk = aligned
        budget = self.config.max_num_batched_tokens
        if budget is not None:
            chunk = min(chunk, budget - num_decodes)
        return chunk

    def _prefill_pending(self) -> bool:
        return bool(self._running_prefills()) or (
            bool(self.waiting) and len(self.running) < self.config.max_num_seqs
        )

    def _add_decodes(self, batch: Batch, limit: int) -> None:
        for request in self._running_decodes()[: max(limit, 0)]:
            if self._grow_or_preempt(request, 1, batch):
                batch.add(request, 1)

    def _add_chunk(self, batch: Batch, request: Request, max_tokens: int, admit: bool) -> bool:
        num = min(request.num_remaining_tokens, max_tokens)
        if num < 1:
            return False
        if admit:
            if not self._admit(request, num):
                return False
        elif not self._grow_or_preempt(request, num, batch):
            return False
        batch.add(request, num)
        return True

    def _schedule(self) -> Batch:
        batch = Batch()
        cap = self.config.max_num_seqs
        budget = self.config.max_num_batched_tokens
        if self.config.token_budget_mode:
            self._add_decodes(batch, min(cap, budget))
            for request in self._running_prefills():
                left = budget - batch.num_tokens
                if left < 1 or len(batch) >= cap:
                    return batch
                self._add_chunk(batch, request, left, admit=False)
            while self.waiting and len(batch) < cap:
                left = budget - batch.num_tokens
                if left < 1 or not self._add_chunk(batch, self.waiting[0], left, admit=True):
                    break
            return batch

        limit = cap - 1 if self._prefill_pending() else cap
        if budget is not None:
            limit = min(limit, budget)
        self._add_decodes(batch, limit)
        chunk = self.chunk_len(len(batch))
        prefilling = self._running_prefills()
        if prefilling:
            self._add_chunk(batch, prefilling[0], chunk, admit=False)
        elif self.waiting:
            self._add_chunk(batch, self.waiting[0], chunk, admit=True)
        return batch
