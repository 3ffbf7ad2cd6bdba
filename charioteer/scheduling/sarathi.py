"""SARATHI: chunked prefills with decode-maximal batching.

Strict mode (the paper): every batch holds exactly one prompt chunk of C tokens while any prompt
work is pending, plus as many running decodes as the batch cap and memory allow. Optionally C
shrinks so that C + decodes lands on a multiple of the hardware tile.

Token-budget mode (Sarathi-Serve, vLLM's chunked prefill): decodes first, then fill the token
budget with chunks, possibly from several prompts.
"""
from __future__ import annotations

from charioteer.request import Request
from charioteer.scheduling.base import Batch, Scheduler


class SarathiScheduler(Scheduler):
    name = "sarathi"

    def __init__(self, config, block_manager, holds_stop_string=None) -> None:
        super().__init__(config, block_manager, holds_stop_string)
        self.adaptive = None
        if config.chunk_size == "auto":
            from charioteer.scheduling.adaptive_chunk import AdaptiveChunkSize

            kwargs = dict(batch_size=config.max_num_seqs, min_chunk=config.min_chunk_size,
                          max_chunk=config.max_chunk_size, tile_size=config.tile_size)
            self.adaptive = (AdaptiveChunkSize.from_table_file(config.tune_table, **kwargs) if config.tune_table
                             else AdaptiveChunkSize(**kwargs))

    @property
    def chunk_size(self) -> int:
        return self.adaptive.chunk_size if self.adaptive else self.config.chunk_size

    @property
    def token_budget(self) -> int | None:
        return self.config.max_num_batched_tokens if self.config.token_budget_mode else self.chunk_size

    def on_batch_done(self, batch, sampled):
        finished = super().on_batch_done(batch, sampled)
        if self.adaptive:
            for request in finished:
                self.adaptive.observe(request.num_prompt_tokens, request.num_output_tokens)
            self.adaptive.update([(r.num_prompt_tokens, r.num_output_tokens) for r in self.running])
        return finished

    def chunk_len(self, num_decodes: int) -> int:
        """Chunk size for a batch that already holds `num_decodes` decodes."""
        chunk = self.chunk_size
        tile = self.config.tile_size
        if tile and not self.adaptive:  # adaptive C is aligned when chosen
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
