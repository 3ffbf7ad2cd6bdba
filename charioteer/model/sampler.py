"""Turn logits into tokens: greedy, or temperature / top-k / top-p with per-request seeds."""
from __future__ import annotations

import torch

from charioteer.model import avx512
from charioteer.sampling_params import SamplingParams


def top_logprobs(logprobs: torch.Tensor, k: int, chosen: int) -> dict[int, float]:
    """The chosen token's logprob plus the k most likely ones."""
    result = {chosen: float(logprobs[chosen])}
    if k > 0:
        values, ids = logprobs.topk(k)
        for value, token in zip(values.tolist(), ids.tolist()):
            result.setdefault(token, value)
    return result


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (its first maximum); the AVX-512 kernel on CPU splits the rows over threads."""
    if (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.stride(-1) == 1 and avx512.available()):
        return avx512.argmax_rows(logits)
    return logits.argmax(dim=-1)


class Sampler:
    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _generator(self, request_id: str, params: SamplingParams, device) -> torch.Generator | None:
        if params.seed is None:
            return None
        gen = self._generators.get(request_id)
        if gen is None:
            gen = self._generators[request_id] = torch.Generator(device=device).manual_seed(params.seed)
        return gen

    def sample(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]) -> list[int]:
        """logits: [N, vocab] float32. Returns one token per row."""
        tokens = greedy(logits).tolist()
        for row, (request_id, p) in enumerate(zip(request_ids, params)):
            if p.greedy:
                continue
            scores = logits[row] / p.temperature
            if p.top_k > 0 and p.top_k < scores.shape[-1]:
                kth = scores.topk(p.top_k).values[-1]
                scores = scores.masked_fill(scores < kth, float("-inf"))
            probs = scores.softmax(-1)
            if p.top_p < 1.0:
                sorted_probs, order = probs.sort(descending=True)
                # Keep the smallest prefix whose mass reaches top_p (always at least one token).
                drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
                sorted_probs = sorted_probs.masked_fill(drop, 0.0)
                probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
            gen = self._generator(request_id, p, logits.device)
            tokens[row] = int(torch.multinomial(probs, 1, generator=gen))
        return tokens
