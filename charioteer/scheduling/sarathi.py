"""SARATHI: chunked prefills with decode-maximal batching.

Strict mode (the paper): every batch holds exactly one prompt chunk of C tokens while any prompt
work is pending, plus as many running decodes as the batch cap and memory allow. Optionally C
shrinks so that C + decodes lands on a multiple of the hardware tile.

Token-budget mode (Sarathi-Serve, vLLM's chunked prefill): decodes first, then fill the token
budget with chunks, possibly from several prompts.

Partial prefills (vLLM's `max_num_partial_prefills`, `max_long_partial_prefills`,
`long_prefill_token_threshold`): with N > 1 the batch's prompt tokens (strict: the chunk C, token
budget: what the decodes leave) are shared among prompts. Each prompt first gets at most an equal
share (C // N), a long prompt (over the threshold) never more than the threshold; what the shares
leave goes back to the prompts, in order, up to their limits. Strict mode takes at most N prompts
per batch; token-budget mode leaves at most N of them part-way (whole prompts that fit still
join). A waiting long prompt lets shorter ones pass while `max_long_partial_prefills` long ones
are mid-prefill. With the defaults (N = 1, no threshold) this is the one-chunk plan above.
"""
from __future__ import annotations

import heapq
from collections.abc import Iterator

from charioteer.request import Request
from charioteer.scheduling.base import Batch, BatchEntry, Scheduler


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
        self.steered_budget: int | None = None  # set between batches by a TBT-SLO controller (tbt_slo_ms)

    def set_token_budget(self, tokens: int) -> None:
        """Steer the budget for the next batches: the chunk size C, or in token-budget mode the batch's
        token budget (decodes included). A chunk boundary is exact wherever it falls: outputs stay the same."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"a token budget must be an integer >= 1, got {tokens!r}")
        self.steered_budget = tokens

    @property
    def chunk_size(self) -> int:
        if self.steered_budget is not None and not self.config.token_budget_mode:
            return self.steered_budget
        return self.adaptive.chunk_size if self.adaptive else self.config.chunk_size

    @property
    def batched_token_budget(self) -> int | None:
        """The cap on a batch's tokens, decodes included (None: no cap)."""
        if self.steered_budget is not None and self.config.token_budget_mode:
            return self.steered_budget
        return self.config.max_num_batched_tokens

    @property
    def token_budget(self) -> int | None:
        return self.batched_token_budget if self.config.token_budget_mode else self.chunk_size

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
        budget = self.batched_token_budget
        if budget is not None:
            chunk = min(chunk, budget - num_decodes)
        return chunk

    def _ready_prefill(self) -> bool:
        """Whether a running request not in flight still has prompt tokens to run."""
        return any(not r.in_flight and r.in_prefill for r in self.running)

    def _prefill_pending(self, ready_prefill: bool | None = None) -> bool:
        if ready_prefill is None:
            ready_prefill = self._ready_prefill()
        return ready_prefill or (bool(self.waiting) and len(self.running) < self.config.max_num_seqs)

    def _add_decodes(self, batch: Batch, limit: int) -> None:
        for request in self._running_decodes()[: max(limit, 0)]:
            if self._grow_or_preempt(request, 1, batch):
                batch.add(request, 1)

    def _first_tokens(self, request: Request) -> int:
        return min(request.num_remaining_tokens, self.token_budget or request.num_remaining_tokens)

    def _add_chunk(self, batch: Batch, request: Request, num: int, admit: bool) -> bool:
        if num < 1:
            return False
        if admit:
            num = self._admit(request, num)  # fewer when the prefix cache holds the prompt's start
            if not num:
                return False
        elif not self._grow_or_preempt(request, num, batch):
            return False
        batch.add(request, num)
        return True

    def _schedule(self) -> Batch:
        batch = Batch()
        cap = self.config.max_num_seqs
        budget = self.batched_token_budget
        if self.config.token_budget_mode:
            self._add_decodes(batch, min(cap, budget))
            self._add_prefills(batch, budget - batch.num_tokens, max_prompts=None)
            return batch
        ready_prefill = self._ready_prefill()
        limit = cap - 1 if self._prefill_pending(ready_prefill) else cap
        if budget is not None:
            limit = min(limit, budget)
        self._add_decodes(batch, limit)
        if ready_prefill or self.waiting:  # else no prompt has a token to run (the simulator's common case)
            self._add_prefills(batch, self.chunk_len(len(batch)), max_prompts=self.config.max_num_partial_prefills)
        return batch

    # ---- prompt chunks ------------------------------------------------------------------

    def _waiting_in_order(self) -> Iterator[tuple[Request, bool]]:
        """The waiting queue from its head, while admissions remove requests from it."""
        i = 0
        while i < len(self.waiting):
            request = self.waiting[i]
            yield request, True
            if i < len(self.waiting) and self.waiting[i] is request:
                i += 1  # still waiting: step past it

    def _prefill_candidates(self) -> Iterator[tuple[Request, bool]]:
        """(request, whether it waits for admission): ready running prompts, then waiting ones; under
        the priority policy, merged by priority."""
        running = [(r, False) for r in self._running_prefills()]
        if self.by_priority:
            yield from heapq.merge(running, self._waiting_in_order(), key=lambda c: c[0].priority_key)
        else:
            yield from running
            yield from self._waiting_in_order()

    def _is_long(self, request: Request) -> bool:
        threshold = self.config.long_prefill_token_threshold
        return threshold is not None and request.num_remaining_tokens > threshold

    def _add_prefills(self, batch: Batch, tokens: int, max_prompts: int | None) -> None:
        """Give up to `tokens` prompt tokens to prompts (see the module's docstring); `max_prompts`
        caps the prompts tried (strict mode), else at most N prompts are left part-way."""
        config = self.config
        n = config.max_num_partial_prefills
        share = tokens if n == 1 else max(1, tokens // n)
        limit = config.long_prefill_token_threshold or tokens
        num_long = 0 if config.long_prefill_token_threshold is None else sum(
            1 for r in self.running if r.in_prefill and self._is_long(r))
        added: list[BatchEntry] = []
        tried = partial = 0
        admitting = True
        for request, waiting in self._prefill_candidates():
            left = tokens - sum(e.num_tokens for e in added)
            if left < 1 or len(batch) >= config.max_num_seqs or (max_prompts and tried >= max_prompts):
                break
            if waiting and not admitting:
                continue
            if waiting and self._is_long(request) and num_long >= config.max_long_partial_prefills:
                continue  # shorter prompts may pass it
            num = min(request.num_remaining_tokens, share, left, limit)
            if waiting and num < request.num_remaining_tokens and partial >= n:
                break
            if not self._add_chunk(batch, request, num, admit=waiting):
                if not waiting:
                    tried += 1
                elif not self.by_priority:
                    break  # first come, first served: nobody passes the head for lack of memory
                else:
                    admitting = False  # priority: running prompts after it still get their chunks
                continue
            tried += 1
            added.append(batch.entries[-1])
            partial += batch.entries[-1].num_tokens < request.num_remaining_tokens
            num_long += waiting and self._is_long(request)
        if n > 1:
            self._top_up(batch, added, tokens - sum(e.num_tokens for e in added), limit)

    def _top_up(self, batch: Batch, added: list[BatchEntry], left: int, limit: int) -> None:
        """Hand the tokens the equal shares left over back to the prompts, in order, while KV blocks allow."""
        for entry in added:
            request = entry.request
            extra = min(left, request.num_remaining_tokens - entry.num_tokens, limit - entry.num_tokens)
            if extra < 1 or not self.blocks.ensure(request, entry.end + extra):
                continue
            batch.grow(entry, extra)
            left -= extra
