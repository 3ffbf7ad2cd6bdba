"""Pipeline parallelism over torch.distributed: the model's layers split into stages, one process each.

- `executor.PipelineExecutor` (driver side, inside LLMEngine): starts or joins the stages, sends
  each micro-batch's plan to every stage, receives the last stage's logits; up to N micro-batches
  in flight. The driver keeps the scheduler, the KV block tables and the sampler.
- `stage` (one process per stage): holds its layers' weights and KV cache, receives hidden states
  from the previous stage and sends its own to the next (point to point).
- `metrics.PipelineMetrics`: per stage busy/idle time, per micro-batch and per request bubble time.
- `python -m charioteer.pipeline ...` under torchrun: rank 0 runs the `charioteer` command, the
  others run stages.
"""
from charioteer.pipeline.metrics import PipelineMetrics

__all__ = ["PipelineMetrics"]
