// Per-row elementwise steps of a layer, fused so a small decode batch pays one call instead of
// several: residual add + RMSNorm, RoPE on Q and K, SiLU(gate) * up, and greedy argmax.
// Every row is computed on its own, so results never depend on the rest of the batch.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "kernels.h"
#include "vec_math.h"

#include <cmath>

namespace {

constexpr int64_t kGrainRows = 8;

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == torch::kFloat && t.stride(1) == 1, name,
              " must be a 2-D fp32 tensor with contiguous rows");
}

}  // namespace

// x += delta; returns weight * x / sqrt(mean(x^2) + eps), row by row.
torch::Tensor add_rms_norm_(torch::Tensor& x, const torch::Tensor& delta, const torch::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(delta, "delta");
  TORCH_CHECK(x.sizes() == delta.sizes() && weight.dim() == 1 && weight.size(0) == x.size(1) &&
              weight.is_contiguous() && weight.scalar_type() == torch::kFloat, "shapes do not match");
  const int64_t rows = x.size(0), cols = x.size(1);
  auto out = torch::empty({rows, cols}, x.options());
  float* xp = x.data_ptr<float>();
  const float* dp = delta.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), ds = delta.stride(0);
  at::parallel_for(0, rows, kGrainRows, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      float* xr = xp + r * xs;
      const float* dr = dp + r * ds;
      __m512 squares = _mm512_setzero_ps();
      for (int64_t c = 0; c < cols; c += 16) {
        const __mmask16 m = lanes(cols - c);
        const __m512 v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, xr + c), _mm512_maskz_loadu_ps(m, dr + c));
        _mm512_mask_storeu_ps(xr + c, m, v);
        squares = _mm512_fmadd_ps(v, v, squares);
      }
      const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(squares) / cols + static_cast<float>(eps));
      const __m512 scale = _mm512_set1_ps(inv);
      for (int64_t c = 0; c < cols; c += 16) {
        const __mmask16 m = lanes(cols - c);
        const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, xr + c), scale);
        _mm512_mask_storeu_ps(op + r * cols + c, m, _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, wp + c)));
      }
    }
  });
  return out;
}

// x [T, heads, dim] (rows may be strided) -> x * cos + roll(x, dim/2) * signed_sin, with cos and
// signed_sin [T, dim]: the same three roundings as the op-by-op formula (no fused multiply-add),
// so the result is bitwise the formula's.
torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& signed_sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "x must be [T, heads, dim] fp32 with contiguous heads");
  check_rows(cos, "cos");
  check_rows(signed_sin, "signed_sin");
  const int64_t rows = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  TORCH_CHECK(dim % 32 == 0 && cos.size(0) == rows && cos.size(1) == dim && signed_sin.sizes() == cos.sizes(),
              "rope needs head_dim a multiple of 32 and one cos/sin row per token");
  auto out = torch::empty({rows, heads, dim}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = signed_sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), cs = cos.stride(0), ss = signed_sin.stride(0);
  at::parallel_for(0, rows, kGrainRows, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      for (int64_t h = 0; h < heads; ++h) {
        const float* xh = xp + r * xs + h * dim;
        float* oh = op + (r * heads + h) * dim;
        for (int64_t c = 0; c < dim; c += 16) {
          const int64_t rolled = c < half ? c + half : c - half;
          const __m512 a = _mm512_mul_ps(_mm512_loadu_ps(xh + c), _mm512_loadu_ps(cp + r * cs + c));
          const __m512 b = _mm512_mul_ps(_mm512_loadu_ps(xh + rolled), _mm512_loadu_ps(sp + r * ss + c));
          _mm512_storeu_ps(oh + c, _mm512_add_ps(a, b));
        }
      }
    }
  });
  return out;
}

// gate_up [T, 2I] -> silu(gate) * up, [T, I].
torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t rows = gate_up.size(0), inner = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up needs an even width");
  auto out = torch::empty({rows, inner}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t gs = gate_up.stride(0);
  at::parallel_for(0, rows, kGrainRows, [&](int64_t first, int64_t last) {
    const __m512 one = _mm512_set1_ps(1.f);
    for (int64_t r = first; r < last; ++r) {
      const float* g = gp + r * gs;
      for (int64_t c = 0; c < inner; c += 16) {
        const __mmask16 m = lanes(inner - c);
        const __m512 a = _mm512_maskz_loadu_ps(m, g + c);
        const __m512 s = _mm512_div_ps(a, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), a))));
        _mm512_mask_storeu_ps(op + r * inner + c, m, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, g + inner + c)));
      }
    }
  });
  return out;
}

// The first index of each row's maximum, NaN counting as the maximum (torch.argmax's rule).
torch::Tensor argmax_rows(const torch::Tensor& logits) {
  check_rows(logits, "logits");
  const int64_t rows = logits.size(0), cols = logits.size(1);
  TORCH_CHECK(cols > 0, "logits need at least one column");
  auto out = torch::empty({rows}, logits.options().dtype(torch::kLong));
  const float* lp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t ls = logits.stride(0);
  at::parallel_for(0, rows, 1, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const float* row = lp + r * ls;
      __m512 best = _mm512_set1_ps(-INFINITY);
      __mmask16 nan = 0;
      for (int64_t c = 0; c < cols; c += 16) {
        const __mmask16 m = lanes(cols - c);
        const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, row + c);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        best = _mm512_max_ps(best, v);
      }
      int64_t index = 0;
      if (nan) {
        while (!std::isnan(row[index])) ++index;
      } else {
        const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best));
        for (int64_t c = 0; c < cols; c += 16) {
          const __mmask16 hit = _mm512_mask_cmp_ps_mask(lanes(cols - c), _mm512_loadu_ps(row + c), top, _CMP_EQ_OQ);
          if (hit) {
            index = c + __builtin_ctz(hit);
            break;
          }
        }
      }
      op[r] = index;
    }
  });
  return out;
}
