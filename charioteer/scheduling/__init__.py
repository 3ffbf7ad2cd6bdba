"""Scheduling policies over one Batch contract."""
from charioteer.config import SchedulerConfig
from charioteer.memory.block_manager import BlockManager
from charioteer.scheduling.base import Batch, BatchEntry, Scheduler
from charioteer.scheduling.orca import OrcaScheduler
from charioteer.scheduling.request_level import RequestLevelScheduler
from charioteer.scheduling.sarathi import SarathiScheduler
from charioteer.scheduling.vllm import VLLMScheduler

SCHEDULER_CLASSES: dict[str, type[Scheduler]] = {
    cls.name: cls for cls in (SarathiScheduler, OrcaScheduler, VLLMScheduler, RequestLevelScheduler)
}


def make_scheduler(config: SchedulerConfig, block_manager: BlockManager, holds_stop_string=None) -> Scheduler:
    return SCHEDULER_CLASSES[config.policy](config, block_manager, holds_stop_string)


__all__ = ["Batch", "BatchEntry", "Scheduler", "SCHEDULER_CLASSES", "make_scheduler"]
