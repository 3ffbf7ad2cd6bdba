"""Writes the small example traces in this folder (deterministic; run from the repository root).

Nothing here is real user data: arrivals are a seeded Poisson process, token counts are seeded
log-normal draws, and the conversations are built from the templates below.

    python examples/traces/generate.py
"""
import csv
import json
import os
from datetime import datetime, timedelta

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def _requests(rng: np.random.Generator, n: int, rate: float):
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=n))
    prompts = np.clip(rng.lognormal(6.5, 0.8, size=n).astype(int), 8, 4000)
    outputs = np.clip(rng.lognormal(4.5, 0.9, size=n).astype(int), 1, 800)
    return arrivals, prompts, outputs


def azure(path: str) -> None:
    """The Azure LLM inference trace's columns: TIMESTAMP (a date-time), ContextTokens, GeneratedTokens."""
    arrivals, prompts, outputs = _requests(np.random.default_rng(1), 40, rate=2.0)
    t0 = datetime(2023, 11, 16, 18, 15, 46)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["TIMESTAMP", "ContextTokens", "GeneratedTokens"])
        for a, p, o in zip(arrivals, prompts, outputs):
            stamp = (t0 + timedelta(seconds=float(a))).strftime("%Y-%m-%d %H:%M:%S.%f") + "0"  # 7 digits, as Azure
            w.writerow([stamp, int(p), int(o)])


def vidur(path: str) -> None:
    """Vidur's trace columns: arrived_at (seconds), num_prefill_tokens, num_decode_tokens."""
    arrivals, prompts, outputs = _requests(np.random.default_rng(2), 40, rate=4.0)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["arrived_at", "num_prefill_tokens", "num_decode_tokens"])
        for a, p, o in zip(arrivals, prompts, outputs):
            w.writerow([f"{a:.6f}", int(p), int(o)])


TOPICS = ["pipeline parallelism", "the KV cache", "chunked prefills", "tile quantization", "tensor parallelism",
          "request scheduling", "batch sizes", "memory bandwidth", "attention kernels", "speculative decoding"]
ASKS = ["Explain {t} in two sentences.", "Why does {t} matter when serving a large language model?",
        "Write a short note for a new engineer about {t}, with one example.",
        "What goes wrong with {t} when requests have very different lengths? Answer briefly."]
REPLIES = ["In short, {t} decides how work is split and when each piece runs.",
           "{T} matters because it sets how well the accelerator is used. " * 3,
           "Here is a note on {t}.\n\n1. What it is.\n2. Why it helps.\n3. One example: a batch of eight requests.",
           "With mixed lengths, {t} leaves some work waiting while the rest finishes. " * 2]


def sharegpt(path: str) -> None:
    """ShareGPT's shape: a list of {"id", "conversations": [{"from": "human"|"gpt", "value": text}, ...]}."""
    rng = np.random.default_rng(3)
    items = []
    for i in range(12):
        t = TOPICS[i % len(TOPICS)]
        k = int(rng.integers(len(ASKS)))
        turns = [{"from": "human", "value": ASKS[k].format(t=t)},
                 {"from": "gpt", "value": REPLIES[k].format(t=t, T=t[0].upper() + t[1:])}]
        if i % 4 == 3:
            turns += [{"from": "human", "value": "Thanks. Shorter, please."}, {"from": "gpt", "value": "Sure."}]
        items.append({"id": f"example-{i}", "conversations": turns})
    items.append({"id": "example-single-turn", "conversations": [{"from": "human", "value": "Hello?"}]})  # skipped
    with open(path, "w") as f:
        json.dump(items, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    azure(os.path.join(HERE, "azure_llm_inference_sample.csv"))
    vidur(os.path.join(HERE, "vidur_sample.csv"))
    sharegpt(os.path.join(HERE, "sharegpt_sample.json"))
