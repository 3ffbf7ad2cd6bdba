"""Request-level scheduling (FasterTransformer-style).

Admit a batch of requests, run their prefill, then decode until every one of them has finished;
only then admit the next batch. Finished requests leave early (no padding work is done).
"""
from __future__ import annotations

from charioteer.scheduling.base import Batch
from charioteer.scheduling.orca import OrcaScheduler


class RequestLevelScheduler(OrcaScheduler):
    name = "request-level"

    def _schedule(self) -> Batch:
        batch = Batch()
        if not self.running:
            self._admit_whole_prompts(batch)
            if batch:
                return batch
        prefilling = self._running_prefills()
        self._add_running(batch, prefilling or self._running_decodes())
        return batch
