"""Model loading: synthetic shapes, the GGUF's own metadata, and the CLI on the default model."""
import os
import subprocess
import sys

import pytest
import torch

from charioteer import LLM, SamplingParams
from charioteer.model.loader import SYNTHETIC_PRESETS, load_model, parse_synthetic_spec

CLI = [sys.executable, "-m", "charioteer.cli"]


def test_default_model_shape(default_model):
    c = default_model.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size) == (30, 576, 9, 3, 49152)
    assert c.tie_word_embeddings and "lm_head.weight" not in default_model.state_dict
    assert c.eos_token_id == 2 and c.rope_theta == 100000.0
    assert all(t.dtype == torch.float32 for t in default_model.state_dict.values())


@pytest.mark.parametrize("name, layers, hidden", [("llama-7b", 2, 4096), ("llama-13b", 3, 5120)])
def test_paper_shapes_with_chosen_layers(name, layers, hidden):
    c = parse_synthetic_spec(f"{name},layers={layers}")
    assert (c.num_layers, c.hidden_size, c.num_heads) == (layers, hidden, SYNTHETIC_PRESETS[name]["num_heads"])
    assert c.head_dim == 128


def test_synthetic_shape_by_numbers_runs():
    model = load_model("synthetic:vocab=300,hidden=64,intermediate=96,layers=1,heads=4,kv_heads=1")
    assert model.config.head_dim == 16 and model.tokenizer is None
    out = LLM(model).generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 5


def test_synthetic_weights_are_seeded():
    a = load_model("synthetic:tiny", seed=1).state_dict["model.layers.0.self_attn.q_proj.weight"]
    b = load_model("synthetic:tiny", seed=1).state_dict["model.layers.0.self_attn.q_proj.weight"]
    c = load_model("synthetic:tiny", seed=2).state_dict["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_cli_help_documents_every_command():
    out = subprocess.run(CLI + ["--help"], capture_output=True, text=True, check=True).stdout
    for command in ("generate", "info"):
        assert command in out
    gen = subprocess.run(CLI + ["generate", "--help"], capture_output=True, text=True, check=True).stdout
    for flag in ("--chat", "--model", "--scheduler", "--chunk-size", "--max-tokens", "--temperature"):
        assert flag in gen


def test_cli_generate_streams_chat_answer():
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        CLI + ["generate", "--chat", "What is the capital of France? Answer in one word.", "--max-tokens", "12",
               "--chunk-size", "8", "--stats"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert '"tokens_per_s"' in proc.stderr


def test_cli_reports_bad_input_clearly():
    proc = subprocess.run(CLI + ["generate", "hi", "--model", "synthetic:tiny"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "has no tokenizer" in proc.stderr
