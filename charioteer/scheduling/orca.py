"""Orca: iteration-level scheduling with whole prompts.

Every iteration runs all running requests (one token each for decodes) and admits as many
waiting prompts, whole, as the batch cap, the token budget and memory allow.
"""
from __future__ import annotations

from charioteer.scheduling.base import Batch, Scheduler


class OrcaScheduler(Scheduler):
    name = "orca"

    def add_request(self, request) -> None:
        budget = self.config.max_num_batched_tokens
        # Whole prompts must fit one batch; under paged KV so must a recompute after preemption.
        # Reserved KV never preempts, so there only the prompt counts.
        need = request.num_prompt_tokens if self.blocks.policy == "reserve" else request.max_num_tokens
        if budget is not None and need > budget:
            raise ValueError(
                f"request {request.request_id} needs {need} tokens in one batch but the "
                f"{self.name} scheduler runs whole prompts and max_num_batched_tokens is {budget}: "
                f"raise max_num_batched_tokens or use the sarathi scheduler"
            )
        super().add_request(request)

    def _add_running(self, batch: Batch, requests) -> None:
        budget = self.config.max_num_batched_tokens
        for request in requests:
            num = request.num_remaining_tokens
            if budget is not None and batch.num_tokens + num > budget:
                continue  # runs in a later batch
            if self._grow_or_preempt(request, num, batch):
                batch.add(request, num)

    def _admit_whole_prompts(self, batch: Batch) -> None:
        budget = self.config.max_num_batched_tokens
        while self.waiting:
            request = self.waiting[0]
            num = request.num_remaining_tokens
            if budget is not None and batch.num_tokens + num > budget:
                break
            num = self._admit(request, num)  # fewer when the prefix cache holds the prompt's start
            if not num:
                break
            batch.add(request, num)

    def _schedule(self) -> Batch:
        batch = Batch()
        self._add_running(batch, self._ready())
        self._admit_whole_prompts(batch)
        return batch
