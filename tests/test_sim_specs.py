"""Simulator specs and memory planner: presets validate, and the paper's batch caps come out."""
import pytest

from charioteer.parallel import layers_per_stage, split_layers
from charioteer.sim.memory import plan_memory
from charioteer.sim.specs import HARDWARE_PRESETS, MODEL_PRESETS, ClusterConfig, ModelShape, hardware_spec, model_shape

GPT3 = MODEL_PRESETS["gpt3-175b"]
A100 = HARDWARE_PRESETS["a100-80gb"]


def test_gpt3_shape():
    assert GPT3.head_dim == 128
    assert GPT3.layer_params == 12 * 12288**2
    assert abs(GPT3.num_parameters / 1e9 - 175.2) < 0.1
    assert GPT3.kv_bytes_per_token() == 2 * 96 * 12288 * 2


def test_paper_batch_caps():
    """Section 5.3: cap 27 for TP8 x PP8 and 11 for TP8 alone (arithmetic in charioteer/sim/memory.py)."""
    pp = plan_memory(GPT3, A100, ClusterConfig(tp=8, pp=8), max_seq_len=4096)
    assert pp.kv_bytes_per_token_per_device == 73_728
    assert pp.layers_per_stage == 12
    assert pp.requests_per_replica == 219
    assert pp.batch_cap == 27
    tp = plan_memory(GPT3, A100, ClusterConfig(tp=8, pp=1, replicas=8), max_seq_len=4096)
    assert tp.kv_bytes_per_token_per_device == 589_824
    assert abs(tp.weight_bytes_per_device / 1e9 - 43.80) < 0.01
    assert tp.batch_cap == 11


def test_memory_planner_scales_and_rejects():
    llama = MODEL_PRESETS["llama-13b"]
    a6000 = HARDWARE_PRESETS["a6000"]
    short = plan_memory(llama, a6000, ClusterConfig(), 1024).batch_cap
    long = plan_memory(llama, a6000, ClusterConfig(), 2048).batch_cap
    assert short >= 2 * long - 1 and long >= 1
    with pytest.raises(ValueError, match="weights need"):
        plan_memory(GPT3, A100, ClusterConfig(tp=1), 4096)
    with pytest.raises(ValueError):
        plan_memory(GPT3, A100, ClusterConfig(tp=8), 0)


def test_stage_layers():
    assert layers_per_stage(96, 8) == [12] * 8
    assert layers_per_stage(10, 4) == [3, 3, 2, 2]
    assert split_layers(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]  # the pipeline executor's split
    with pytest.raises(ValueError):
        layers_per_stage(2, 4)
    with pytest.raises(ValueError, match="pp"):
        plan_memory(MODEL_PRESETS["llama-7b"], A100, ClusterConfig(pp=33, gpus_per_node=8), 2048)


def test_one_kv_formula():
    """The simulator's m_kv per device is the engine's formula over one stage's layers and one rank's KV heads."""
    from charioteer.memory.block_manager import kv_bytes_per_token

    llama70 = MODEL_PRESETS["llama2-70b"]
    assert llama70.kv_bytes_per_token() == kv_bytes_per_token(80, 8, 128, 2)
    assert llama70.kv_bytes_per_token(10, tp=4) == kv_bytes_per_token(10, 2, 128, 2)
    assert llama70.kv_bytes_per_token(10, tp=16) == kv_bytes_per_token(10, 1, 128, 2)  # GQA heads replicated
    plan = plan_memory(llama70, A100, ClusterConfig(tp=8, pp=2), 4096)
    assert plan.kv_bytes_per_token_per_device == kv_bytes_per_token(40, 1, 128, 2)


def test_presets_and_validation():
    for name in ("gpt3-175b", "llama-13b", "llama-33b", "llama2-7b", "llama2-70b"):
        assert model_shape(name).name == name
    for name in ("a100-80gb", "a6000", "h100", "h200"):
        assert hardware_spec(name).peak_flops > 1e13
    custom = model_shape("layers=4,hidden=256,ffn=1024,heads=4,mlp=2")
    assert custom.num_kv_heads == 4 and custom.mlp_matrices == 2
    with pytest.raises(ValueError, match="unknown model"):
        model_shape("gpt-5")
    with pytest.raises(ValueError, match="lacks"):
        model_shape("layers=4,hidden=256")
    with pytest.raises(ValueError):
        ModelShape("bad", 1, 64, 64, 3, 2, 10)
    with pytest.raises(ValueError, match="tp"):
        ClusterConfig(tp=0)
    with pytest.raises(ValueError, match="one node"):
        ClusterConfig(tp=16)
    with pytest.raises(ValueError, match="dispatch"):
        ClusterConfig(dispatch="random")
    with pytest.raises(ValueError):
        hardware_spec({"name": "x", "peak_flops": 1e12, "memory_bandwidth": 1e9, "memory_bytes": 1, "matmul_efficiency": 1.5})
