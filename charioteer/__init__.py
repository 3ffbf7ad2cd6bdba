"""Charioteer: chunked-prefill, decode-maximal batching (SARATHI) on a real LLaMA engine."""
import importlib

__version__ = "0.1.0"

# Imported on first use, so the simulator and `charioteer --help` do not pay for torch.
_EXPORTS = {
    "LLM": "charioteer.engine.llm",
    "LLMEngine": "charioteer.engine.llm_engine",
    "EngineArgs": "charioteer.config",
    "SamplingParams": "charioteer.request",
    "StructuredOutputsParams": "charioteer.request",
    "RequestOutput": "charioteer.request",
    "CompletionOutput": "charioteer.request",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'charioteer' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
