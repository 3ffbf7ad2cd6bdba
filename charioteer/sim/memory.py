"""Memory planner: the batch cap B from device memory, weights per device and KV per token.

The paper (section 4.3.1) reserves KV room for a request's maximum length L at admission
(reserve-max-length), so B = floor((M_G - M_S) / (L * m_kv)) with M_G the usable device memory,
M_S the weights held by the device and m_kv the KV bytes one token takes *on that device*.

With pipeline parallelism, a replica keeps `pp` micro-batches in flight and every stage holds the
KV cache of all of them for its own layers, so the per-micro-batch cap is that number over pp.

Worked example: the paper's GPT-3 175B setup on A100-80GB (what `test_sim_memory` checks):

    params      = 96 layers * 12 h^2 (h = 12288) + 2 * 50257 * h (embedding, LM head)
                = 173.95e9 + 1.235e9                                = 175.18e9
    M_G         = 0.9 * 80e9 (memory_fraction 0.9)                  = 72.0e9 bytes
    m_kv (all)  = 2 (K,V) * 96 layers * 12288 * 2 bytes             = 4,718,592 bytes/token
    L           = 4096 (Zipf lengths 1K-4K: prompt + decode <= 4K)

    TP8 alone:  M_S = 96 * 12h^2 * 2 / 8 + 2 * 50257 h * 2 / 8      = 43.80e9 (embedding/head sharded)
                m_kv = 4,718,592 / 8                                = 589,824 bytes/token
                B = floor((72.0e9 - 43.80e9) / (4096 * 589,824))
                  = floor(28.20e9 / 2.416e9) = floor(11.67)         = 11
    TP8 x PP8:  a stage holds 12 layers (+ the embedding or LM head on the first/last stage):
                M_S = (12 * 12h^2 + 50257 h) * 2 / 8                = 5.59e9
                m_kv = 2 * 12 * 12288 * 2 / 8                       = 73,728 bytes/token
                requests per stage = floor((72.0e9 - 5.59e9) / (4096 * 73,728))
                  = floor(66.41e9 / 0.302e9) = 219 -> B = floor(219 / 8 micro-batches) = 27
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from charioteer.memory.block_manager import batch_capacity
from charioteer.parallel import layers_per_stage
from charioteer.sim.specs import ClusterConfig, HardwareSpec, ModelShape


@dataclass(frozen=True)
class MemoryPlan:
    weight_bytes_per_device: int  # the most any device of the replica holds
    kv_bytes_per_token_per_device: int
    usable_bytes: int
    kv_bytes_per_device: int
    max_seq_len: int
    requests_per_replica: int  # sequences of max_seq_len whose KV fits (all micro-batches together)
    batch_cap: int  # per micro-batch (= requests_per_replica // pp)
    layers_per_stage: int

    def to_dict(self) -> dict:
        return asdict(self)


def weight_bytes_per_device(model: ModelShape, cluster: ClusterConfig) -> int:
    """M_S: the weights of the fullest device (its stage's layers, plus the embedding on the first
    stage and the LM head on the last), sharded over tp."""
    layers = layers_per_stage(model.num_layers, cluster.pp)
    worst = 0
    for s, n in enumerate(layers):
        embeddings = (s == 0) + (s == cluster.pp - 1)  # the input embedding, the LM head
        nbytes = n * model.layer_params * model.linear_weight_bytes + embeddings * model.embedding_params * model.dtype_bytes
        worst = max(worst, int(nbytes) // cluster.tp)
    return worst


def plan_memory(model: ModelShape, hardware: HardwareSpec, cluster: ClusterConfig, max_seq_len: int) -> MemoryPlan:
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
    tp, pp = cluster.tp, cluster.pp
    model.check_tp(tp)
    stage_layers = max(layers_per_stage(model.num_layers, pp))
    weights = weight_bytes_per_device(model, cluster)
    kv_token = model.kv_bytes_per_token(stage_layers, tp)
    usable = int(hardware.memory_bytes * hardware.memory_fraction)
    free = usable - weights
    if free <= 0:
        raise ValueError(f"{model.name} weights need {weights / 1e9:.1f} GB per device but {hardware.name} gives "
                         f"{usable / 1e9:.1f} GB usable: raise tp or pp")
    requests = batch_capacity(usable, weights, max_seq_len, kv_token)
    cap = requests // pp
    if cap < 1:
        raise ValueError(f"KV for one {max_seq_len}-token request per micro-batch does not fit on {hardware.name} "
                         f"with tp={tp}, pp={pp}: raise tp or pp, or shorten max_seq_len")
    return MemoryPlan(weights, kv_token, usable, free, max_seq_len, requests, cap, stage_layers)
