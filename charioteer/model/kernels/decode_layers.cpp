// A decode-only batch through every layer of the model in one call.
//
// The same kernels the model calls one by one from Python (panel GEMM, RoPE, the KV store, decode
// attention and the row ops), in the same order, so the result is bitwise the op-by-op path's.
// What goes away is Python's and the dispatcher's work between them: at a decode step every weight
// has streamed through the caches since the last step, so each small op pays for cold interpreter
// and allocator state: the op-by-op loop costs 3-4 ms more per 16-decode SmolLM2 step (35 ms).
// For the same reason every op writes into buffers kept from one layer and step to the next (a new
// tensor or view costs about half a microsecond there): one SmolLM2 stream ran 1.05-1.07x faster so.
// And a small batch runs every layer in one parallel region, its threads meeting between the ops, where
// each GEMM and the attention would start a region of their own (about 1.1 us each, 150 a SmolLM2 step).
// Inside it the kernels' `_into` forms write the buffers with no tensor made or copied: a copy both threads
// hold is an atomic write to one cache line that the other thread's reads then miss (4-6 % of SmolLM2's
// GGUF layers in the caches went to such counts and misses, by perf).
#include "kernels.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>

namespace {

constexpr int64_t kGateUp = 2;  // the fused gate/up weight's index among a layer's four

// precision.native_bf16_linear: a weight packed for oneDNN (an opaque mkldnn tensor) goes through
// mkldnn::_linear_pointwise, which has no C++ API, so it is called through the dispatcher.
torch::Tensor native_bf16_linear(const torch::Tensor& x, const torch::Tensor& weight) {
  if (!weight.is_mkldnn()) return at::linear(x, weight);
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x, weight, c10::IValue(), std::string("none"), c10::List<std::optional<at::Scalar>>(),
                                 c10::IValue()};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

}  // namespace

DecodeLayers::DecodeLayers(std::vector<torch::Tensor> attn_norm, std::vector<torch::Tensor> qkv,
                           std::vector<torch::Tensor> o, std::vector<torch::Tensor> ffn_norm,
                           std::vector<torch::Tensor> gate_up, std::vector<torch::Tensor> down,
                           std::vector<torch::Tensor> scales, std::vector<torch::Tensor> plain, int64_t native_rows,
                           bool amx_tiles, bool vnni, int64_t heads, int64_t kv_heads, int64_t head_dim,
                           int64_t intermediate, double eps, double scale)
    : attn_norm_(std::move(attn_norm)), qkv_(std::move(qkv)), o_(std::move(o)), ffn_norm_(std::move(ffn_norm)),
      gate_up_(std::move(gate_up)), down_(std::move(down)), scales_(std::move(scales)), plain_(std::move(plain)),
      native_rows_(native_rows), amx_tiles_(amx_tiles), vnni_(vnni), heads_(heads), kv_heads_(kv_heads),
      head_dim_(head_dim), intermediate_(intermediate),
      eps_(eps), scale_(scale) {
  const size_t layers = attn_norm_.size();
  TORCH_CHECK(layers > 0 && qkv_.size() == layers && o_.size() == layers && ffn_norm_.size() == layers &&
              gate_up_.size() == layers && down_.size() == layers, "one weight of each kind per layer");
  TORCH_CHECK(scales_.empty() || scales_.size() == 4 * layers, "four scales per layer (int8 panels) or none");
  const auto blocks = [](const std::vector<torch::Tensor>& w) {
    return std::any_of(w.begin(), w.end(), [](const torch::Tensor& t) { return t.scalar_type() == torch::kByte; });
  };
  TORCH_CHECK(!vnni_ || !scales_.empty() || blocks(qkv_) || blocks(o_) || blocks(gate_up_) || blocks(down_),
              "vnni runs int8 panels (give their scales) or GGUF blocks");
  TORCH_CHECK(plain_.empty() || (plain_.size() == 4 * layers && scales_.empty() && native_rows_ > 0),
              "four unpacked bf16 weights per layer, with native_rows > 0 and no int8 scales, or none");
}

const torch::Tensor& DecodeLayers::linear(const torch::Tensor& x, const torch::Tensor& panels, int64_t layer,
                                          int64_t which, int64_t n, const torch::Tensor& out) {
  torch::Tensor& made = buffers_.made[which];
  if (panels.scalar_type() == torch::kByte) {  // GGUF blocks (gguf_gemm)
    gguf_linear_into(x, panels, n, vnni_, out);
    return out;
  }
  if (!plain_.empty()) {  // as NarrowLinear with native_rows: every path rounds input and product to bf16
    // below native_rows: panels from amx_pack (4-d) on AMX tiles or with AVX512-BF16, else the panel kernel
    const auto bf16 = torch::kBFloat16;
    if (x.size(0) < native_rows_ && panels.dim() == 4) {
      if (amx_tiles_) amx_linear_into(x, panels, n, true, out);
      else avx512_bf16_linear_into(x, panels, n, true, out);
      return out;
    }
    made = x.size(0) >= native_rows_ ? native_bf16_linear(x.to(bf16), plain_[4 * layer + which])
                                     : panel_linear(x.to(bf16).to(torch::kFloat), panels, n).to(bf16);
    return made;  // bf16, as in Python: rope, store_kv, silu_mul and add_rms_norm_ take it so
  }
  if (int8_tiles(x.size(0))) {  // int8 panels widened to bf16
    made = amx_tiles_ ? amx_linear_int8(x, panels, n, *scale(layer, which))
                      : avx512_bf16_linear_int8(x, panels, n, *scale(layer, which));
    return made;
  }
  if (vnni_ && panels.scalar_type() == torch::kChar) vnni_linear_int8_into(x, panels, n, *scale(layer, which), out);
  else panel_linear_into(x, panels, n, scale(layer, which), out);  // fp32 or bf16 panels: also a GGUF file's other kinds
  return out;
}

bool DecodeLayers::int8_tiles(int64_t rows) const {
  return !scales_.empty() && native_rows_ > 0 && rows >= native_rows_;
}

bool DecodeLayers::writes_buffers(int64_t rows) const {
  if (plain_.empty()) return !int8_tiles(rows);
  return rows < native_rows_ && qkv_[0].dim() == 4;  // amx_linear or avx512_bf16_linear
}

const torch::Tensor* DecodeLayers::scale(int64_t layer, int64_t which) const {
  return scales_.empty() ? nullptr : &scales_[4 * layer + which];
}

void DecodeLayers::keep_buffers(int64_t rows, int64_t hidden, const torch::TensorOptions& options) {
  if (buffers_.rows == rows) return;
  Buffers& b = buffers_;
  const int64_t qkv_heads = heads_ + 2 * kv_heads_;
  const auto fp32 = options.dtype(torch::kFloat);
  const auto products = plain_.empty() ? fp32 : options.dtype(torch::kBFloat16);  // what `linear` writes
  b.rows = rows;
  b.fused = torch::empty({rows, qkv_heads * head_dim_}, products);
  const auto heads = b.fused.view({rows, qkv_heads, head_dim_});
  b.to_rotate = heads.narrow(1, 0, heads_ + kv_heads_);
  b.v = heads.narrow(1, heads_ + kv_heads_, kv_heads_);
  b.rotated = torch::empty({rows, heads_ + kv_heads_, head_dim_}, fp32);
  b.q = b.rotated.narrow(1, 0, heads_);
  b.k = b.rotated.narrow(1, heads_, kv_heads_);
  b.attn = torch::empty({rows, heads_, head_dim_}, fp32);
  b.attn_rows = b.attn.view({rows, heads_ * head_dim_});
  b.o = torch::empty({rows, hidden}, products);
  b.h = torch::empty({rows, hidden}, products);
  b.gate_up = torch::empty({rows, 2 * intermediate_}, products);
  b.act = torch::empty({rows, intermediate_}, products);
  b.ffn = torch::empty({rows, hidden}, products);
  b.x = torch::empty({rows, hidden}, fp32);
  b.sum = torch::empty({rows, hidden}, fp32);
  b.own_h.clear();
  b.first_h = torch::empty({rows, hidden}, fp32);
  b.cos = torch::empty({rows, head_dim_}, fp32);
  b.signed_sin = torch::empty({rows, head_dim_}, fp32);
}

namespace {

// out[i] = table[index[i]] for index [n] (int64) and out [n, cols] fp32, a bf16 table widened (exactly): what indexing
// the table in Python and converting to fp32 gives.
void gather_rows(const torch::Tensor& table, const torch::Tensor& index, torch::Tensor& out, const char* name) {
  TORCH_CHECK(table.dim() == 2 && table.is_contiguous() && fp32_or_bf16(table) && table.size(1) == out.size(1), name,
              " must be a contiguous fp32 or bf16 table of ", out.size(1), " columns");
  TORCH_CHECK(index.dim() == 1 && index.is_contiguous() && index.scalar_type() == torch::kLong &&
              index.size(0) == out.size(0), name, "'s index must be ", out.size(0), " contiguous int64 rows");
  const int64_t cols = table.size(1), limit = table.size(0);
  const int64_t* at = index.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < out.size(0); ++i) {
    TORCH_CHECK(at[i] >= 0 && at[i] < limit, name, " row ", at[i], " is out of range [0, ", limit, ")");
    if (table.scalar_type() == torch::kFloat) {
      std::memcpy(op + i * cols, table.data_ptr<float>() + at[i] * cols, cols * sizeof(float));
      continue;
    }
    const uint16_t* row = reinterpret_cast<const uint16_t*>(table.data_ptr<at::BFloat16>()) + at[i] * cols;
    for (int64_t c = 0; c < cols; ++c) {
      const uint32_t bits = static_cast<uint32_t>(row[c]) << 16;
      std::memcpy(op + i * cols + c, &bits, sizeof(float));
    }
  }
}

thread_local const TeamShare* current_share = nullptr;

// The batches that run in one region: at most this many rows, on kernels with an out-variant. SmolLM2 on its GGUF
// blocks, against a region per op (Zen 4): 1.04x at 1 row, 1.06x at 4, 1.03x at 8, 1.00x at 16 (the row ops wait
// on one thread there); int8 1.03x at 1 row. On a Xeon with AMX, 16 decodes of SmolLM2 in bf16 (AMX tiles) with a
// limit of 16 against 8: 1.01-1.07x, fp32 and GGUF 1.00-1.03x (2 runs each); workload B's 139 decode-only steps
// 2.90 against 3.03-3.12 s.
constexpr int64_t kTeamRows = 16;

}  // namespace

const TeamShare* team_share() { return current_share; }

namespace {

// x = sum + delta (delta fp32 or bf16, widened exactly): x.add_'s bits; in a team, this thread's part of the columns.
void add_into(const torch::Tensor& sum, const torch::Tensor& delta, torch::Tensor& x) {
  const int64_t rows = x.size(0), cols = x.size(1), ds = delta.stride(0), xs = x.stride(0);
  const auto [first, last] = team_part(cols);
  const float* sp = sum.data_ptr<float>();
  float* xp = x.data_ptr<float>();
  const auto add = [&](const auto* dp) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = first; c < last; ++c) xp[r * xs + c] = sp[r * cols + c] + static_cast<float>(dp[r * ds + c]);
  };
  if (delta.scalar_type() == torch::kFloat) add(delta.data_ptr<float>());
  else add(delta.data_ptr<at::BFloat16>());
}

}  // namespace

template <typename Meet>
void DecodeLayers::layer(int64_t l, const Step& in, bool lead, const Meet& meet) {
  Buffers& b = buffers_;
  torch::Tensor& x = in.x;
  const int64_t rows = x.size(0), hidden = x.size(1), qkv_heads = heads_ + 2 * kv_heads_;
  const bool bf16_norm = !plain_.empty();  // under native bf16 GEMMs the norms round to bf16, as the GEMMs would
  const TeamShare* share = team_share();
  // the norms' output: in a team each thread writes the whole of its own, so no meeting follows them
  const torch::Tensor& h = share != nullptr ? b.own_h[share->first] : b.h;
  const auto& fused = linear(l == 0 ? in.h : h, qkv_[l], l, 0, qkv_heads * head_dim_, b.fused);
  meet();
  if (fused.is_same(b.fused)) {
    if (lead) {
      rope_into(b.to_rotate, in.cos, in.signed_sin, b.rotated);  // Q and K: b.q and b.k
      store_kv_layer(in.kv, l, in.slot_mapping, b.k, b.v);
    }
  } else {  // a kernel's new tensor (no out-variant, no team): views of its own
    const auto heads = fused.view({rows, qkv_heads, head_dim_});
    rope_into(heads.narrow(1, 0, heads_ + kv_heads_), in.cos, in.signed_sin, b.rotated);
    store_kv_layer(in.kv, l, in.slot_mapping, b.k, heads.narrow(1, heads_ + kv_heads_, kv_heads_));
  }
  meet();
  if (share != nullptr) {
    const DecodeTeam shared{[](const void* m) { (*static_cast<const Meet*>(m))(); }, &meet, b.room.data_ptr<float>(),
                            b.room.numel()};
    decode_attention_layer(b.q, in.kv, l, in.slots, in.lengths, scale_, b.attn, &shared);
  } else {
    decode_attention_layer(b.q, in.kv, l, in.slots, in.lengths, scale_, b.attn);
  }
  meet();
  const auto& o = linear(b.attn_rows, o_[l], l, 1, hidden, b.o);
  meet();
  add_rms_norm_into(x, o, ffn_norm_[l], eps_, bf16_norm, b.sum, h);  // b.sum = x + o, in a team by parts
  const auto& gate_up = linear(h, gate_up_[l], l, kGateUp, 2 * intermediate_, b.gate_up);
  meet();
  silu_mul_into(gate_up, b.act);  // in a team, each thread's part of the columns
  meet();
  const auto& ffn = linear(b.act, down_[l], l, 3, hidden, b.ffn);
  meet();
  if (l + 1 < static_cast<int64_t>(attn_norm_.size())) {
    add_rms_norm_into(b.sum, ffn, attn_norm_[l + 1], eps_, bf16_norm, x, h);  // x = b.sum + ffn
  } else {
    add_into(b.sum, ffn, x);
  }
}

torch::Tensor DecodeLayers::run(torch::Tensor x, torch::Tensor h, const torch::Tensor& kv, const torch::Tensor& cos,
                                const torch::Tensor& signed_sin, const torch::Tensor& slot_mapping,
                                const torch::Tensor& slots, const torch::Tensor& lengths) {
  const int64_t layers = attn_norm_.size(), rows = x.size(0);
  TORCH_CHECK(kv.dim() == 5 && kv.size(0) == layers && kv.size(1) == 2, "kv must be [layers, 2, slots, kv_heads, dim]");
  TORCH_CHECK(h.sizes() == x.sizes(), "h must be x's input norm, of x's shape");
  keep_buffers(rows, x.size(1), x.options());
  const Step step{x, h, kv, cos, signed_sin, slot_mapping, slots, lengths};
  const int64_t threads = at::get_num_threads();
  if (!writes_buffers(rows) || rows > kTeamRows || threads < 2 || at::in_parallel_region()) {
    for (int64_t l = 0; l < layers; ++l) layer(l, step, true, [] {});
    return x;
  }
  // each thread's own norm output, and the team's shared room for decode attention's chunks (called op by op, it
  // keeps its own)
  if (static_cast<int64_t>(buffers_.own_h.size()) != threads) {
    buffers_.own_h.clear();
    for (int64_t t = 0; t < threads; ++t) buffers_.own_h.push_back(torch::empty_like(buffers_.h));
  }
  const int64_t room = decode_attention_room(lengths, heads_, head_dim_);
  if (!buffers_.room.defined() || buffers_.room.numel() < room)
    buffers_.room = torch::empty({std::max<int64_t>(room, 1)}, x.options().dtype(torch::kFloat));
  // One region for every layer: the threads meet between the ops (a shared count, spun on) instead of starting a
  // region for each GEMM and the attention. at::parallel_for gives each thread one call, or one thread every
  // worker in one call, so a thread never waits on work it holds itself; a failing thread releases the others,
  // and its error is the call's.
  std::atomic<int64_t> arrived{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;  // the first thread's to fail; the others, released, return
  struct Released {};
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    const TeamShare share{first, last, threads};
    current_share = &share;
    int64_t phase = 0;
    const auto meet = [&] {
      arrived.fetch_add(last - first);
      for (++phase; arrived.load() < phase * threads; _mm_pause()) {
        if (failed.load()) throw Released{};
      }
    };
    try {
      for (int64_t l = 0; l < layers; ++l) layer(l, step, first == 0, meet);
    } catch (const Released&) {
    } catch (...) {
      if (!failed.exchange(true)) error = std::current_exception();
    }
    current_share = nullptr;
  });
  if (error) std::rethrow_exception(error);
  return x;
}

torch::Tensor DecodeLayers::run_tokens(const torch::Tensor& token_ids, const torch::Tensor& positions,
                                       const torch::Tensor& embed, const torch::Tensor& cos,
                                       const torch::Tensor& signed_sin, const torch::Tensor& final_norm,
                                       const torch::Tensor& kv, const torch::Tensor& slot_mapping,
                                       const torch::Tensor& slots, const torch::Tensor& lengths) {
  TORCH_CHECK(embed.dim() == 2 && token_ids.dim() == 1 && token_ids.size(0) > 0, "embed [vocab, hidden], token_ids [D]");
  keep_buffers(token_ids.size(0), embed.size(1), embed.options());
  Buffers& b = buffers_;
  gather_rows(embed, token_ids, b.x, "embed");
  gather_rows(cos, positions, b.cos, "cos");
  gather_rows(signed_sin, positions, b.signed_sin, "signed_sin");
  rms_norm(b.x, attn_norm_[0], eps_, b.first_h);
  run(b.x, b.first_h, kv, b.cos, b.signed_sin, slot_mapping, slots, lengths);
  return rms_norm(b.x, final_norm, eps_);
}
