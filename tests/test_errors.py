"""Bad input fails fast with a ValueError that says what to change; the engine keeps serving."""
import pytest

from charioteer import LLM, SamplingParams
from charioteer.config import EngineArgs
from charioteer.memory.block_manager import kv_bytes_per_token
from charioteer.model.loader import load_model
from charioteer.runtime import available_memory_bytes


@pytest.fixture(scope="module")
def llm(default_model):
    return LLM(default_model, max_model_len=512)


@pytest.mark.parametrize("make_params, message", [
    (lambda: SamplingParams(max_tokens=0), "max_tokens must be an integer >= 1"),
    (lambda: SamplingParams(temperature=-0.5), "temperature must be >= 0"),
    (lambda: SamplingParams(top_p=0.0), "top_p must be in (0, 1]"),
    (lambda: SamplingParams(top_p=1.5), "top_p must be in (0, 1]"),
])
def test_bad_sampling_params(make_params, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        make_params()


@pytest.mark.parametrize("kwargs, message", [
    (dict(scheduler="fcfs"), "unknown scheduler 'fcfs': choose one of sarathi, orca, vllm, request-level"),
    (dict(chunk_size=0), "chunk_size must be an integer >= 1 or .auto., got 0"),
    (dict(kv_policy="static"), "unknown kv_policy 'static'"),
    (dict(max_num_seqs=0), "max_num_seqs must be >= 1"),
])
def test_bad_engine_args_fail_before_loading(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)


@pytest.mark.skipif(available_memory_bytes() is None, reason="no MemAvailable in /proc/meminfo")
@pytest.mark.parametrize("setting", ["kv_cache_memory_gb", "num_kv_blocks"])
def test_a_kv_cache_larger_than_the_free_memory_is_refused_at_start(tiny_model, setting):
    # half as much again as is free: without the check, a cache that Linux's overcommit lets through (one below
    # the machine's total) starts and is killed for memory once serving has written more than is free
    too_much = available_memory_bytes() * 3 // 2
    per_block = 16 * kv_bytes_per_token(tiny_model.config.num_layers, tiny_model.config.num_kv_heads,
                                        tiny_model.config.head_dim, 4)
    value = too_much / (1 << 30) if setting == "kv_cache_memory_gb" else too_much // per_block
    with pytest.raises(ValueError, match=r"the KV cache would take [\d.]+ GiB \(\d+ blocks of 16 tokens\) but only "
                                         r"[\d.]+ GiB of memory is available: lower --kv-cache-memory-gb"):
        LLM(tiny_model, **{setting: value})
    assert LLM(tiny_model, kv_cache_memory_gb=0.01).generate([[1, 2, 3]], SamplingParams(max_tokens=2))


def test_empty_prompts(llm):
    for prompt in ("", []):
        with pytest.raises(ValueError, match="prompt is empty"):
            llm.generate([prompt])


def test_prompt_over_context_states_both_numbers(llm):
    ids = llm.tokenizer.encode("word " * 300)
    with pytest.raises(ValueError, match=rf"prompt has {len(ids)} tokens and max_tokens is 300: together "
                                         rf"{len(ids) + 300}, over the model's context of 512"):
        llm.generate([ids], SamplingParams(max_tokens=300))


def test_bad_token_ids(llm):
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 49152\)"):
        llm.generate([[1, 2, 99999]])


def test_one_bad_prompt_queues_nothing_and_engine_keeps_serving(llm):
    good = "Name a colour."
    params = SamplingParams(temperature=0, max_tokens=8)
    with pytest.raises(ValueError):
        llm.generate([good, ""], params)
    assert not llm.engine.has_unfinished_requests()
    first = llm.generate([good], params)[0]
    # A bad request added beside running ones is refused; the running ones finish normally.
    engine = llm.engine
    request_id = engine.add_request(good, params)
    with pytest.raises(ValueError):
        engine.add_request(good, SamplingParams(max_tokens=0))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.request_id for o in outputs] == [request_id]
    assert outputs[0].outputs[0].token_ids == first.outputs[0].token_ids
    assert engine.blocks.num_used_blocks == 0


def test_abort_frees_kv_at_once(llm):
    engine = llm.engine
    ids = [engine.add_request("Tell me a long story about a dragon.", SamplingParams(max_tokens=200))
           for _ in range(3)]
    for _ in range(3):
        engine.step()
    assert engine.blocks.num_used_blocks > 0
    for request_id in ids:
        engine.abort(request_id)
    assert engine.blocks.num_used_blocks == 0
    assert not engine.has_unfinished_requests()


def test_missing_model_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_model(str(tmp_path / "nope.gguf"))


def test_broken_gguf_file(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    with pytest.raises(ValueError, match="could not read GGUF file"):
        load_model(str(path))


def test_hf_dir_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(str(tmp_path))


def test_synthetic_spec_errors():
    with pytest.raises(ValueError, match="unknown synthetic preset 'llama-8b'"):
        load_model("synthetic:llama-8b")
    with pytest.raises(ValueError, match="bad synthetic shape item"):
        load_model("synthetic:tiny,wings=2")


def test_string_prompt_needs_tokenizer(tiny_model):
    with pytest.raises(ValueError, match="has no tokenizer: give prompts as lists of token ids"):
        LLM(tiny_model).generate(["hello"])
