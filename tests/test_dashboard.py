"""The dashboard: live at /dashboard on a real server, and offline from a trace (`charioteer view`).

The browser tests drive Debian's chromium through playwright; without them they skip, naming the
install commands. The trace and stall-accounting tests need no browser.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import threading
import time

import httpx
import pytest

from charioteer import LLM, SamplingParams
from charioteer.cli import main
from charioteer.engine.step_record import EntryRecord, StepRecord, stream_times
from charioteer.engine.trace import TraceRecorder, load_trace
from charioteer.serving.api import ServerConfig
from charioteer.serving.dashboard import Compactor, DashboardHub, latency_from_records, render_html

try:
    from playwright.sync_api import sync_playwright
except ImportError:  # pragma: no cover - depends on the machine
    sync_playwright = None

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
INSTALL = "apt-get install -y chromium && pip install playwright (no `playwright install` needed)"
if sync_playwright is None:
    NO_BROWSER = f"playwright is not installed: {INSTALL}"
elif CHROMIUM is None:
    NO_BROWSER = f"no chromium binary on PATH: {INSTALL}"
else:
    NO_BROWSER = None
needs_browser = pytest.mark.skipif(NO_BROWSER is not None, reason=NO_BROWSER or "")


def _prompt(i: int, length: int) -> list[int]:
    return [(7 * i + j) % 500 + 1 for j in range(length)]


def _counts(record: StepRecord) -> tuple[int, int]:
    return record.num_prefill_tokens, record.num_decode_tokens


def _row_counts(row: dict) -> tuple[int, int]:
    return sum(n for _, n in row["p"]), row["n"]


# ---- no browser needed --------------------------------------------------------------------------


def _rec(index, entries, *, finished=(), preempted=(), running=0, duration=0.01):
    return StepRecord(index=index, entries=tuple(EntryRecord(*e) for e in entries), preempted=tuple(preempted),
                      finished=tuple(finished), start_time=float(index), schedule_s=0.0, execute_s=duration,
                      duration_s=duration, cpu_s=duration, kv_blocks_used=1, kv_blocks_total=8, num_running=running,
                      num_waiting=0, token_budget=None)


def test_compactor_counts_decodes_left_out_of_prefill_only_iterations():
    c = Compactor()
    a_prompt = c.row(_rec(0, [("a", 0, 8, True, True)], running=1))  # a's whole prompt; a now decodes
    b_alone = c.row(_rec(1, [("b", 0, 64, True, False)], running=2))  # prefill-first: a left out
    mixed = c.row(_rec(2, [("a", 8, 1, False, True), ("b", 64, 16, True, True)], running=2))
    after = c.row(_rec(3, [("a", 9, 1, False, True), ("c", 0, 4, True, True)], finished=("b",), running=2))
    assert (a_prompt["h"], b_alone["h"], mixed["h"], after["h"]) == (0, 1, 0, 0)
    assert b_alone["p"] == [["b", 64]] and mixed["n"] == 1 and mixed["p"] == [["b", 16]]
    # A request that vanished without a trace (aborted) is never counted past the running ones.
    assert c.row(_rec(4, [("d", 0, 4, True, False)], running=1))["h"] == 0


def test_latency_from_records():
    recs = [_rec(0, [("a", 0, 8, True, True)], duration=0.5),
            _rec(1, [("a", 8, 1, False, True)], duration=0.25),
            _rec(2, [("a", 9, 1, False, True)], finished=("a",), duration=0.25)]
    ttft, tbt = latency_from_records(recs)
    assert ttft == [0.5] and tbt == [pytest.approx(0.75), pytest.approx(1.0)]
    # a two-step plan (records 1 and 2): both tokens reach the stream when record 2 ends
    plan = [recs[0]] + [dataclasses.replace(r, plan_steps=2, plan_step=k) for k, r in enumerate(recs[1:])]
    assert stream_times(plan) == [0.5, 2.25, 2.25]
    ttft, tbt = latency_from_records(plan)
    assert ttft == [0.5] and tbt == [pytest.approx(1.75), 0.0]


def test_hub_decimates_and_drops_the_oldest_updates_of_a_slow_client():
    async def run():
        hub = DashboardHub(max_rate=10, max_client_updates=3)
        hub.start(asyncio.get_running_loop())
        slow = hub.connect()  # never reads: starts with the snapshot queued

        def engine_thread():
            for i in range(400):
                hub.observe_step(_rec(i, [("a", i, 1, False, True)], running=1))
                if i % 40 == 0:
                    hub.observe_request(0.05, [0.01, 0.02])
                time.sleep(0.0025)

        thread = threading.Thread(target=engine_thread)
        start = time.monotonic()
        thread.start()
        while thread.is_alive():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)
        elapsed = time.monotonic() - start
        assert [r["i"] for r in hub.rows] == list(range(400)) and len(hub.ttft) == 10 and len(hub.tbt) == 20
        assert 2 <= hub.num_updates <= 10 * elapsed + 2  # at most ~10 a second, not one per record
        assert len(slow.updates) == 3 and b'"snapshot":true' not in slow.updates[0]  # the oldest went
        last = json.loads(slow.updates[-1][len(b"data: "):])
        assert last["rows"][-1]["i"] == 399
        hub.disconnect(slow)
        assert not hub.clients and slow.closed
        hub.stop()

    asyncio.run(run())


def test_trace_recorder_round_trips(tiny_model, tmp_path):
    llm = LLM(tiny_model, scheduler="sarathi", chunk_size=16, max_num_seqs=4)
    seen = []
    unsubscribe = llm.engine.subscribe(seen.append)
    path = tmp_path / "run.json"
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    with TraceRecorder(llm, str(path)) as to_file, TraceRecorder(llm.engine) as in_memory:
        llm.generate([_prompt(i, 20 + 9 * i) for i in range(4)], params)
    n = len(seen)
    llm.generate([_prompt(9, 12)], params)  # after close: recorded by neither
    unsubscribe()
    loaded = load_trace(str(path))
    assert len(seen) > n and to_file.count == len(loaded) == len(in_memory.records) == n
    assert [r.to_dict() for r in loaded] == [r.to_dict() for r in in_memory.records] == [
        r.to_dict() for r in seen[:len(loaded)]]
    as_array = tmp_path / "run-array.json"
    as_array.write_text(json.dumps([r.to_dict() for r in loaded]))
    assert [r.to_dict() for r in load_trace(str(as_array))] == [r.to_dict() for r in loaded]
    html = render_html(loaded, "run.json")
    assert "/*__DASHBOARD_DATA__*/" not in html and '"mode":"trace"' in html


@pytest.mark.parametrize("content, message", [
    (None, "No such file"),
    ("", "no step records"),
    ('{"index": 0}\n', "not a step record"),
    ("{nope\n", "line 1 is not JSON"),
])
def test_view_errors_are_one_line(tmp_path, capsys, content, message):
    path = tmp_path / "trace.json"
    if content is not None:
        path.write_text(content)
    assert main(["view", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("charioteer: error:") and message in err and "\n" not in err
    assert main(["view", str(path), "-o", str(path)]) == 2


def test_generate_writes_a_trace(default_model, tmp_path, capsys):
    path = tmp_path / "gen.json"
    assert main(["generate", "The sky is", "--max-tokens", "4", "--ignore-eos", "--chunk-size", "2",
                 "--trace", str(path)]) == 0
    records = load_trace(str(path))
    prompt_tokens = len(default_model.tokenizer.encode("The sky is"))
    assert sum(r.num_prefill_tokens for r in records) == prompt_tokens
    assert sum(r.num_decode_tokens for r in records) == 3 and records[-1].finished
    assert main(["view", str(path)]) == 0
    assert (tmp_path / "gen.html").stat().st_size > 10_000
    assert main(["generate", "x", "--trace", str(tmp_path / "missing" / "t.json")]) == 2


# ---- in a browser ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def live(tiny_model):
    from live_server import LiveServer

    s = LiveServer(tiny_model, ServerConfig(), scheduler="sarathi", chunk_size=64, max_num_seqs=8)
    yield s
    s.stop()


def _send(url: str, n: int) -> None:
    def one(i):
        body = {"prompt": _prompt(i, 90 + 45 * i), "max_tokens": 24, "ignore_eos": True}
        assert httpx.post(url + "/v1/completions", json=body, timeout=120).status_code == 200

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@needs_browser
def test_live_dashboard_shows_the_engines_iterations(live, browser, tmp_path):
    records: list[StepRecord] = []
    unsubscribe = live.engine.subscribe(records.append)
    page = browser.new_page(viewport={"width": 1280, "height": 1500})
    opened = time.monotonic()
    page.goto(live.url + "/dashboard")
    page.wait_for_function("window.dashboard.updates >= 1", timeout=15_000)  # the snapshot arrived
    assert page.inner_text("#status") == "live"
    _send(live.url, 6)
    unsubscribe()
    last = records[-1].index
    page.wait_for_function(f"window.dashboard.rows.length && window.dashboard.rows.at(-1).i >= {last}",
                           timeout=15_000)
    # a request's latency is observed when its response is done, which may be after its last
    # iteration's row went out: its TTFT can come in the next update (seen under a loaded suite)
    page.wait_for_function("window.dashboard.ttft.length >= 6", timeout=15_000)
    state = page.evaluate("({rows: window.dashboard.rows, ttft: window.dashboard.ttft.length,"
                          " updates: window.dashboard.updates, skipped: window.dashboard.skipped,"
                          " strip: window.dashboard.drawn.strip})")
    rows = {r["i"]: r for r in state["rows"]}
    assert all(r.index in rows for r in records), "every iteration reached the page"
    assert {r.index: _counts(r) for r in records} == {r.index: _row_counts(rows[r.index]) for r in records}
    assert sum(r.num_prefill_tokens for r in records) == sum(90 + 45 * i for i in range(6))
    served = httpx.get(live.url + "/dashboard/records", params={"n": 2000}).json()
    assert {r["i"]: _row_counts(r) for r in served["rows"]} == {i: _row_counts(r) for i, r in rows.items()}
    assert state["ttft"] >= 6 and state["skipped"] == 0 and state["strip"] > 0
    # Decimated: at most ~10 updates a second however many iterations ran.
    assert state["updates"] <= 10 * (time.monotonic() - opened) + 2
    assert "p50" in page.inner_text("#tbt-summary") and "decode·s" in page.inner_text("#stall-summary")
    shot = tmp_path / "dashboard.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 20_000
    page.close()
    deadline = time.monotonic() + 10  # the server forgets the closed page's stream
    while httpx.get(live.url + "/dashboard/records", params={"n": 0}).json()["clients"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.get(live.url + "/dashboard/records", params={"n": 0}).json()["clients"] == 0


@needs_browser
def test_view_renders_a_trace_offline(tiny_model, browser, tmp_path):
    llm = LLM(tiny_model, scheduler="vllm", max_num_seqs=4)
    path = tmp_path / "trace.json"
    with TraceRecorder(llm, str(path)) as recorder:
        llm.generate([_prompt(i, 40 + 30 * i) for i in range(6)],
                     [SamplingParams(temperature=0, max_tokens=6 + 4 * i, ignore_eos=True) for i in range(6)])
    records = load_trace(str(path))
    assert recorder.count == len(records) > 0
    out = tmp_path / "trace.html"
    assert main(["view", str(path), "-o", str(out)]) == 0
    page = browser.new_page(viewport={"width": 1280, "height": 1500})
    page.goto(out.as_uri())
    page.wait_for_function("window.dashboard.frames >= 1", timeout=15_000)
    rows = page.evaluate("window.dashboard.rows")
    assert [r["i"] for r in rows] == [r.index for r in records]
    assert [_row_counts(r) for r in rows] == [_counts(r) for r in records]
    assert page.inner_text("#status") == "trace file"
    assert page.evaluate("window.dashboard.ttft.length") == 6
    # vLLM's policy runs prompts alone while requests decode: the stall chart counts those decodes.
    assert page.evaluate("window.dashboard.stall.held") > 0
    page.screenshot(path=str(tmp_path / "view.png"), full_page=True)
    page.close()
