// Decode attention on the KV cache in place: one query token per request against its own cached
// context, read through its slot list, so no padded copy of the contexts is made.
//
// Work is split over (request, KV head) pairs; each pair computes the scores of the query heads
// that share the KV head (grouped-query attention), a softmax with a vectorised exp, and the
// weighted sum of V rows.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "vec_math.h"

#include <cmath>
#include <limits>
#include <vector>

namespace {

template <int Dim>
void attend(const float* q, int64_t heads, const float* k, const float* v, int64_t row_stride,
            const int64_t* slots, int64_t length, float scale, float* out, float* scores) {
  constexpr int C = Dim / 16;
  for (int64_t j = 0; j < heads; ++j) {
    __m512 qv[C];
    for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(q + j * Dim + 16 * c);
    float best = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < length; ++t) {
      const float* kr = k + slots[t] * row_stride;
      __m512 acc = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr));
      for (int c = 1; c < C; ++c) acc = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kr + 16 * c), acc);
      const float s = _mm512_reduce_add_ps(acc) * scale;
      scores[t] = s;
      best = std::max(best, s);
    }
    const __m512 top = _mm512_set1_ps(best);
    __m512 total = _mm512_setzero_ps();
    for (int64_t t = 0; t < length; t += 16) {
      const __mmask16 m = lanes(length - t);
      const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scores + t), top));
      _mm512_mask_storeu_ps(scores + t, m, e);
      total = _mm512_mask_add_ps(total, m, total, e);
    }
    __m512 acc[C];
    for (int c = 0; c < C; ++c) acc[c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < length; ++t) {
      const float* vr = v + slots[t] * row_stride;
      const __m512 p = _mm512_set1_ps(scores[t]);
      for (int c = 0; c < C; ++c) acc[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vr + 16 * c), acc[c]);
    }
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(total));
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + j * Dim + 16 * c, _mm512_mul_ps(acc[c], inv));
  }
}

}  // namespace

torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                               const torch::Tensor& slots, const torch::Tensor& lengths, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(),
              "q must be [D, heads, dim] and the caches [slots, kv_heads, dim]");
  TORCH_CHECK(q.scalar_type() == torch::kFloat && k_cache.scalar_type() == torch::kFloat &&
              v_cache.scalar_type() == torch::kFloat, "fp32 only");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  TORCH_CHECK(slots.dim() == 2 && slots.scalar_type() == torch::kLong && lengths.dim() == 1 &&
              lengths.scalar_type() == torch::kLong, "slots must be [D, width] and lengths [D], int64");
  const int64_t decodes = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == dim && heads % kv_heads == 0, "head shapes do not match");
  TORCH_CHECK(slots.size(0) == decodes && lengths.size(0) == decodes, "one slot row and length per query");
  TORCH_CHECK(dim == 64 || dim == 128, "head_dim must be 64 or 128, got ", dim);
  const auto qc = q.contiguous();
  const auto sc = slots.contiguous();
  const auto lc = lengths.contiguous();
  const int64_t width = sc.size(1), num_slots = k_cache.size(0);
  const int64_t* len = lc.data_ptr<int64_t>();
  for (int64_t d = 0; d < decodes; ++d) TORCH_CHECK(0 < len[d] && len[d] <= width, "length out of range");
  auto out = torch::empty({decodes, heads, dim}, q.options());
  const int64_t group = heads / kv_heads, row_stride = kv_heads * dim;
  const float* qp = qc.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* sp = sc.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < decodes * width; ++i) TORCH_CHECK(0 <= sp[i] && sp[i] < num_slots, "slot out of range");
  const auto fn = dim == 64 ? attend<64> : attend<128>;
  at::parallel_for(0, decodes * kv_heads, 1, [&](int64_t first, int64_t last) {
    std::vector<float> scores(width);
    for (int64_t i = first; i < last; ++i) {
      const int64_t d = i / kv_heads, g = i % kv_heads;
      const int64_t head = (d * heads + g * group) * dim;
      fn(qp + head, group, kp + g * dim, vp + g * dim, row_stride, sp + d * width, len[d],
         static_cast<float>(scale), op + head, scores.data());
    }
  });
  return out;
}
