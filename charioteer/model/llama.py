"""A LLaMA-family transformer over a flat batch of tokens.

The linear layers (fused QKV, O, fused gate/up, down) run once over every token of the batch.
Attention runs per request against its own KV cache: each prefill chunk attends causally to its
cached prefix and to itself (the paper's Figure 6); all decodes run as one call, on AVX-512 CPUs
a kernel reading each context in place (charioteer.model.avx512), else one padded, masked SDPA.
On AVX-512 CPUs a decode-only batch runs every layer in one C++ call of the same kernels.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from charioteer.model import avx512
from charioteer.model.config import ModelConfig
from charioteer.runtime import tune_allocator


@dataclass
class PrefillSpan:
    """One prompt chunk inside the flat batch."""

    offset: int  # first row of the chunk in the flat batch
    num_tokens: int
    start_pos: int  # position of its first token in the request
    context_slots: torch.Tensor | None  # KV slots of positions [0, start_pos + num_tokens); None if start_pos == 0
    mask: torch.Tensor | None  # [num_tokens, context] causal mask when start_pos > 0
    context_start: int | None = None  # first slot, when the context's slots are one contiguous run


@dataclass
class ForwardInput:
    token_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] where each token's K/V is written
    prefills: list[PrefillSpan]
    num_decodes: int  # decode tokens are the last rows of the batch
    decode_slots: torch.Tensor | None  # [D, max_context] padded with the cache's zero slot
    decode_mask: torch.Tensor | None  # [D, 1, 1, max_context]
    logits_rows: torch.Tensor  # rows whose logits are wanted
    # (first slot, context length) of each decode, when every decode's slots are one contiguous run
    decode_runs: list[tuple[int, int]] | None = None
    decode_lengths: torch.Tensor | None = None  # [D] context length of each decode (int64, CPU)


class KVCache:
    """K and V for every layer: [layers, 2, slots + 1, kv_heads, head_dim].

    The extra last slot stays zero; padded decode gathers point at it, so masked positions never
    multiply garbage (0 * NaN would poison the output).
    """

    def __init__(self, config: ModelConfig, num_slots: int, device: torch.device, dtype=torch.float32,
                 num_layers: int | None = None) -> None:
        """`num_layers`: layers held here (a pipeline stage holds only its own); default all."""
        self.num_slots = num_slots
        self.pad_slot = num_slots
        self.data = torch.empty(
            num_layers if num_layers is not None else config.num_layers, 2, num_slots + 1,
            config.num_kv_heads, config.head_dim, device=device, dtype=dtype,
        )
        self.data[:, :, self.pad_slot].zero_()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps): torch's fused kernel, bitwise equal to the op-by-op formula
    (tests/test_llama_ops.py)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half(x) = (-x2, x1) written as roll(x) * (-1, 1).

    Negating sin instead of x gives the same bits, and rolling needs one op instead of two slices,
    a negation and a cat.
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


# MKL's packed sgemm (the weight reordered once for its kernels) beats plain sgemm here for
# up to 64 rows: 2x at 8 rows, 1.3x at 16-64 (charioteer bench tile shows the curve); above 64
# rows it is no faster, so larger batches use F.linear on the original weight.
PACKED_GEMM_MAX_ROWS = 64


def packed_gemm_available(device: torch.device) -> bool:
    return (device.type == "cpu" and torch.backends.mkl.is_available()
            and hasattr(torch.ops.mkl, "_mkl_linear") and os.environ.get("CHARIOTEER_PACKED_GEMM", "1") != "0")


DECODE_IN_PLACE_MIN_BYTES = 512 * 1024


class Linear:
    """y = x @ weight.T: the panel kernel up to 32 rows, MKL's packed GEMM up to 64, else F.linear.

    Each path is used only where it is available (see avx512 and packed_gemm_available).
    """

    __slots__ = ("weight", "packed", "panels")

    def __init__(self, weight: torch.Tensor, pack: bool, panels: bool = False) -> None:
        self.weight = weight
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, PACKED_GEMM_MAX_ROWS) if pack else None
        self.panels = avx512.pack(weight) if panels else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.panels is not None and 0 < rows <= avx512.MAX_ROWS:
            return avx512.linear(x, self.panels, self.weight.shape[0])
        if self.packed is not None and 0 < rows <= PACKED_GEMM_MAX_ROWS:
            return torch.ops.mkl._mkl_linear(x.contiguous(), self.packed, self.weight, None, rows)
        return F.linear(x, self.weight)


def stage_weight_names(config: ModelConfig, layer_range: tuple[int, int]) -> list[str]:
    """State-dict names a model holding layers [start, end) needs (a pipeline stage's share)."""
    start, end = layer_range
    first, last = start == 0, end == config.num_layers
    names = []
    if first or (last and config.tie_word_embeddings):
        names.append("model.embed_tokens.weight")
    if last:
        names.append("model.norm.weight")
        if not config.tie_word_embeddings:
            names.append("lm_head.weight")
    for i in range(start, end):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + f"self_attn.{n}_proj.weight" for n in "qkvo"]
        names += [p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
    return names


class LlamaModel:
    def __init__(self, config: ModelConfig, state_dict: dict[str, torch.Tensor], device: str | torch.device = "cpu",
                 layer_range: tuple[int, int] | None = None) -> None:
        """`layer_range` = (start, end): hold only layers [start, end), as a pipeline stage does.

        The first stage holds the embedding, the last the final norm and LM head; the default is
        the whole model.
        """
        self.config = config
        self.device = torch.device(device)
        if self.device.type == "cpu":
            tune_allocator()
        self._gather_buffers: list[torch.Tensor | None] = [None, None]  # K and V, see _gather
        c = config
        start, end = layer_range or (0, c.num_layers)
        if not 0 <= start < end <= c.num_layers:
            raise ValueError(f"layer range [{start}, {end}) is not inside the model's {c.num_layers} layers")
        self.layer_range = (start, end)
        self.is_first, self.is_last = start == 0, end == c.num_layers

        def w(name: str) -> torch.Tensor:
            return state_dict[name].to(self.device, torch.float32)

        needs_embed = self.is_first or (self.is_last and c.tie_word_embeddings)
        self.embed = w("model.embed_tokens.weight") if needs_embed else None
        self.lm_head = self.final_norm = None
        if self.is_last:
            self.lm_head = self.embed if c.tie_word_embeddings else w("lm_head.weight")
            self.final_norm = w("model.norm.weight")
        self.layers = []
        for i in range(start, end):
            p = f"model.layers.{i}."
            self.layers.append(dict(
                attn_norm=w(p + "input_layernorm.weight"),
                qkv=torch.cat([w(p + f"self_attn.{n}_proj.weight") for n in "qkv"]).contiguous(),
                o=w(p + "self_attn.o_proj.weight"),
                ffn_norm=w(p + "post_attention_layernorm.weight"),
                gate_up=torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")]).contiguous(),
                down=w(p + "mlp.down_proj.weight"),
            ))
        pack = packed_gemm_available(self.device)
        kernels = self.device.type == "cpu" and avx512.available()
        self.fused_decode_attention = kernels and c.head_dim in avx512.HEAD_DIMS
        self.fused_row_ops = kernels and c.head_dim % 32 == 0
        self.linears = [{name: Linear(layer[name], pack, kernels) for name in ("qkv", "o", "gate_up", "down")}
                        for layer in self.layers]
        self.lm_head_linear = Linear(self.lm_head, pack, kernels) if self.lm_head is not None else None
        self.decode_layers = None  # every layer of a decode-only batch in one C++ call, see _runs_decode_layers
        if self.fused_decode_attention and self.fused_row_ops:
            self.decode_layers = avx512.decode_layers(
                [layer["attn_norm"] for layer in self.layers], [lin["qkv"].panels for lin in self.linears],
                [lin["o"].panels for lin in self.linears], [layer["ffn_norm"] for layer in self.layers],
                [lin["gate_up"].panels for lin in self.linears], [lin["down"].panels for lin in self.linears],
                heads=c.num_heads, kv_heads=c.num_kv_heads, head_dim=c.head_dim, intermediate=c.intermediate_size,
                eps=c.rms_norm_eps, scale=c.head_dim ** -0.5)
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.int64).float() / c.head_dim))
        freqs = torch.arange(c.max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_table = emb.cos().to(self.device)
        sin = emb.sin()
        half = c.head_dim // 2
        self.signed_sin_table = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(self.device)

    @property
    def weight_bytes(self) -> int:
        tensors = [self.embed, self.final_norm] + ([] if self.lm_head is self.embed else [self.lm_head])
        tensors = [t for t in tensors if t is not None]
        tensors += [t for layer in self.layers for t in layer.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    @torch.inference_mode()
    def forward(self, inp: ForwardInput, kv: KVCache, hooks=None) -> torch.Tensor:
        """Run the batch, write its K/V into `kv`, return logits for `inp.logits_rows`.

        `hooks`, if given, is called as hooks(op_name, fn) around each operation, for profiling.
        """
        x = self.run_layers(self.embed_tokens(inp), inp, kv, hooks)
        return self.logits(x, inp, hooks)

    @torch.inference_mode()
    def embed_tokens(self, inp: ForwardInput) -> torch.Tensor:
        """The first stage's input: [T, hidden] embeddings of the batch's tokens."""
        return self.embed[inp.token_ids]

    @torch.inference_mode()
    def run_layers(self, x: torch.Tensor, inp: ForwardInput, kv: KVCache, hooks=None) -> torch.Tensor:
        """Run this model's layers over hidden states x [T, hidden]; `kv` holds only these layers."""
        c = self.config
        run = hooks or (lambda _name, fn: fn())
        cos, sin = self.cos_table[inp.positions], self.signed_sin_table[inp.positions]
        k_end = c.q_size + c.kv_size
        if self.fused_row_ops:
            x = x.clone()  # _add_norm updates it in place; the caller's tensor stays as it was
        h = rms_norm(x, self.layers[0]["attn_norm"], c.rms_norm_eps)
        if self._runs_decode_layers(inp, hooks):
            return self.decode_layers.run(x, h, kv.data, cos, sin, inp.slot_mapping, inp.decode_slots,
                                          inp.decode_lengths)
        for index, (layer, linear) in enumerate(zip(self.layers, self.linears)):
            qkv = run("preproj", lambda: linear["qkv"](h))
            # Q and K heads sit side by side in the fused projection: rotate them in one pass.
            qk = self._rope(qkv[:, :k_end].view(-1, c.num_heads + c.num_kv_heads, c.head_dim), cos, sin)
            q, k = qk[:, :c.num_heads], qk[:, c.num_heads:]
            v = qkv[:, k_end:].view(-1, c.num_kv_heads, c.head_dim)
            attn = run("attention", lambda: self._attention(q, k, v, kv.data[index], inp))
            x, h = self._add_norm(x, run("postproj", lambda: linear["o"](attn)), layer["ffn_norm"])
            ffn = run("ffn", lambda: self._mlp(h, linear))
            if index + 1 < len(self.layers):  # the next layer's input norm, fused with the residual add
                x, h = self._add_norm(x, ffn, self.layers[index + 1]["attn_norm"])
            else:
                x = x + ffn
        return x

    def _runs_decode_layers(self, inp: ForwardInput, hooks) -> bool:
        """Whether this batch takes the one-call C++ path: the same kernels in the same order as the
        loop below (so the same bits), for decode-only batches the panel GEMM serves, unprofiled."""
        return (self.decode_layers is not None and self.fused_decode_attention and self.fused_row_ops
                and hooks is None and not inp.prefills
                and inp.decode_lengths is not None and 0 < inp.num_decodes <= avx512.MAX_ROWS)

    def _rope(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.fused_row_ops:
            return avx512.rope(qk, cos, sin)
        return apply_rope(qk, cos.unsqueeze(1), sin.unsqueeze(1))

    def _add_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor):
        """(x + delta, its RMSNorm); the fused kernel updates x in place."""
        if self.fused_row_ops:
            return x, avx512.add_rms_norm_(x, delta, weight, self.config.rms_norm_eps)
        x = x + delta
        return x, rms_norm(x, weight, self.config.rms_norm_eps)

    @torch.inference_mode()
    def logits(self, x: torch.Tensor, inp: ForwardInput, hooks=None) -> torch.Tensor:
        """The last stage's output: logits [len(logits_rows), vocab] from the final hidden states."""
        run = hooks or (lambda _name, fn: fn())
        h = rms_norm(x[inp.logits_rows], self.final_norm, self.config.rms_norm_eps)
        return run("lm_head", lambda: self.lm_head_linear(h))

    def _mlp(self, h: torch.Tensor, linear: dict[str, Linear]) -> torch.Tensor:
        gate_up = linear["gate_up"](h)
        if self.fused_row_ops:
            return linear["down"](avx512.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return linear["down"](F.silu(gate) * up)

    def _gather(self, cache: torch.Tensor, slots: torch.Tensor, which: int) -> torch.Tensor:
        """Rows `slots` of a K or V cache, copied into a buffer reused across layers and steps.

        index_select copies whole rows (advanced indexing, cache[slots], goes element by element),
        and writing into a kept buffer spares the page faults of a fresh tens-of-MB tensor per
        layer: 3 ms instead of 8-20 ms for 16 decodes of 256 tokens of LLaMA-7B, measured here.
        """
        n = slots.numel()
        buf = self._gather_buffers[which]
        if buf is None or buf.shape[0] < n:
            buf = torch.empty(n, *cache.shape[1:], device=cache.device, dtype=cache.dtype)
            self._gather_buffers[which] = buf
        return torch.index_select(cache, 0, slots, out=buf[:n])

    @staticmethod
    def _decode_in_place(inp: ForwardInput, k_cache: torch.Tensor) -> bool:
        """Attend each decode on its own contiguous cache rows instead of one batched call on a gathered copy.

        The batched call copies every context (padded to the longest) and reads the copy again; a
        call per decode reads the cache once but pays a call's overhead. Per decode from
        DECODE_IN_PLACE_MIN_BYTES of K and V per layer the copy costs more: LLaMA-7B's 230-token
        contexts are 7.5 MB each, SmolLM2's 100-token ones 150 KB.
        """
        if inp.decode_runs is None:
            return False
        row_bytes = 2 * k_cache[0].numel() * k_cache.element_size()  # K and V of one position
        mean_context = sum(length for _, length in inp.decode_runs) / len(inp.decode_runs)
        return mean_context * row_bytes >= DECODE_IN_PLACE_MIN_BYTES

    def _attention(self, q, k, v, layer_kv: torch.Tensor, inp: ForwardInput) -> torch.Tensor:
        c = self.config
        k_cache, v_cache = layer_kv[0], layer_kv[1]
        if self.fused_row_ops:
            avx512.store_kv(k_cache, v_cache, inp.slot_mapping, k, v)
        else:
            k_cache.index_copy_(0, inp.slot_mapping, k)
            v_cache.index_copy_(0, inp.slot_mapping, v)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for span in inp.prefills:
            rows = slice(span.offset, span.offset + span.num_tokens)
            qs = q[rows].transpose(0, 1).unsqueeze(0)  # [1, heads, n, dim]
            if span.context_slots is None:  # a whole prompt, or a first chunk: no cached prefix
                ks, vs = k[rows], v[rows]
                causal, mask = True, None
            elif span.context_start is not None:  # the cache rows themselves, no copy
                run = slice(span.context_start, span.context_start + span.start_pos + span.num_tokens)
                ks, vs = k_cache[run], v_cache[run]
                causal, mask = False, span.mask
            else:
                ks, vs = self._gather(k_cache, span.context_slots, 0), self._gather(v_cache, span.context_slots, 1)
                causal, mask = False, span.mask
            o = F.scaled_dot_product_attention(
                qs, ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0),
                attn_mask=mask, is_causal=causal, enable_gqa=c.num_kv_heads != c.num_heads,
            )
            out[rows] = o[0].transpose(0, 1)
        if inp.num_decodes:
            first = q.shape[0] - inp.num_decodes
            qd = q[first:].unsqueeze(2)  # [D, heads, 1, dim]
            gqa = c.num_kv_heads != c.num_heads
            if self.fused_decode_attention and inp.decode_lengths is not None:
                avx512.decode_attention(q[first:], k_cache, v_cache, inp.decode_slots, inp.decode_lengths,
                                        c.head_dim ** -0.5, out=out[first:])
            elif self._decode_in_place(inp, k_cache):
                for i, (start, length) in enumerate(inp.decode_runs):
                    kd = k_cache[start:start + length].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, context, dim]
                    vd = v_cache[start:start + length].transpose(0, 1).unsqueeze(0)
                    out[first + i] = F.scaled_dot_product_attention(qd[i:i + 1], kd, vd, enable_gqa=gqa)[0, :, 0]
            else:
                slots = inp.decode_slots.view(-1)
                shape = (*inp.decode_slots.shape, c.num_kv_heads, c.head_dim)
                kd = self._gather(k_cache, slots, 0).view(shape).transpose(1, 2)  # [D, kv_heads, context, dim]
                vd = self._gather(v_cache, slots, 1).view(shape).transpose(1, 2)
                o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=inp.decode_mask, enable_gqa=gqa)
                out[first:] = o.squeeze(2)
        return out.view(q.shape[0], c.q_size)
