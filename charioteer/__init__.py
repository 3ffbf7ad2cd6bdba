"""Charioteer: chunked-prefill, decode-maximal batching (SARATHI) on a real LLaMA engine."""
from charioteer.engine.llm import LLM
from charioteer.engine.llm_engine import EngineArgs, LLMEngine
from charioteer.outputs import CompletionOutput, RequestOutput
from charioteer.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
