"""A real uvicorn server on loopback around an LLMEngine, for the server tests."""
from __future__ import annotations

import re
import socket
import threading
import time

import httpx
import uvicorn

from charioteer.config import EngineArgs
from charioteer.engine.llm_engine import LLMEngine
from charioteer.serving.api import ServerConfig, build_app


class LiveServer:
    def __init__(self, loaded, config: ServerConfig, **engine_kwargs) -> None:
        engine = LLMEngine(EngineArgs(model=loaded.source, **engine_kwargs), loaded=loaded)
        self.engine = engine
        self.app = build_app(engine, config)
        self.model = self.app.state.model_name
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        values = {}
        for line in text.splitlines():
            m = re.match(r"^(charioteer:[a-z_]+)(?:\{[^}]*\})? (\S+)$", line)
            if m:
                values[m.group(1)] = values.get(m.group(1), 0.0) + float(m.group(2))
        return values

    def wait_idle(self, timeout: float = 10.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (m["charioteer:num_requests_running"] == 0 and m["charioteer:num_requests_waiting"] == 0
                    and m["charioteer:kv_cache_usage_perc"] == 0)
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.05)

    def healthy(self) -> bool:
        return httpx.get(self.url + "/health", timeout=10).status_code == 200
