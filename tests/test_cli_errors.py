"""A bad command line ends in one line on stderr, `charioteer: error: ...`, exit status 2, no traceback.

Every case here fails before a model is loaded or anything is measured."""
import pytest

import charioteer.cli
from charioteer.cli import main


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("charioteer: error: ") and "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize("argv, says", [
    (["generate", "hi", "--chunk-size", "0"], "chunk_size must be an integer >= 1"),
    (["generate", "hi", "--max-num-seqs", "0"], "max_num_seqs must be >= 1"),
    (["generate", "hi", "--chunk-size", "auto", "--scheduler", "orca"], "sarathi"),
    (["generate", "hi", "--kv-cache-memory-gb", "0"], "kv_cache_memory_gb must be > 0"),
    (["info", "--model", "no-such-model"], "model 'no-such-model' not found"),
    (["serve", "--max-queue", "-1"], "--max-queue must be >= 0"),
    (["serve", "--pipeline-parallel-size", "0"], "pipeline_parallel_size must be an integer >= 1"),
    (["simulate", "--chunk-size", "0", "--no-progress"], "chunk_size must be an integer >= 1"),
    (["simulate", "--validate", "--max-num-seqs", "0"], "max_num_seqs must be >= 1"),
    (["simulate", "--validate", "--repeats", "0", "--no-progress"], "repeats must be >= 1"),
    (["simulate", "--sensitivity", "--no-progress"], "--sensitivity needs --preset paper-fig12"),
    (["tune", "--model", "synthetic:tiny"], "exactly one of --pd-ratio"),
    (["tune", "--model", "synthetic:tiny", "--pd-ratio", "10", "--max-num-seqs", "0"], "max_num_seqs must be >= 1"),
    (["tune", "--model", "synthetic:tiny", "--pd-ratio", "10", "--min-chunk-size", "0"], "--min-chunk-size"),
    (["bench", "e2e", "--model", "synthetic:tiny", "--max-num-seqs", "0"], "max_num_seqs must be >= 1"),
    (["bench", "serve", "--max-num-seqs", "0"], "max_num_seqs must be >= 1"),
    (["bench", "capacity", "--slo-tbt-ms", "100", "--min-rate", "0"], "--min-rate"),
    (["bench", "pipeline", "--pipeline-parallel-size", "1"], "must be >= 2"),
    (["bench", "peers", "--vllm-token-budget", "8"], "--vllm-token-budget must be >= 16"),
])
def test_bad_values_fail_in_one_line(argv, says, capsys):
    assert main(argv) == 2
    assert says in one_error_line(capsys)


def test_runtime_errors_are_one_line_too(monkeypatch, capsys):
    def refuse(args):
        raise RuntimeError("the device refused this configuration:\nuse --device cpu")

    monkeypatch.setattr(charioteer.cli, "cmd_info", refuse)
    assert main(["info"]) == 2
    assert one_error_line(capsys) == "charioteer: error: the device refused this configuration: use --device cpu"


def test_bugs_keep_their_traceback(monkeypatch):
    def bug(args):
        raise KeyError("oops")

    monkeypatch.setattr(charioteer.cli, "cmd_info", bug)
    with pytest.raises(KeyError):
        main(["info"])


def test_traceback_on_request(monkeypatch):
    monkeypatch.setenv("CHARIOTEER_TRACEBACK", "1")
    with pytest.raises(ValueError, match="chunk_size"):
        main(["generate", "hi", "--chunk-size", "0"])
