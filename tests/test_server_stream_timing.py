"""A stream's first chunk goes out with its first token, not when the request is accepted.

Clients that time the first chunk (vLLM's `bench serve`, `charioteer bench serve`) report it as
the time to first token. More streams than `max_num_seqs` run at once, so some wait in the queue;
the engine's own step records say when each request's first token was sampled.
"""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from live_server import LiveServer

from charioteer.serving.api import ServerConfig

PROMPTS = [
    "The quick brown fox jumps over the lazy dog, and then the fox",
    "In 1492, Columbus sailed across the ocean blue and found",
    "My favourite food is pizza with extra cheese, because",
    "Water boils at one hundred degrees Celsius at sea level, but",
    "Once upon a time, a dragon lived in a cave near the village of",
    "Paris is a city that millions of tourists visit every year to",
]


@pytest.fixture(scope="module")
def server(default_model):
    s = LiveServer(default_model, ServerConfig(), scheduler="sarathi", chunk_size=64, max_num_seqs=2)
    yield s
    s.stop()


async def _stream(http: httpx.AsyncClient, path: str, body: dict) -> list[tuple[float, dict]]:
    """Every chunk of one stream with the time.monotonic() it was read."""
    chunks = []
    async with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunks.append((time.monotonic(), json.loads(line[6:])))
    return chunks


def _first_token_times(records) -> dict[str, float]:
    """request id -> when the engine sampled its first token (the end of that step's forward pass)."""
    out = {}
    for r in records:
        for e in r.entries:
            if e.samples and e.request_id not in out:
                out[e.request_id] = r.start_time + r.schedule_s + r.execute_s
    return out


def test_no_first_chunk_before_the_first_token(server):
    records = []
    unsubscribe = server.engine.subscribe(records.append)
    bodies = []
    for prompt in PROMPTS:
        common = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
        bodies.append(("/v1/chat/completions", {**common, "messages": [{"role": "user", "content": prompt}]}))
        bodies.append(("/v1/completions", {**common, "prompt": prompt}))

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            return await asyncio.gather(*(_stream(http, path, body) for path, body in bodies))

    try:
        streams = asyncio.run(asyncio.wait_for(run(), 150))
        server.wait_idle()
    finally:
        unsubscribe()
    first_token = _first_token_times(records)
    assert any(r.num_waiting > 0 for r in records), "no request waited: the test proves nothing"
    for (path, _), chunks in zip(bodies, streams):
        arrived, first = chunks[0]
        request_id = first["id"]
        assert request_id in first_token, (path, request_id)
        early = first_token[request_id] - arrived
        assert early <= 0, f"{path}: first chunk {early * 1000:.0f} ms before the first token: {first}"
        if path == "/v1/chat/completions":
            assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert chunks[1][1]["choices"][0]["delta"].get("content")  # the first token's text, right behind
        else:
            assert first["choices"][0]["text"]
