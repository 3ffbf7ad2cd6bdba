"""Each setting is declared once (charioteer.config): flags, defaults, help and EngineArgs come from there."""
import argparse
import dataclasses

import pytest

from charioteer.cli import build_parser, main
from charioteer.config import (ENGINE_CLI_SETTINGS, CacheConfig, EngineArgs, SchedulerConfig, add_setting_args,
                               config_from_args, setting_default, setting_fields, setting_flag, setting_kwargs)


def subparser(*path: str) -> argparse.ArgumentParser:
    parser = build_parser()
    for name in path:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


def all_commands(parser=None, path=()):
    parser = parser or build_parser()
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
    for action in subs:
        for name, child in action.choices.items():
            yield from all_commands(child, path + (name,))


def test_generate_flags_have_the_declared_defaults_and_help():
    parser = subparser("generate")
    fields = setting_fields()
    by_dest = {a.dest: a for a in parser._actions}
    assert set(ENGINE_CLI_SETTINGS) <= set(by_dest)
    for name in ENGINE_CLI_SETTINGS:
        action, f = by_dest[name], fields[name]
        off = ["--no-" + setting_flag(name)[2:]] if str(f.type) == "bool | None" else []  # on, off, or the default
        assert action.option_strings == [setting_flag(name)] + off
        assert action.default == f.default
        assert action.help.startswith(f.metadata["help"].replace("%", "%%"))
    text = parser.format_help()
    assert "--chunk-size C" in text and "(default: 256)" in text and "--max-num-seqs B" in text
    assert setting_default("chunk_size") == SchedulerConfig().chunk_size == 256


def test_parsed_flags_give_back_the_engine_args():
    args = build_parser().parse_args(["generate", "hi", "--scheduler", "orca", "--chunk-size", "64",
                                      "--max-num-seqs", "4", "--num-kv-blocks", "10", "--pipeline-parallel-size", "2"])
    engine_args = EngineArgs.from_args(args)
    assert engine_args == EngineArgs(scheduler="orca", chunk_size=64, max_num_seqs=4, num_kv_blocks=10,
                                     pipeline_parallel_size=2)
    assert engine_args.scheduler_config.policy == "orca" and engine_args.cache_config.num_blocks == 10
    assert "seed" not in setting_kwargs(args)  # generate's --seed is the sampling seed, not the weights'
    defaults = EngineArgs.from_args(build_parser().parse_args(["generate", "hi"]))
    assert defaults == EngineArgs()
    assert config_from_args(CacheConfig, args) == CacheConfig(num_blocks=10)


def test_engine_args_take_flat_keywords_and_read_them_back():
    args = EngineArgs(model="synthetic:tiny", scheduler="vllm", max_num_seqs=3, kv_cache_memory_gb=0.5, seed=7,
                      micro_batch_cap=2)
    assert (args.model, args.scheduler, args.max_num_seqs, args.seed, args.micro_batch_cap) == \
        ("synthetic:tiny", "vllm", 3, 7, 2)
    assert args.cache_config.memory_bytes == 1 << 29
    assert EngineArgs(**args.to_kwargs()) == args
    assert dataclasses.replace(args, scheduler_config=SchedulerConfig(max_num_seqs=5)).max_num_seqs == 5
    with pytest.raises(TypeError, match="'batch_cap'"):
        EngineArgs(batch_cap=4)
    with pytest.raises(AttributeError):
        args.max_num_seqs = 4  # read-only: build new args instead
    with pytest.raises(ValueError, match="not both"):
        EngineArgs(scheduler_config=SchedulerConfig(), chunk_size=8)


def test_overrides_are_explicit_and_unknown_settings_are_refused():
    p = argparse.ArgumentParser()
    add_setting_args(p, ["chunk_size", "max_num_seqs"], overrides={"chunk_size": dict(default=32, type=int)})
    args = p.parse_args([])
    assert (args.chunk_size, args.max_num_seqs) == (32, 32)
    assert "(default: 32)" in p.format_help()
    with pytest.raises(KeyError):
        add_setting_args(argparse.ArgumentParser(), ["batch_cap"])
    with pytest.raises(KeyError):
        add_setting_args(argparse.ArgumentParser(), ["chunk_size"], overrides={"tile_size": {}})


def test_one_name_for_the_batch_cap():
    for path, parser in all_commands():
        flags = {s for a in parser._actions for s in a.option_strings}
        assert "--batch-cap" not in flags, path
        # `profile --batch-size` is the measured batch's shape (Table 2), not a cap.
        assert "--batch-size" not in flags or path == ("profile",), path
    for path in [("simulate",), ("tune",), ("bench", "e2e"), ("bench", "chunk-ablation"), ("bench", "adaptive"),
                 ("bench", "pipeline"), ("bench", "serve"), ("serve",), ("info",)]:
        assert "--max-num-seqs" in subparser(*path).format_help(), path


# Commands that run a model but set its precision otherwise: peers and single-stream run several (--dtypes,
# --formats); simulate models GPUs, whose cost model knows dtypes but not our CPU quantizations; search-check
# checks simulate's recommendation on the server it starts, unquantized as simulate assumes.
PRECISION_ELSEWHERE = {("bench", "peers"): "--dtypes", ("bench", "single-stream"): "--formats"}
DTYPE_ONLY = {("simulate",), ("bench", "search-check")}


def test_every_command_that_runs_a_model_takes_its_precision():
    """Issue 17: --dtype on every command and bench subcommand, with --quantization beside it."""
    checked = 0
    for path, parser in all_commands():
        flags = {s for a in parser._actions for s in a.option_strings}
        if "--model" not in flags:
            continue
        checked += 1
        if path in PRECISION_ELSEWHERE:
            assert PRECISION_ELSEWHERE[path] in flags, path
            continue
        assert "--dtype" in flags, path
        assert ("--quantization" in flags) == (path not in DTYPE_ONLY), path
    assert checked >= 15


@pytest.fixture
def fake_validate(monkeypatch):
    """Record what `simulate --validate` passes to the validator instead of running the real engine."""
    from charioteer.sim import validate as sim_validate

    calls = []

    def validate(**kwargs):
        calls.append({k: v for k, v in kwargs.items() if k != "progress"})
        policy = {"per_batch_mape": 0.1, "repeat_spread": 0.2, "validation_batches": 3, "measured_completion_s": 1.0,
                  "run_totals_median_s": 1.05, "simulated_completion_s": 1.1, "completion_error": 0.1, "same_batch_sequence": True}
        return {"model": kwargs["model"], "dtype": kwargs["dtype"], "chunk_size": kwargs["chunk_size"],
                "batch_cap": kwargs["batch_cap"],
                "validation_runs": kwargs["repeats"], "calibration_batches": 10,
                "policies": [{"policy": p, **policy} for p in kwargs["policies"]]}

    monkeypatch.setattr(sim_validate, "validate", validate)
    return calls


def test_simulate_validate_explicit_chunk_size_wins(fake_validate, capsys):
    from charioteer.sim import validate as sim_validate

    assert main(["simulate", "--validate", "--chunk-size", "256", "--json"]) == 0
    assert fake_validate[-1]["chunk_size"] == 256  # was silently 64 when 256 was asked for
    assert main(["simulate", "--validate", "--json"]) == 0
    assert fake_validate[-1]["chunk_size"] == 64 and fake_validate[-1]["batch_cap"] == 8  # the command's defaults
    assert main(["simulate", "--validate", "--scheduler", "orca", "--max-num-seqs", "4", "--chunk-size", "32"]) == 0
    assert fake_validate[-1] == dict(policies=["orca"], batch_cap=4, chunk_size=32, num_requests=24, seed=1,
                                     repeats=9, dtype="float32", model=sim_validate.VALIDATION_MODEL)
    assert main(["simulate", "--validate", "--repeats", "3", "--dtype", "bfloat16", "--no-progress"]) == 0
    assert fake_validate[-1]["policies"] == ("sarathi", "orca", "request-level", "vllm")  # all four by default
    assert fake_validate[-1]["repeats"] == 3 and fake_validate[-1]["dtype"] == "bfloat16"
    assert "| vllm | 3 | 10.0 % | 20 % |" in capsys.readouterr().out
    assert main(["simulate", "--validate", "--validation-model", sim_validate.SMALL_VALIDATION_MODEL, "--json"]) == 0
    assert fake_validate[-1]["model"] == sim_validate.SMALL_VALIDATION_MODEL


def test_simulate_default_chunk_size_is_the_declared_one():
    from charioteer.sim.cli import build_runs

    args = build_parser().parse_args(["simulate", "--model", "llama-7b", "--num-requests", "5"])
    specs, _ = build_runs(args)
    assert specs[0].chunk_size == setting_default("chunk_size") and specs[0].batch_cap is None
    args = build_parser().parse_args(["simulate", "--model", "llama-7b", "--chunk-size", "64", "--max-num-seqs", "3"])
    specs, _ = build_runs(args)
    assert (specs[0].chunk_size, specs[0].batch_cap) == (64, 3)
