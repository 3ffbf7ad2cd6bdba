"""vLLM (v0 default): prefill-first iteration-level scheduling.

While prompts wait and can be admitted, run prefill-only batches of whole prompts; otherwise run
a decode-only batch of every running request.
"""
from __future__ import annotations

from charioteer.scheduling.base import Batch
from charioteer.scheduling.orca import OrcaScheduler


class VLLMScheduler(OrcaScheduler):
    name = "vllm"

    def _schedule(self) -> Batch:
        batch = Batch()
        self._add_running(batch, self._running_prefills())
        self._admit_whole_prompts(batch)
        if batch:
            return batch
        self._add_running(batch, self._running_decodes())
        return batch
