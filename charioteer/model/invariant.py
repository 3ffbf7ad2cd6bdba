"""The batch-invariant mode's pieces: reductions whose order depends on nothing but the row itself.

A request's logits are bitwise the same whatever else shares its batch when every reduction of
every row runs in one fixed order. In this mode (`LlamaModel(batch_invariant=True)`):

- Linear layers: the panel GEMM (cpu_kernels.linear) for any number of rows. Each output is one
  chain of fused multiply-adds over k = 0..K-1, threads split the output columns, never K, and
  rows never meet, so neither the row count nor a row's place changes its bits. (MKL picks its
  blocking, and for a few rows its K split, by the row count.)
- Attention: every query, of a prompt chunk or a decode, is a decode-attention query against keys
  0..p of its own context (`attend_each_query`): the same reduction whether position p arrives in
  a chunk of 1 or 256 tokens, or as a decode, and whatever is cached beyond p.
- RMSNorm, RoPE, SiLU: per-row kernels (cpu_kernels) or torch's row-wise ops; log-softmax and
  sampling run per request (engine/model_runner.py). tests/test_batch_invariant.py checks each.

Two paths: `native`, the C++ kernels (AVX-512 or AVX2, cpu_kernels), and `portable`, torch alone
(a one-row GEMM per row and SDPA per query: slow, for CPUs the kernels do not build on).
CHARIOTEER_BATCH_INVARIANT_KERNELS=portable forces the portable one; native (the default) falls
back to it where the kernels cannot run.
"""
from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from charioteer.model import cpu_kernels

KERNELS_ENV = "CHARIOTEER_BATCH_INVARIANT_KERNELS"
PATHS = ("native", "portable")
_log = logging.getLogger(__name__)


def choose_path(device: torch.device, head_dim: int) -> str:
    """'native' where the C++ kernels run this model here (and the environment allows), else 'portable'."""
    setting = os.environ.get(KERNELS_ENV, "native").strip().lower()
    if setting not in PATHS:
        raise ValueError(f"{KERNELS_ENV}={setting} is neither of {', '.join(PATHS)}")
    if setting == "portable":
        return setting
    why = None
    if device.type != "cpu" or not cpu_kernels.available():
        why = f"the CPU kernels are not available ({cpu_kernels.status()})"
    elif head_dim not in cpu_kernels.HEAD_DIMS:
        why = f"decode attention is built for head sizes {cpu_kernels.HEAD_DIMS}, not {head_dim}"
    if why is not None:
        _log.warning("batch-invariant mode runs its portable (slow) torch path: %s", why)
        return "portable"
    return "native"


def rowwise_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T one row at a time: every row is a GEMM of the same shape on a fresh copy (the
    allocator's alignment, which MKL's results may depend on), so no row sees another."""
    out = x.new_empty(x.shape[0], weight.shape[0])
    for row in range(x.shape[0]):
        out[row] = F.linear(x[row:row + 1].clone(), weight)[0]
    return out


def query_contexts(prefills, slot_mapping: torch.Tensor, decode_slots: torch.Tensor | None,
                   decode_lengths: torch.Tensor | None, num_decodes: int,
                   pad_slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query row's KV slots [T, width] (padded with `pad_slot`) and context length [T]:
    a prompt chunk's token at position p attends to its request's slots 0..p."""
    rows, lengths = [], []
    for span in prefills:
        context = (span.context_slots if span.context_slots is not None
                   else slot_mapping[span.offset:span.offset + span.num_tokens])
        rows.append(context.expand(span.num_tokens, -1))
        lengths.append(torch.arange(span.start_pos + 1, span.start_pos + span.num_tokens + 1))
    if num_decodes:
        rows.append(decode_slots)
        lengths.append(decode_lengths.cpu())
    width = max(r.shape[1] for r in rows)
    slots = torch.full((sum(r.shape[0] for r in rows), width), pad_slot, dtype=torch.long, device=slot_mapping.device)
    first = 0
    for r in rows:
        slots[first:first + r.shape[0], :r.shape[1]] = r
        first += r.shape[0]
    return slots, torch.cat(lengths)


def attend_each_query(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                      lengths: torch.Tensor, scale: float, native: bool, out: torch.Tensor) -> None:
    """out[t] = softmax(q[t] K^T * scale) V over the first lengths[t] of slots[t], per query on its own.

    q [T, heads, dim]; caches [slots, kv_heads, dim]. Native: one decode-attention call (threads split
    queries and KV heads, never keys). Portable: SDPA per query on exactly its keys.
    """
    if native:
        cpu_kernels.decode_attention(q, k_cache, v_cache, slots, lengths, scale, out=out)
        return
    gqa = k_cache.shape[1] != q.shape[1]
    for t, length in enumerate(lengths.tolist()):
        context = slots[t, :length]
        kt = k_cache.index_select(0, context).transpose(0, 1).unsqueeze(0)  # [1, kv_heads, length, dim]
        vt = v_cache.index_select(0, context).transpose(0, 1).unsqueeze(0)
        out[t] = F.scaled_dot_product_attention(q[t].unsqueeze(0).unsqueeze(2), kt, vt, scale=scale,
                                                enable_gqa=gqa)[0, :, 0]
