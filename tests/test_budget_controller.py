"""The TBT-SLO token budget (`tbt_slo_ms`): the controller on synthetic step records, then the engine,
the settings' checks and the server's gauges."""
import httpx
import pytest

from charioteer import LLM, SamplingParams
from charioteer.config import EngineArgs, SchedulerConfig
from charioteer.engine.budget_controller import TokenBudgetController
from charioteer.engine.step_record import EntryRecord, StepRecord
from charioteer.engine.tbt import TimeBetweenTokens


class FakeEngine:
    """Steps of one prompt chunk of the controller's budget plus `decodes` running decodes, timed by a
    linear cost model: duration = a + b * tokens + c * the chunk's query-key pairs in millions
    (+ `slow_every`-th step `slow_factor` times slower). The chunks walk through prompts of
    `prompt_len` tokens, one after another (0: every chunk starts a prompt)."""

    def __init__(self, controller, a=0.005, b=0.0001, decodes=8, slow_every=0, slow_factor=1.0, c=0.0,
                 prompt_len=0):
        self.controller, self.a, self.b, self.c, self.decodes = controller, a, b, c, decodes
        self.slow_every, self.slow_factor, self.prompt_len = slow_every, slow_factor, prompt_len
        self.now, self.index, self.position = 100.0, 0, 0
        self.prompts = True  # False: decode-only steps (no prompt waiting)

    def step(self) -> int:
        chunk = self.controller.budget if self.prompts else 0
        start = self.position
        if self.prompt_len and chunk:
            chunk = min(chunk, self.prompt_len - start)
            self.position = (start + chunk) % self.prompt_len
        entries = (*((EntryRecord("prompt", start, chunk, True, False),) if chunk else ()),
                   *(EntryRecord(f"d{i}", 50, 1, False, True) for i in range(self.decodes)))
        pairs = chunk * (start + (chunk + 1) / 2) / 1e6
        duration = self.a + self.b * (chunk + self.decodes) + self.c * pairs
        if self.slow_every and self.index % self.slow_every == self.slow_every - 1:
            duration *= self.slow_factor
        record = StepRecord(entries=entries, index=self.index, preempted=(), finished=(), start_time=self.now,
                            schedule_s=0.0, execute_s=duration, duration_s=duration, cpu_s=duration,
                            kv_blocks_used=1, kv_blocks_total=10, num_running=self.decodes + 1, num_waiting=1,
                            token_budget=chunk)
        self.now += duration + 0.0005  # the engine's gap between steps
        self.index += 1
        return self.controller.observe(record)

    def run(self, n: int) -> list[int]:
        return [self.step() for _ in range(n)]


def limit(slo_s, a, b, decodes, gap=0.0005, margin=0.85, align=16):
    """The largest aligned chunk whose step (and gap) fits SLO x margin under the cost model."""
    rows = (slo_s * margin - gap - a) / b
    return int((rows - decodes) // align * align)


def test_grows_to_the_largest_budget_under_the_slo_and_stays_aligned():
    c = TokenBudgetController(0.05, 16, 512)
    budgets = FakeEngine(c).run(200)
    best = limit(0.05, 0.005, 0.0001, 8)  # 352
    assert budgets[0] == 16 and budgets[-1] >= 0.9 * best
    steady = budgets[100:]
    assert max(steady) <= best + 16
    assert all(b % 16 == 0 and 16 <= b <= 512 for b in budgets)
    assert c.tbt_p99_s <= 0.05


def test_shrinks_within_a_few_steps_when_steps_get_slower():
    c = TokenBudgetController(0.05, 16, 512)
    engine = FakeEngine(c)
    before = engine.run(200)[-1]
    engine.b *= 2  # longer contexts: every token costs twice as much
    after = engine.run(15)
    new_best = limit(0.05, 0.005, 0.0002, 8)  # 176
    assert after[-1] <= new_best < before
    # Two slow steps are the recent steps' tail until newer ones replace them (the floor's steps
    # are short: 15 of them take 0.15 s here), and the clients' p99 cut the correction.
    assert engine.run(25)[-1] >= 0.5 * new_best  # not left at the floor
    later = engine.run(200)
    assert later[-1] >= 0.8 * new_best and max(later[50:]) <= new_best + 16


def test_grows_back_after_the_mix_turns_cheaper():
    c = TokenBudgetController(0.05, 16, 512)
    engine = FakeEngine(c, b=0.0002)
    engine.run(200)
    engine.b = 0.0001
    budgets = engine.run(200)
    assert budgets[-1] >= 0.9 * limit(0.05, 0.005, 0.0001, 8)


def test_a_spell_of_decode_only_steps_keeps_the_budget():
    """A step's fixed cost (reading the weights) dwarfs a decode token's: decode-only steps must not
    be read as a price per chunk token once a slope is known."""
    c = TokenBudgetController(0.15, 16, 512)
    engine = FakeEngine(c, a=0.017, b=0.0005)
    best = limit(0.15, 0.017, 0.0005, 8)  # 208
    assert engine.run(200)[-1] >= 0.8 * best
    engine.prompts = False
    idle = engine.run(300)  # over 6 s: the window holds decode-only steps alone
    assert min(idle) >= 0.8 * best
    engine.prompts = True
    assert engine.run(50)[-1] >= 0.8 * best and c.tbt_p99_s <= 0.15


def test_the_budget_fits_the_last_chunk_of_a_long_prompt():
    """A chunk attends to the whole prompt before it, so the last chunk of a 2,000-token prompt is the
    dearest step: the budget must fit that one, not the average chunk."""
    c = TokenBudgetController(0.175, 16, 512, max_decodes=15)
    engine = FakeEngine(c, a=0.017, b=0.0004, c=0.1, decodes=15, prompt_len=2000)

    def last_chunk_s(chunk):
        return 0.017 + 0.0004 * (chunk + 15) + 0.1 * chunk * (2000 - (chunk - 1) / 2) / 1e6

    best = max(chunk for chunk in range(16, 513, 16) if last_chunk_s(chunk) + 0.0005 <= 0.175 * 0.85)  # 208
    first_chunk = max(chunk for chunk in range(16, 513, 16)
                      if 0.017 + 0.0004 * (chunk + 15) + 0.1 * chunk * chunk / 2e6 + 0.0005 <= 0.175 * 0.85)
    assert first_chunk >= best + 64  # priced at a prompt's start, the budget would be far too large
    budgets = engine.run(400)
    assert 0.8 * best <= budgets[-1] <= best and max(budgets[200:]) <= best
    assert c.tbt_p99_s <= 0.175


def test_light_load_does_not_raise_the_target_past_the_slo():
    """With a chunk every 100th step the clients' p99 comes from decode-only steps, far under the SLO:
    that says nothing about the chunk steps, so the budget stays where their cost puts it."""
    c = TokenBudgetController(0.15, 16, 512, max_decodes=8)
    engine = FakeEngine(c, a=0.017, b=0.0005)
    budgets = []
    for i in range(3000):
        engine.prompts = i % 100 < 3
        budgets.append(engine.step())
    assert c.correction <= 1.0
    assert max(budgets[1000:]) <= limit(0.15, 0.017, 0.0005, 8)


def test_a_slow_tail_of_steps_shrinks_the_budget():
    """Every 10th step is 1.6x slower: the budget must shrink until those steps hold the SLO too."""
    plain = TokenBudgetController(0.05, 16, 512)
    FakeEngine(plain).run(300)
    tail = TokenBudgetController(0.05, 16, 512)
    FakeEngine(tail, slow_every=10, slow_factor=1.6).run(300)
    assert tail.budget < plain.budget
    assert tail.tbt_p99_s <= 0.05


def test_the_budget_comes_back_after_a_slow_spell_and_an_idle_one():
    """The machine runs 3x slower for a while (the clients' p99 cuts the correction, the fit learns
    the slow costs), then the load stops; when prompts come back at full speed, with the budget held
    at one value and a little noise, the steps never spread enough to refit the slopes. The fixed
    cost must still follow them, and the correction recover, within a couple of seconds."""
    c = TokenBudgetController(0.2, 16, 512, max_decodes=15)
    engine = FakeEngine(c, a=0.017, b=0.0005, decodes=4, slow_every=7, slow_factor=1.1)
    engine.run(100)
    engine.a, engine.b = 0.051, 0.0015
    engine.run(60)
    engine.a, engine.b = 0.017, 0.0005
    engine.prompts = False
    engine.run(200)
    engine.prompts = True
    start, budgets = engine.now, []
    while engine.now < start + 2.0:
        budgets.append(engine.step())
    best = limit(0.2, 0.017, 0.0005, 15)  # 288
    assert budgets[-1] >= 0.8 * best and c.correction == 1.0
    assert max(budgets) <= best


def test_budget_stays_within_bounds_and_aligned_to_the_tile():
    tight = TokenBudgetController(0.004, 32, 256)  # even an empty step breaks this SLO
    assert set(FakeEngine(tight).run(100)) == {32}
    loose = TokenBudgetController(10.0, 32, 256)
    assert FakeEngine(loose).run(100)[-1] == 256
    tiled = TokenBudgetController(0.05, 64, 512, align=64)
    assert all(b % 64 == 0 for b in FakeEngine(tiled).run(150))


def test_token_budget_mode_counts_the_decodes():
    c = TokenBudgetController(0.05, 16, 512, includes_decodes=True)
    budgets = FakeEngine(c, decodes=0).run(200)
    assert budgets[-1] >= 0.9 * limit(0.05, 0.005, 0.0001, 0)


def test_time_between_tokens_skips_preempted_requests():
    tbt = TimeBetweenTokens()

    def record(i, entries, preempted=(), finished=()):
        return StepRecord(entries=entries, index=i, preempted=preempted, finished=finished, start_time=float(i),
                          schedule_s=0, execute_s=0.5, duration_s=0.5, cpu_s=0.5, kv_blocks_used=0,
                          kv_blocks_total=1, num_running=1, num_waiting=0, token_budget=16)

    tbt.observe(record(0, (EntryRecord("a", 0, 8, True, True),)))  # first token: no gap yet
    assert tbt.observe(record(1, (EntryRecord("a", 8, 1, False, True),))) == [1.0]
    tbt.observe(record(2, (), preempted=("a",)))
    assert tbt.observe(record(5, (EntryRecord("a", 0, 9, True, True),))) == []  # recomputed: not a gap
    assert tbt.observe(record(6, (EntryRecord("a", 9, 1, False, True),), finished=("a",))) == [1.0]
    assert tbt.p99() == 1.0


def test_time_between_tokens_counts_a_plans_tokens_at_its_end():
    """A multi-step plan's tokens reach their streams together when its last record ends: one gap, then zeros."""
    tbt = TimeBetweenTokens()

    def record(start, entries, plan_step=0, plan_steps=1, finished=()):
        return StepRecord(entries=entries, index=0, preempted=(), finished=finished, start_time=start, schedule_s=0,
                          execute_s=0.5, duration_s=0.5, cpu_s=0.5, kv_blocks_used=0, kv_blocks_total=1,
                          num_running=2, num_waiting=0, token_budget=None, plan_steps=plan_steps, plan_step=plan_step)

    decode = lambda rid: EntryRecord(rid, 9, 1, False, True)  # noqa: E731
    tbt.observe(record(0.0, (EntryRecord("a", 0, 9, True, True), EntryRecord("b", 0, 9, True, True))))
    assert tbt.observe(record(0.5, (decode("a"), decode("b")), 0, 3)) == []
    assert tbt.observe(record(1.0, (decode("a"), decode("b")), 1, 3, finished=("b",))) == []
    assert tbt.observe(record(1.5, (decode("a"),), 2, 3)) == [1.5, 1.5, 0.0, 0.0, 0.0]
    assert tbt.observe(record(2.0, (decode("a"),))) == [0.5]
    # a plan whose first records came before this tracker did: the rest still count at the plan's end
    late = TimeBetweenTokens()
    assert late.observe(record(3.0, (decode("a"),), 1, 3)) == []
    assert late.observe(record(3.5, (decode("a"),), 2, 3)) == [0.0]  # its first token of "a", the next with it
    assert late.observe(record(4.0, (decode("a"),))) == [0.5]


# ---- the engine ---------------------------------------------------------------------------


@pytest.mark.parametrize("token_budget_mode", [False, True])
def test_slo_budget_keeps_greedy_outputs_and_moves_the_chunk(tiny_model, token_budget_mode):
    prompts = [[(11 * i + 3 * j) % 250 + 1 for j in range(40 + 23 * i)] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    fixed = LLM(tiny_model, chunk_size=32, max_num_seqs=4).generate(prompts, params)
    llm = LLM(tiny_model, tbt_slo_ms=1000, min_chunk_size=8, max_chunk_size=64, max_num_seqs=4,
              token_budget_mode=token_budget_mode)
    budgets = []
    llm.engine.subscribe(lambda r: budgets.append(r.token_budget))
    steered = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in steered] == [o.outputs[0].token_ids for o in fixed]
    assert budgets[0] == 8 and len(set(budgets)) > 1  # it started at the floor and grew
    assert all(8 <= b <= 64 for b in budgets)
    assert llm.engine.budget_controller.tbt_p99_s is not None


def test_slo_settings_are_checked():
    with pytest.raises(ValueError, match="tbt_slo_ms must be a positive number"):
        SchedulerConfig(tbt_slo_ms=-5)
    with pytest.raises(ValueError, match="tbt_slo_ms must be a positive number"):
        SchedulerConfig(tbt_slo_ms=0)
    with pytest.raises(ValueError, match="--scheduler sarathi"):
        SchedulerConfig(policy="request-level", tbt_slo_ms=100)
    with pytest.raises(ValueError, match="both choose the chunk size"):
        SchedulerConfig(chunk_size="auto", tbt_slo_ms=100)
    with pytest.raises(ValueError, match="min_chunk_size <= max_chunk_size"):
        EngineArgs(tbt_slo_ms=100, min_chunk_size=64, max_chunk_size=32)


def test_serve_refuses_a_bad_slo_at_startup(capsys):
    from charioteer.cli import main

    assert main(["serve", "--model", "synthetic:tiny", "--tbt-slo-ms", "-1"]) == 2
    assert "tbt_slo_ms must be a positive number" in capsys.readouterr().err


def test_metrics_show_the_budget_and_p99_tbt(tiny_model):
    from live_server import LiveServer

    from charioteer.serving.api import ServerConfig

    server = LiveServer(tiny_model, ServerConfig(), tbt_slo_ms=500, min_chunk_size=16, max_chunk_size=64)
    try:
        body = {"model": server.model, "prompt": list(range(1, 60)), "max_tokens": 8, "ignore_eos": True}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
        refused = httpx.post(server.url + "/v1/completions", json={**body, "tbt_slo_ms": -5}, timeout=60)
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["param"] == "tbt_slo_ms" and "charioteer serve --tbt-slo-ms" in error["message"]
        server.wait_idle()
        text = httpx.get(server.url + "/metrics", timeout=10).text
        values = {line.split("{")[0]: float(line.split()[-1]) for line in text.splitlines()
                  if line.startswith(("charioteer:token_budget{", "charioteer:tbt_p99_seconds{"))}
        assert 16 <= values["charioteer:token_budget"] <= 64
        assert values["charioteer:tbt_p99_seconds"] > 0
    finally:
        server.stop()


# ---- bench budget-capacity ------------------------------------------------------------------


def test_bench_budget_capacity_json(capsys):
    """SLOs no probe can miss: every search doubles from 4 req/s to --max-rate 8, for every budget."""
    import json

    from charioteer.cli import main

    rc = main(["bench", "budget-capacity", "--model", "synthetic:tiny", "--tbt-slo-ms", "1e6", "--ttft-slo-ms", "1e7",
               "--budgets", "16,64", "--workloads", "24:3,8:3", "--duration", "0.25", "--min-requests", "2",
               "--start-rate", "4", "--max-rate", "8", "--bisections", "0", "--repeats", "1", "--max-num-seqs", "4",
               "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert [(r["workload"], r["budget"]) for r in out["rows"]] == [
        (w, b) for w in ("24:3", "8:3") for b in ("16", "64", "adaptive")]
    assert all(r["capacity_rps"] == 8 for r in out["rows"])
    assert [[p["rate"] for p in r["searches"][0]["probes"]] for r in out["rows"]] == [[4, 8]] * 6
    assert [c["adaptive_over_best"] for c in out["checks"]["per_workload"]] == [1.0, 1.0]
    assert out["checks"]["fixed_within_5pct_everywhere"] == [16, 64]


def test_capacity_searches_advance_together():
    """Each budget's search probes in turn (A B A B ...), so a drift in the machine's speed lands on
    every budget alike; each search still finds its own capacity."""
    from types import SimpleNamespace

    from charioteer.bench.budget_capacity import Probe, find_capacities

    args = SimpleNamespace(start_rate=1.0, max_rate=64.0, bisections=2)
    order = []

    def prober(name, capacity):
        def probe(rate):
            order.append(name)
            return Probe(rate, 4, 0.0, 0.0, rate <= capacity, 0.0, None)
        return probe

    found = find_capacities({"a": prober("a", 3.0), "b": prober("b", 0.3), "c": prober("c", 100.0)}, args)
    assert {k: v[0] for k, v in found.items()} == {"a": 3.0, "b": 0.25, "c": 64.0}
    assert [p.rate for p in found["a"][1]] == [1.0, 2.0, 4.0, 3.0, 3.5]
    assert order[:6] == ["a", "b", "c", "a", "b", "c"]


@pytest.mark.parametrize("argv, message", [
    ([], "needs --tbt-slo-ms"),
    (["--tbt-slo-ms", "50", "--ttft-slo-ms", "1,2,3"], "one bound or one per workload"),
    (["--tbt-slo-ms", "-3"], "tbt_slo_ms must be a positive number"),
    (["--tbt-slo-ms", "50", "--duration", "0"], "--duration must be > 0"),
])
def test_bench_budget_capacity_refuses_bad_flags(capsys, argv, message):
    from charioteer.cli import main

    assert main(["bench", "budget-capacity", "--model", "synthetic:tiny", *argv]) == 2
    assert message in capsys.readouterr().err
