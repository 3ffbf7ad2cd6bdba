"""The live dashboard: step records from the engine thread to browsers over server-sent events.

Engine thread: `observe_step` (a step observer) and `observe_request` (a finished request's TTFT
and times between tokens) only append to bounded deques and, at most once until the event loop
has run it, schedule a wake-up with `loop.call_soon_threadsafe`. They never wait.

Event loop: `_pump` wakes, turns the new records into compact rows (`Compactor`), keeps the last
`history` rows, and hands one update to every client at most `max_rate` times a second. Each
client has a bounded queue of updates: a client that cannot keep up loses its oldest ones (the
page notices the gap in iteration numbers). A client's stream ends, and it is forgotten, when the
browser disconnects.

The same rows, embedded in the same page, make `charioteer view`'s offline HTML (`render_html`).
"""
from __future__ import annotations

import asyncio
import collections
import json
import logging
from importlib import resources

from starlette.responses import Response

from charioteer.engine.step_record import StepRecord, stream_times

log = logging.getLogger("charioteer.serving")

DATA_MARKER = "/*__DASHBOARD_DATA__*/null"  # replaced by the embedded data in an offline page


def page_template() -> str:
    return resources.files("charioteer.serving").joinpath("static/dashboard.html").read_text(encoding="utf-8")


class Compactor:
    """Step records -> the page's rows, in order. Remembers which requests are decoding.

    A row: i index, t start (s, time.monotonic), d duration (s), p [[request id, tokens]] per
    prompt chunk, n decode tokens, h decodes held out (requests past their prompt that did not run
    in an iteration that ran prompt chunks), kv/kvt KV blocks used/total, r running, w waiting,
    x preempted while planning, f finished, b token budget (or null).
    """

    def __init__(self, forget_after: int = 512) -> None:
        self.forget_after = forget_after
        self._decoding: dict[str, int] = {}  # request id -> index of the last iteration it ran in

    def row(self, rec: StepRecord) -> dict:
        for rid in rec.preempted:
            self._decoding.pop(rid, None)
        ids = {e.request_id for e in rec.entries}
        prefill = [[e.request_id, e.num_tokens] for e in rec.entries if e.is_prefill]
        held = 0
        if prefill:
            held = sum(1 for rid in self._decoding if rid not in ids)
            # Never more than the running requests outside this batch (an aborted request leaves no
            # trace in the records, so the set can hold a stale id for a while).
            still_running = len(ids - set(rec.finished))
            held = min(held, max(0, rec.num_running - still_running))
        self._advance(rec)
        return {"i": rec.index, "t": round(rec.start_time, 6), "d": round(rec.duration_s, 6), "p": prefill,
                "n": rec.num_decode_tokens, "h": held, "kv": rec.kv_blocks_used, "kvt": rec.kv_blocks_total,
                "r": rec.num_running, "w": rec.num_waiting, "x": len(rec.preempted), "f": len(rec.finished),
                "b": rec.token_budget}

    def _advance(self, rec: StepRecord) -> None:
        for e in rec.entries:
            if e.samples or not e.is_prefill:  # a decode, or the chunk that ends a prompt
                self._decoding[e.request_id] = rec.index
        for rid in rec.finished:
            self._decoding.pop(rid, None)
        if rec.index % 64 == 0:
            old = rec.index - self.forget_after
            for rid in [rid for rid, seen in self._decoding.items() if seen < old]:
                del self._decoding[rid]


def latency_from_records(records: list[StepRecord]) -> tuple[list[float], list[float]]:
    """(TTFT, time between tokens) samples from records alone, for a trace without a server.

    A token's time is when the iteration that sampled it handed it over (`stream_times`). The records
    do not say when a request arrived, so TTFT here runs from the start of the first iteration that ran it.
    """
    first_seen: dict[str, float] = {}
    last_token: dict[str, float] = {}
    ttft, tbt = [], []
    for rec, end in zip(records, stream_times(records)):
        for e in rec.entries:
            first_seen.setdefault(e.request_id, rec.start_time)
            if e.samples:
                prev = last_token.get(e.request_id)
                if prev is None:
                    ttft.append(end - first_seen[e.request_id])
                else:
                    tbt.append(end - prev)
                last_token[e.request_id] = end
        for rid in rec.finished:
            first_seen.pop(rid, None)
            last_token.pop(rid, None)
    return ttft, tbt


def _script_json(obj) -> str:
    """JSON that is safe inside a <script> element."""
    text = json.dumps(obj, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def live_page(title: str) -> str:
    """The page a server sends: it streams from ./dashboard/events."""
    return page_template().replace(DATA_MARKER, _script_json({"mode": "live", "title": title}), 1)


def render_html(records: list[StepRecord], title: str, max_rows: int = 20000) -> str:
    """The dashboard page with a trace's rows embedded: opens in a browser without a server."""
    if not records:
        raise ValueError("the trace holds no step records")
    compactor = Compactor()
    rows = [compactor.row(r) for r in records]
    ttft, tbt = latency_from_records(records)
    data = {"mode": "trace", "title": title, "rows": rows[-max_rows:], "ttft": ttft, "tbt": tbt,
            "total": len(rows), "ttft_from": "first scheduled"}
    page = page_template()
    if DATA_MARKER not in page:  # pragma: no cover - the packaged page is broken
        raise RuntimeError("the dashboard page has no data marker")
    return page.replace(DATA_MARKER, _script_json(data), 1)


class _Client:
    """One browser's stream: a bounded queue of updates (the oldest go first when it lags)."""

    def __init__(self, max_updates: int) -> None:
        self.updates: collections.deque = collections.deque(maxlen=max_updates)
        self.ready = asyncio.Event()
        self.closed = False
        self.gone = False  # the browser disconnected

    def push(self, update: bytes) -> None:
        self.updates.append(update)
        self.ready.set()

    def close(self) -> None:
        self.closed = True
        self.ready.set()


class DashboardHub:
    """Collects step records and latency samples; fans compact updates out to SSE clients."""

    def __init__(self, history: int = 2000, max_rate: float = 10.0, max_rows_per_update: int = 500,
                 max_client_updates: int = 50, heartbeat_s: float = 15.0) -> None:
        self.interval = 1.0 / max_rate
        self.max_rows_per_update = max_rows_per_update
        self.max_client_updates = max_client_updates
        self.heartbeat_s = heartbeat_s
        # Engine thread -> event loop. deque.append/popleft are atomic; the bounds drop the oldest.
        self._records: collections.deque = collections.deque(maxlen=4 * history)
        self._latency: collections.deque = collections.deque(maxlen=4096)
        self._wake_pending = False
        # Event loop only.
        self.rows: collections.deque = collections.deque(maxlen=history)
        self.ttft: collections.deque = collections.deque(maxlen=2000)
        self.tbt: collections.deque = collections.deque(maxlen=20000)
        self.clients: set[_Client] = set()
        self.num_updates = 0
        self._compactor = Compactor()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    # ---- lifecycle (event loop) -----------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._wake = asyncio.Event()
        self._task = loop.create_task(self._pump())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for client in list(self.clients):
            client.close()

    # ---- engine thread ------------------------------------------------------------------------

    def observe_step(self, record: StepRecord) -> None:
        self._records.append(record)
        self._poke()

    def observe_request(self, ttft: float | None, tbts: list[float]) -> None:
        self._latency.append((ttft, tbts))
        self._poke()

    def _poke(self) -> None:
        if self._wake_pending or self._loop is None:
            return
        self._wake_pending = True
        try:
            self._loop.call_soon_threadsafe(self._on_wake)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass

    # ---- event loop -----------------------------------------------------------------------------

    def _on_wake(self) -> None:
        self._wake_pending = False
        self._wake.set()

    async def _pump(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                update = self._collect()
            except Exception:  # pragma: no cover - a bug; keep serving the rest
                log.exception("dashboard update failed")
                update = None
            if update is not None and self.clients:
                message = _sse_message(update)
                for client in self.clients:
                    client.push(message)
            await asyncio.sleep(self.interval)  # at most max_rate updates a second

    def _collect(self) -> dict | None:
        """The rows and latency samples that arrived since the last call (capped), or None."""
        rows, ttft, tbt = [], [], []
        while self._records:
            rows.append(self._compactor.row(self._records.popleft()))
        while self._latency:
            first, gaps = self._latency.popleft()
            if first is not None:
                ttft.append(first)
            tbt.extend(gaps)
        if not (rows or ttft or tbt):
            return None
        self.rows.extend(rows)
        self.ttft.extend(ttft)
        self.tbt.extend(tbt)
        self.num_updates += 1
        return {"rows": rows[-self.max_rows_per_update:], "ttft": ttft[-2000:], "tbt": tbt[-5000:]}

    def snapshot(self, n: int | None = None) -> dict:
        rows = list(self.rows)
        return {"rows": rows if n is None else rows[len(rows) - min(n, len(rows)):], "ttft": list(self.ttft),
                "tbt": list(self.tbt), "clients": len(self.clients), "updates": self.num_updates}

    def connect(self) -> _Client:
        client = _Client(self.max_client_updates)
        client.push(_sse_message({**self.snapshot(), "snapshot": True}))
        self.clients.add(client)
        return client

    def disconnect(self, client: _Client) -> None:
        client.close()
        self.clients.discard(client)


def _sse_message(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class DashboardStream(Response):
    """The response of GET /dashboard/events: updates until the browser goes away."""

    def __init__(self, hub: DashboardHub) -> None:
        # Not Response.__init__, which renders a whole body; FastAPI still reads `background`.
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                            (b"x-accel-buffering", b"no")]
        self.hub = hub

    async def __call__(self, scope, receive, send) -> None:
        client = self.hub.connect()
        watcher = asyncio.create_task(_close_on_disconnect(receive, client))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            while not client.closed:
                try:
                    await asyncio.wait_for(client.ready.wait(), self.hub.heartbeat_s)
                except asyncio.TimeoutError:
                    client.push(b": keep-alive\n\n")  # a write that fails tells a dead peer apart
                client.ready.clear()
                while client.updates and not client.closed:
                    await send({"type": "http.response.body", "body": client.updates.popleft(), "more_body": True})
            if not client.gone:  # the server is stopping: end the response
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the connection broke while sending
            pass
        finally:
            watcher.cancel()
            self.hub.disconnect(client)


async def _close_on_disconnect(receive, client: _Client) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            client.gone = True
            client.close()
            return
