"""Trace files: the Azure and Vidur CSV columns, JSONL, ShareGPT conversations counted with the default
model's tokenizer, and one clear error (file, line, field) for a bad file."""
import csv
import json
import os
from datetime import datetime

import numpy as np
import pytest

from charioteer.cli import main
from charioteer.sim.traces import TraceError, default_tokenizer, read_trace, trace_has_arrivals
from charioteer.sim.workload import WorkloadSpec, make_workload

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples", "traces")
AZURE = os.path.join(EXAMPLES, "azure_llm_inference_sample.csv")
VIDUR = os.path.join(EXAMPLES, "vidur_sample.csv")
SHAREGPT = os.path.join(EXAMPLES, "sharegpt_sample.json")


@pytest.fixture(scope="module")
def tokenizer():
    return default_tokenizer()


def _csv_rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_azure_csv_columns_and_datetime_arrivals():
    rows = _csv_rows(AZURE)
    trace = read_trace(AZURE)
    assert trace.format == "csv" and len(trace) == len(rows) == 40
    assert list(trace.prompt_len) == [int(r["ContextTokens"]) for r in rows]
    assert list(trace.decode_len) == [int(r["GeneratedTokens"]) for r in rows]
    # 7-digit fractions as in the Azure files; seconds counted from the first request
    stamps = [datetime.strptime(r["TIMESTAMP"][:-1], "%Y-%m-%d %H:%M:%S.%f") for r in rows]
    expected = [(s - stamps[0]).total_seconds() for s in stamps]
    assert trace.arrival_s[0] == 0.0
    np.testing.assert_allclose(trace.arrival_s, expected, atol=1e-6)
    assert trace_has_arrivals(AZURE)


def test_vidur_csv_and_jsonl_give_the_same_requests(tmp_path):
    rows = _csv_rows(VIDUR)
    trace = read_trace(VIDUR)
    assert list(trace.prompt_len) == [int(r["num_prefill_tokens"]) for r in rows]
    assert list(trace.decode_len) == [int(r["num_decode_tokens"]) for r in rows]
    assert trace.arrival_s[0] > 0  # seconds are kept as given; only date-times count from the first request
    np.testing.assert_allclose(trace.arrival_s, [float(r["arrived_at"]) for r in rows])
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text("".join(json.dumps({"arrived_at": float(r["arrived_at"]), "num_prefill_tokens": int(r["num_prefill_tokens"]),
                                         "num_decode_tokens": int(r["num_decode_tokens"])}) + "\n" for r in rows))
    again = read_trace(str(jsonl))
    assert again.format == "jsonl"
    assert (again.prompt_len == trace.prompt_len).all() and (again.decode_len == trace.decode_len).all()
    np.testing.assert_allclose(again.arrival_s, trace.arrival_s)


def test_sharegpt_counts_tokens_with_the_default_tokenizer(tokenizer):
    with open(SHAREGPT) as f:
        items = json.load(f)
    pairs = [(c["conversations"][0]["value"], c["conversations"][1]["value"])
             for c in items if len(c["conversations"]) >= 2]
    trace = read_trace(SHAREGPT, tokenizer)
    assert trace.format == "sharegpt" and trace.arrival_s is None
    assert len(trace) == len(pairs) == len(items) - 1  # the single-turn conversation is skipped
    assert list(trace.prompt_len) == [len(tokenizer.encode(p)) for p, _ in pairs]
    assert list(trace.decode_len) == [len(tokenizer.encode(r, add_special_tokens=False)) for _, r in pairs]
    assert not trace_has_arrivals(SHAREGPT)
    # a different tokenizer gives different counts: the counts are the tokenizer's, not a character estimate
    assert list(read_trace(SHAREGPT, _Words()).prompt_len) != list(trace.prompt_len)


class _Words:
    def encode(self, text, add_special_tokens=True):
        return text.split()


def test_workload_from_traces(tokenizer, tmp_path):
    wl = make_workload(WorkloadSpec(lengths="trace", arrivals="trace", trace=AZURE))
    trace = read_trace(AZURE)
    assert len(wl) == 40 and (np.diff(wl.arrival_s) >= 0).all()
    assert sorted(wl.prompt_len) == sorted(trace.prompt_len)
    gpt = make_workload(WorkloadSpec(lengths="trace", arrivals="poisson", rate=2.0, trace=SHAREGPT, seed=3))
    assert len(gpt) == 12 and gpt.arrival_s[-1] > 0
    with pytest.raises(ValueError, match="no arrival times.*--arrivals poisson"):
        make_workload(WorkloadSpec(lengths="trace", arrivals="trace", trace=SHAREGPT))


@pytest.mark.parametrize("path, extra", [(AZURE, []), (VIDUR, []), (SHAREGPT, ["--arrivals", "poisson", "--rate", "4"])])
def test_simulate_reads_each_trace_format(capsys, path, extra):
    rc = main(["simulate", "--trace", path, *extra, "--model", "llama-7b", "--scheduler", "sarathi", "--json",
               "--no-progress"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    run = out["runs"][0]
    assert run["num_requests"] == len(read_trace(path, _Words()) if path == SHAREGPT else read_trace(path))
    assert out["workload"]["lengths"] == "trace"
    assert out["workload"]["arrivals"] == ("poisson" if extra else "trace")
    assert run["completion_time_s"] > 0


# (file name, content, what the one error line must name)
BAD_FILES = [
    ("no_prompt.csv", "TIMESTAMP,GeneratedTokens\n2023-11-16 18:15:46,3\n", ["line 1", "prompt-token", "ContextTokens"]),
    ("words.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,10,3\n2023-11-16 18:15:47,ten,3\n",
     ["line 3", "'ContextTokens'", "'ten'"]),
    ("zero.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\n0.5,12,0\n", ["line 2", "'num_decode_tokens'", ">= 1"]),
    ("fraction.csv", "arrival_s,prompt_len,decode_len\n0,12.5,3\n", ["line 2", "'prompt_len'", "whole number"]),
    ("stamp.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,10,3\nyesterday,10,3\n",
     ["line 3", "'TIMESTAMP'", "'yesterday'"]),
    ("negative.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\n0.5,12,3\n-1,12,3\n", ["line 3", ">= 0"]),
    ("mixed.csv", "arrival_s,prompt_len,decode_len\n0.5,10,3\n2023-11-16 18:15:46,10,3\n", ["line 3", "mixes"]),
    ("short.csv", "arrival_s,prompt_len,decode_len\n0.5,10,3\n0.7,10\n", ["line 3", "'decode_len'", "missing"]),
    ("long.csv", "arrival_s,prompt_len,decode_len\n0.5,10,3,9\n", ["line 2", "4 values for 3"]),
    ("header.csv", "arrival_s,prompt_len,decode_len\n", ["no requests"]),
    ("bad.jsonl", '{"prompt_len": 5, "decode_len": 2}\n{"prompt_len": 5, "decode_len": }\n', ["line 2", "not valid JSON"]),
    ("gpt_syntax.json", '[\n {"conversations": [{"from": "human", "value": "hi"},\n  {"from": "gpt", "value": "yo"}]}\n'
                        ' {"conversations": []}\n]\n', ["line 4", "expected , or ]"]),
    ("gpt_turn.json", '[\n {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},\n'
                      ' {"conversations": [{"from": "human", "value": 7}, {"from": "gpt", "value": "x"}]}\n]\n',
     ["line 3", "conversations[0].value", "string"]),
    ("gpt_item.json", '[\n {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},\n'
                      ' "just text"\n]\n', ["line 3", "'conversations'"]),
    ("gpt_open.json", '[\n {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}\n',
     ["line 3", "expected , or ]"]),
    ("gpt_empty.json", '[{"conversations": [{"from": "human", "value": "hi"}]}]', ["no conversation"]),
]


@pytest.mark.parametrize("name, content, needles", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_a_bad_trace_gets_one_error_naming_line_and_field(tmp_path, name, content, needles):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(TraceError) as info:
        read_trace(str(path), _Words())
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    for needle in needles:
        assert needle in message, message


def test_simulate_reports_a_bad_trace_on_one_line(capsys, tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,10,3\n2023-11-16 18:15:47,-4,3\n")
    assert main(["simulate", "--trace", str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "line 3" in err[0] and "'ContextTokens'" in err[0], err
    assert main(["simulate", "--trace", str(tmp_path / "missing.csv"), "--no-progress"]) == 2
    assert "cannot be read" in capsys.readouterr().err


def test_a_spreadsheet_byte_order_mark_is_not_part_of_the_header(tmp_path):
    path = tmp_path / "excel.csv"
    path.write_bytes(b"\xef\xbb\xbfTIMESTAMP,ContextTokens,GeneratedTokens\r\n2023-11-16 18:15:46,10,3\r\n"
                     b"2023-11-16 18:15:48.5,12,4\r\n")
    trace = read_trace(str(path))
    assert trace_has_arrivals(str(path))
    assert list(trace.prompt_len) == [10, 12] and list(trace.arrival_s) == [0.0, 2.5]
