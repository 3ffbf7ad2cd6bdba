// A decode-only batch through every layer of the model in one call.
//
// The same kernels the model calls one by one from Python (panel GEMM, RoPE, the KV store, decode
// attention and the row ops), in the same order, so the result is bitwise the op-by-op path's.
// What goes away is Python's and the dispatcher's work between them: at a decode step every weight
// has streamed through the caches since the last step, so each small op pays for cold interpreter
// and allocator state: the op-by-op loop costs 3-4 ms more per 16-decode SmolLM2 step (35 ms).
#include "kernels.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>

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

torch::Tensor DecodeLayers::linear(const torch::Tensor& x, const torch::Tensor& panels, int64_t layer, int64_t which,
                                   int64_t n) const {
  if (panels.scalar_type() == torch::kByte) return gguf_linear(x, panels, n, vnni_);  // GGUF blocks (gguf_gemm.cpp)
  if (!plain_.empty()) {  // as NarrowLinear with native_rows: both paths round input and product to bf16
    const auto rounded = x.to(torch::kBFloat16);
    // below native_rows: panels from amx_pack (4-d) on AMX tiles or with AVX512-BF16, else the panel kernel
    const auto product = x.size(0) >= native_rows_ ? native_bf16_linear(rounded, plain_[4 * layer + which])
                         : panels.dim() != 4 ? panel_linear(rounded.to(torch::kFloat), panels, n).to(torch::kBFloat16)
                         : amx_tiles_        ? amx_linear(rounded, panels, n, true)
                                             : avx512_bf16_linear(rounded, panels, n, true);
    return product;  // bf16, as in Python: rope, store_kv, silu_mul and add_rms_norm_ take it so
  }
  if (!scales_.empty() && native_rows_ > 0 && x.size(0) >= native_rows_)  // int8 panels widened to bf16
    return amx_tiles_ ? amx_linear_int8(x, panels, n, *scale(layer, which))
                      : avx512_bf16_linear_int8(x, panels, n, *scale(layer, which));
  if (vnni_ && panels.scalar_type() == torch::kChar) return vnni_linear_int8(x, panels, n, *scale(layer, which));
  return panel_linear(x, panels, n, scale(layer, which));  // fp32 or bf16 panels: also a GGUF file's other kinds
}

c10::optional<torch::Tensor> DecodeLayers::scale(int64_t layer, int64_t which) const {
  if (scales_.empty()) return c10::nullopt;
  return scales_[4 * layer + which];
}

torch::Tensor DecodeLayers::run(torch::Tensor x, torch::Tensor h, const torch::Tensor& kv, const torch::Tensor& cos,
                                const torch::Tensor& signed_sin, const torch::Tensor& slot_mapping,
                                const torch::Tensor& slots, const torch::Tensor& lengths) {
  const int64_t layers = attn_norm_.size(), rows = x.size(0), hidden = x.size(1);
  const int64_t qkv_heads = heads_ + 2 * kv_heads_;
  TORCH_CHECK(kv.dim() == 5 && kv.size(0) == layers && kv.size(1) == 2, "kv must be [layers, 2, slots, kv_heads, dim]");
  TORCH_CHECK(h.sizes() == x.sizes(), "h must be x's input norm, of x's shape");
  for (int64_t l = 0; l < layers; ++l) {
    const auto fused = linear(h, qkv_[l], l, 0, qkv_heads * head_dim_).view({rows, qkv_heads, head_dim_});
    const auto qk = rope(fused.narrow(1, 0, heads_ + kv_heads_), cos, signed_sin);
    auto layer_kv = kv.select(0, l);
    auto k_cache = layer_kv.select(0, 0), v_cache = layer_kv.select(0, 1);
    store_kv(k_cache, v_cache, slot_mapping, qk.narrow(1, heads_, kv_heads_), fused.narrow(1, heads_ + kv_heads_, kv_heads_));
    auto attn = torch::empty({rows, heads_, head_dim_}, x.options());
    decode_attention(qk.narrow(1, 0, heads_), k_cache, v_cache, slots, lengths, scale_, attn);
    // under native bf16 GEMMs the norms are rounded to bf16 here, as the GEMMs would round them
    const bool bf16_norm = !plain_.empty();
    h = add_rms_norm_(x, linear(attn.view({rows, heads_ * head_dim_}), o_[l], l, 1, hidden), ffn_norm_[l], eps_,
                      bf16_norm);
    const auto ffn = linear(silu_mul(linear(h, gate_up_[l], l, kGateUp, 2 * intermediate_)), down_[l], l, 3, hidden);
    if (l + 1 < layers) {
      h = add_rms_norm_(x, ffn, attn_norm_[l + 1], eps_, bf16_norm);
    } else {
      x.add_(ffn);
    }
  }
  return x;
}
