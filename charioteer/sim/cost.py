"""Cost of one batch on one pipeline stage.

`RooflineCostModel` prices a batch plan (`Batch.plan()`: its (num_tokens, start, is_prefill)
rows, or any such triples) per layer on one device of a TP group:

- Linear layers (QKV, O, MLP): each GEMM of M = batch tokens rows is
  max(FLOPs / (peak * matmul_efficiency), bytes / (bandwidth * memory_efficiency)) where the FLOPs
  are counted on the padded tile grid (M and N rounded up to tile_m / tile_n: tile quantization)
  and, once the grid has at least one full wave of tiles, multiplied by the partial-wave waste
  (wave quantization: ceil(tiles / SMs) * SMs / tiles). Below one wave cuBLAS splits K across SMs,
  so no wave waste is charged there.
- Prefill attention for a chunk of c tokens after k cached ones: causal FLOPs
  4 * c * (k + (c + 1) / 2) * head_dim * heads, bytes = the K/V of k + c tokens plus Q and O;
  roofline with attention_efficiency and attention_memory_efficiency.
- Decode attention: one kernel over all decodes, FLOPs and K/V bytes summed over each request's
  own context length.
- Element-wise work (norms, residuals, activation) as bytes over bandwidth.
- TP: two ring all-reduces of the layer's activations per layer: 2 (tp-1) hops of latency plus
  2 (tp-1)/tp * bytes over the intra-node link.
- PP: a send/recv of the activations between stages (each TP rank sends its 1/tp slice over its
  own NIC); it delays the micro-batch but does not occupy either stage's compute.
- The last stage also runs the LM head for the sampled positions.
Every kernel pays `kernel_overhead_s`. Every layer is priced on every row: the engine's last layer runs
its O projection and MLP on the sampled rows alone (`LlamaModel.full_last_layer`), a share of a batch's
linear work this leaves in, at most 1 / layers of it.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

from charioteer.parallel import kv_heads_per_rank, layers_per_stage
from charioteer.scheduling.base import PlanRow
from charioteer.sim.specs import ClusterConfig, HardwareSpec, ModelShape

Plan = list[PlanRow]  # Batch.plan(): (num_tokens, start, is_prefill) per request


class CostModel:
    """Interface: per-stage busy times, the stage-to-stage transfer time and the useful FLOPs of a batch."""

    num_stages: int = 1

    def batch_cost(self, plan: Plan) -> tuple[list[float], float, float]:
        raise NotImplementedError

    def for_replica(self) -> "CostModel":
        """The model one replica prices its batches with: itself, unless it keeps a history of them."""
        return self


class FixedCostModel(CostModel):
    """Every stage takes `stage_time_s` (or `fn(plan)` if given) per batch; transfers take `p2p_s`."""

    def __init__(self, num_stages: int = 1, stage_time_s: float = 1.0, p2p_s: float = 0.0, fn=None) -> None:
        self.num_stages = num_stages
        self.stage_time_s = stage_time_s
        self.p2p_s = p2p_s
        self.fn = fn

    def batch_cost(self, plan):
        t = self.fn(plan) if self.fn is not None else self.stage_time_s
        return [t] * self.num_stages, self.p2p_s, 0.0


class RooflineCostModel(CostModel):
    def __init__(self, model: ModelShape, hardware: HardwareSpec, cluster: ClusterConfig) -> None:
        self.model, self.hw, self.cluster = model, hardware, cluster
        tp = cluster.tp
        model.check_tp(tp)
        self.layers = layers_per_stage(model.num_layers, cluster.pp)
        self.num_stages = cluster.pp
        h = model.hidden_size
        self.heads = model.num_heads // tp
        self.kv_heads = kv_heads_per_rank(model.num_kv_heads, tp)
        self.hd = model.head_dim
        self.dtype = model.dtype_bytes
        inter = model.intermediate_size // tp
        up = (model.mlp_matrices - 1) * inter  # gate and up fused for SwiGLU
        self.gemms = [  # (N, K) per layer on one device
            ((model.q_size + 2 * model.kv_size) // tp, h),
            (h, model.q_size // tp),
            (up, h),
            (h, inter),
        ]
        self.inter = inter
        self._flop_rate = hardware.peak_flops * hardware.matmul_efficiency
        self._att_rate = hardware.peak_flops * hardware.attention_efficiency
        self._bw = hardware.memory_bandwidth * hardware.memory_efficiency
        att_eff = hardware.attention_memory_efficiency
        self._att_bw = hardware.memory_bandwidth * (hardware.memory_efficiency if att_eff is None else att_eff)
        self._ovh = hardware.kernel_overhead_s
        self._linear_cache: dict[int, float] = {}
        self._lm_cache: dict[int, float] = {}
        bw_pp, lat_pp = cluster.pp_link()
        self._pp_bw = bw_pp * cluster.link_efficiency
        self._pp_lat = lat_pp
        self._ar_bw = cluster.intra_node_bandwidth * cluster.link_efficiency
        self._ar_lat = cluster.intra_node_latency
        # Useful (unpadded) FLOPs per token for the whole model, for MFU.
        self._flops_per_token = 2 * model.num_layers * model.layer_params

    # ---- pieces -------------------------------------------------------------------------------

    def gemm_time(self, m: int, n: int, k: int) -> float:
        hw = self.hw
        tiles_m = -(-m // hw.tile_m)
        tiles_n = -(-n // hw.tile_n)
        tiles = tiles_m * tiles_n
        flops = 2.0 * tiles_m * hw.tile_m * tiles_n * hw.tile_n * k
        if tiles >= hw.num_sms:
            flops *= math.ceil(tiles / hw.num_sms) * hw.num_sms / tiles
        compute = flops / self._flop_rate
        memory = ((m * k + m * n) * self.dtype + k * n * self.model.linear_weight_bytes) / self._bw
        return max(compute, memory) + self._ovh

    def linear_time(self, num_tokens: int) -> float:
        """One layer's QKV, O and MLP GEMMs plus element-wise work, for `num_tokens` rows."""
        t = self._linear_cache.get(num_tokens)
        if t is None:
            t = sum(self.gemm_time(num_tokens, n, k) for n, k in self.gemms)
            h = self.model.hidden_size
            elementwise_bytes = num_tokens * (10 * h + 3 * self.inter) * self.dtype
            t += elementwise_bytes / self._bw + 5 * self._ovh
            self._linear_cache[num_tokens] = t
        return t

    def prefill_attention_time(self, chunk: int, cached: int) -> float:
        flops = 4.0 * chunk * (cached + (chunk + 1) / 2) * self.hd * self.heads
        nbytes = ((cached + chunk) * 2 * self.kv_heads + 2 * chunk * self.heads) * self.hd * self.dtype
        return max(flops / self._att_rate, nbytes / self._att_bw) + self._ovh

    def decode_attention_time(self, context_lens: Iterable[int]) -> float:
        total = sum(context_lens)
        if not total:
            return 0.0
        flops = 4.0 * total * self.hd * self.heads
        nbytes = total * 2 * self.kv_heads * self.hd * self.dtype
        return max(flops / self._att_rate, nbytes / self._att_bw) + self._ovh

    def allreduce_time(self, num_tokens: int) -> float:
        tp = self.cluster.tp
        if tp == 1:
            return 0.0
        nbytes = num_tokens * self.model.hidden_size * self.dtype
        return 2 * (tp - 1) * self._ar_lat + 2 * (tp - 1) / tp * nbytes / self._ar_bw + self._ovh

    def p2p_time(self, num_tokens: int) -> float:
        if self.cluster.pp == 1:
            return 0.0
        nbytes = num_tokens * self.model.hidden_size * self.dtype / self.cluster.tp
        return self._pp_lat + nbytes / self._pp_bw

    def lm_head_time(self, num_samples: int) -> float:
        if num_samples == 0:
            return 0.0
        t = self._lm_cache.get(num_samples)
        if t is None:
            t = self.gemm_time(num_samples, -(-self.model.vocab_size // self.cluster.tp), self.model.hidden_size)
            self._lm_cache[num_samples] = t
        return t

    # ---- a batch ----------------------------------------------------------------------------

    def _layer_and_flops(self, plan: Plan) -> tuple[float, int, float]:
        """(one layer's time on one device, tokens, attention FLOPs of one layer, whole model width)."""
        tokens = 0
        attention = 0.0
        decode_ctx = 0
        att_tokens = 0.0  # sum over entries of num * (start + (num + 1) / 2)
        for num, start, is_prefill in plan:
            tokens += num
            if is_prefill:
                attention += self.prefill_attention_time(num, start)
                att_tokens += num * (start + (num + 1) / 2)
            else:
                decode_ctx += start + num
                att_tokens += start + 1
        if decode_ctx:
            attention += self.decode_attention_time((decode_ctx,))
        t = self.linear_time(tokens) + attention + 2 * self.allreduce_time(tokens)
        return t, tokens, 4.0 * att_tokens * self.model.head_dim * self.model.num_heads

    def batch_cost(self, plan: Plan, num_samples: int | None = None):
        """(busy seconds per stage, seconds per stage-to-stage transfer, useful FLOPs of the whole batch)."""
        if num_samples is None:
            num_samples = len(plan)
        per_layer, tokens, att_flops = self._layer_and_flops(plan)
        times = [n * per_layer for n in self.layers]
        times[-1] += self.lm_head_time(num_samples)
        flops = (self._flops_per_token * tokens + self.model.num_layers * att_flops
                 + 2.0 * num_samples * self.model.hidden_size * self.model.vocab_size)
        return times, self.p2p_time(tokens), flops


class ProfiledCostModel(RooflineCostModel):
    """Layer time from a table measured on the real engine (`charioteer tune --save-table`).

    The table holds the measured time of a batch of n prompt rows (n = 1..N; linear layers, their
    attention and element-wise work) and of one decode's attention at a known context. Per layer:
    linear time = table(n) / measured layers; decode attention scales with context length.
    Communication (TP all-reduce, PP send/recv), the LM head and the stage split stay as in the
    roofline model. Only valid for the model shape and device that were measured.
    """

    def __init__(self, model: ModelShape, hardware: HardwareSpec, cluster: ClusterConfig, table) -> None:
        super().__init__(model, hardware, cluster)
        if cluster.tp != 1:
            raise ValueError("a profiled table is per device: use it with --tp 1")
        if table.hidden_size and table.hidden_size != model.hidden_size:
            raise ValueError(f"the table was measured on hidden size {table.hidden_size}, the model has {model.hidden_size}")
        self.table = table
        self._per_layer = 1e-3 / max(table.num_layers, 1)

    def linear_time(self, num_tokens: int) -> float:
        return self.table.rows_ms(num_tokens) * self._per_layer if num_tokens else 0.0

    def prefill_attention_time(self, chunk: int, cached: int) -> float:
        return 0.0  # inside the measured batch times (cached prefixes are short next to the chunk)

    def decode_attention_time(self, context_lens) -> float:
        total = sum(context_lens)
        if not total or not self.table.context_len:
            return 0.0
        return self.table.decode_attention_ms * self._per_layer * total / self.table.context_len
