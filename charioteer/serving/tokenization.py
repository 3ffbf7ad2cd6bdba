"""vLLM's /tokenize and /detokenize: jobs for the engine thread (`AsyncEngine.call`), which owns
the tokenizer, and their response bodies."""
from __future__ import annotations

from collections.abc import Callable

from charioteer.engine.llm_engine import LLMEngine
from charioteer.serving.async_engine import chat_prompt

Job = Callable[[LLMEngine], dict]


def _tokenizer(engine: LLMEngine):
    if engine.tokenizer is None:
        raise ValueError(f"model {engine.model_config.name} has no tokenizer")
    return engine.tokenizer


def _tokens(engine: LLMEngine, ids: list[int], return_token_strs: bool) -> dict:
    strs = [engine.tokenizer.token_to_str(t) for t in ids] if return_token_strs else None
    return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": strs}


def text_job(prompt: str, add_special_tokens: bool, return_token_strs: bool) -> Job:
    def job(engine: LLMEngine) -> dict:
        ids = _tokenizer(engine).encode(prompt, add_special_tokens=add_special_tokens)
        return _tokens(engine, ids, return_token_strs)
    return job


def chat_job(messages: list[dict], add_generation_prompt: bool, add_special_tokens: bool,
             return_token_strs: bool) -> Job:
    def job(engine: LLMEngine) -> dict:
        try:
            text = chat_prompt(engine, messages, add_generation_prompt)
        except ValueError:
            raise
        except Exception as exc:  # e.g. a template that raises on the roles it was given
            raise ValueError(f"could not apply the chat template: {exc}") from None
        ids = _tokenizer(engine).encode(text, add_special_tokens=add_special_tokens)
        return _tokens(engine, ids, return_token_strs)
    return job


def detokenize_job(ids: list[int]) -> Job:
    def job(engine: LLMEngine) -> dict:
        tokenizer = _tokenizer(engine)
        bad = [t for t in ids if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise ValueError(f"token ids must be in [0, {tokenizer.vocab_size}); got {bad[:5]}")
        return {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}
    return job
