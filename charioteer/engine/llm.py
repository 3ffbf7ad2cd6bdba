"""Offline API shaped like vLLM's: LLM(model=...).generate(prompts, params)."""
from __future__ import annotations

from collections.abc import Sequence

from charioteer.config import EngineArgs
from charioteer.engine.llm_engine import LLMEngine
from charioteer.model.loader import LoadedModel
from charioteer.request import RequestOutput, SamplingParams, merge_samples

Prompt = str | list[int]
Message = dict[str, str]


class LLM:
    def __init__(self, model: str | LoadedModel | None = None, **kwargs) -> None:
        """`model` is a spec for load_model, or an already loaded model (shared, not copied)."""
        if isinstance(model, LoadedModel):
            self.engine = LLMEngine(EngineArgs(model=model.source, **kwargs), loaded=model)
        else:
            self.engine = LLMEngine(EngineArgs(model=model, **kwargs))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def shutdown(self) -> None:
        """Stop pipeline stage processes, if any (they also stop when this process exits)."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns outputs in prompt order.

        `priority`: one integer per prompt, lower first (needs scheduling_policy="priority").
        Every prompt is validated before any runs, so one bad prompt raises ValueError and
        nothing is queued.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            return []
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(sampling_params)} sampling params")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priority)} priorities")
        priorities = [None] * len(prompts) if priority is None else list(priority)
        requests = [self.engine.make_request(p, sp, priority=pr)
                    for p, sp, pr in zip(prompts, sampling_params, priorities)]
        samples = [self.engine.make_samples(r) for r in requests]  # n > 1: each prompt's samples
        where = {s.request_id: (i, j) for i, group in enumerate(samples) for j, s in enumerate(group)}
        for group in samples:
            for sample in group:
                self.engine.add(sample)
        done: list[list[RequestOutput | None]] = [[None] * len(group) for group in samples]
        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=len(requests), desc="requests", unit="req")
        left = len(where)
        while left:
            for out in self.engine.step():
                if out.finished and out.request_id in where:
                    i, j = where.pop(out.request_id)
                    done[i][j] = out
                    left -= 1
                    if progress and all(done[i]):
                        progress.update(1)
        if progress:
            progress.close()
        return [outs[0] if len(outs) == 1 else merge_samples(outs, sp.n, keep_logprobs=sp.logprobs is not None)
                for outs, sp in zip(done, sampling_params)]

    def apply_chat_template(self, messages: list[Message]) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them and generate."""
        if not messages:
            raise ValueError("messages is empty: give at least one {'role': ..., 'content': ...}")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(conv) for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)
