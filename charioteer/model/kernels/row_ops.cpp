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

// fn(r0, r1, u0, u1) over rows [0, rows) by units [0, units) of each: inside DecodeLayers' team, every row's part of
// the units that this thread holds (the team's rows are few); else the rows split over the threads, all units each.
template <typename F>
void rows_by_part(int64_t rows, int64_t units, const F& fn) {
  if (team_share() != nullptr) {
    const auto [first, last] = team_part(units);
    if (first < last) fn(0, rows, first, last);
    return;
  }
  at::parallel_for(0, rows, kGrainRows, [&](int64_t r0, int64_t r1) { fn(r0, r1, 0, units); });
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == torch::kFloat && t.stride(1) == 1, name,
              " must be a 2-D fp32 tensor with contiguous rows");
}

}  // namespace

namespace {

// Whether a and b may share memory: their spans of addresses (each view's first to last element) overlap. No
// storage is touched: at a decode step a weight's is cold, and its reference count an atomic write.
bool may_overlap(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  const auto span = [](const torch::Tensor& t) {
    const auto first = reinterpret_cast<uintptr_t>(t.data_ptr());
    int64_t last = 0;
    for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
    return std::make_pair(first, first + (last + 1) * t.element_size());
  };
  const auto [a_first, a_end] = span(a);
  const auto [b_first, b_end] = span(b);
  return a_first < b_end && b_first < a_end;
}

}  // namespace

void check_out(const char* name, const torch::Tensor& out, at::IntArrayRef sizes, const torch::TensorOptions& options) {
  TORCH_CHECK(out.sizes() == sizes && out.dtype() == options.dtype() && out.is_contiguous() && out.device().is_cpu(),
              name, ": out must be a contiguous ", options.dtype(), " CPU tensor of shape ", sizes);
}

void check_apart(const char* name, const torch::Tensor& out, const torch::Tensor& input) {
  TORCH_CHECK(!may_overlap(out, input), name, ": out must not share memory with an input");
}

namespace {

// A 2-D fp32 or bf16 tensor's data as the kernels read it: float or uint16_t (bf16 bits).
bool fp32_or_bf16_rows(const torch::Tensor& t) {
  return t.dim() == 2 && t.stride(1) == 1 && (t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kBFloat16);
}

// Where add_rms_norm_rows stores x + delta: rows `stride` apart from `at`, columns [first, last) of each. At x
// itself (in place) every column; elsewhere a team thread's part, the norm reading x and delta again.
struct SumStore {
  float* at;
  int64_t stride, first, last;
};

// With Add, x + delta is stored and normed; without, x is only read (dp is not) and normed.
template <bool Add, typename D, typename O>
void add_rms_norm_rows(const float* xp, int64_t xs, const D* dp, int64_t ds, const SumStore& sum, const float* wp,
                       O* op, int64_t rows, int64_t cols, float eps) {
  const bool in_place = sum.at == xp;
  at::parallel_for(0, rows, kGrainRows, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const float* xr = xp + r * xs;
      const D* dr = dp + r * ds;
      float* sr = sum.at + r * sum.stride;
      Vec squares = vzero();
      for (int64_t c = 0; c < cols; c += kLanes) {
        Vec v = vload_n(xr + c, cols - c);
        if constexpr (Add) {
          v = vadd(v, vload_row_n(dr + c, cols - c));
          if (sum.first <= c && c < sum.last) vstore_n(sr + c, v, std::min(cols, sum.last) - c);
        }
        squares = vfma(v, v, squares);
      }
      const float inv = 1.f / std::sqrt(vsum(squares) / cols + eps);
      const Vec scale = vset1(inv);
      for (int64_t c = 0; c < cols; c += kLanes) {
        Vec v = vload_n(xr + c, cols - c);  // in place: x + delta
        if constexpr (Add) {
          if (!in_place) v = vadd(v, vload_row_n(dr + c, cols - c));
        }
        vstore_row_n(op + r * cols + c, vmul(vmul(v, scale), vload_n(wp + c, cols - c)), cols - c);
      }
    }
  });
}

template <typename T>
T* row_data(const torch::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

}  // namespace

namespace {

void check_add_rms_norm(const torch::Tensor& x, const torch::Tensor& delta, const torch::Tensor& weight) {
  check_rows(x, "x");
  TORCH_CHECK(fp32_or_bf16_rows(delta), "delta must be a 2-D fp32 or bf16 tensor with contiguous rows");
  TORCH_CHECK(x.sizes() == delta.sizes() && weight.dim() == 1 && weight.size(0) == x.size(1) &&
              weight.is_contiguous() && weight.scalar_type() == torch::kFloat, "shapes do not match");
}

// x + delta stored at `sum`, and its norm into out (fp32, or bf16 with bf16_out), for the four kinds of delta and out.
void add_rms_norm_any(const torch::Tensor& x, const torch::Tensor& delta, const torch::Tensor& weight, double eps,
                      bool bf16_out, const SumStore& sum, const torch::Tensor& out) {
  const int64_t rows = x.size(0), cols = x.size(1), xs = x.stride(0), ds = delta.stride(0);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float e = static_cast<float>(eps);
  const bool narrow_delta = delta.scalar_type() == torch::kBFloat16;
  if (narrow_delta && bf16_out) add_rms_norm_rows<true>(xp, xs, row_data<const uint16_t>(delta), ds, sum, wp, row_data<uint16_t>(out), rows, cols, e);
  else if (narrow_delta) add_rms_norm_rows<true>(xp, xs, row_data<const uint16_t>(delta), ds, sum, wp, row_data<float>(out), rows, cols, e);
  else if (bf16_out) add_rms_norm_rows<true>(xp, xs, row_data<const float>(delta), ds, sum, wp, row_data<uint16_t>(out), rows, cols, e);
  else add_rms_norm_rows<true>(xp, xs, row_data<const float>(delta), ds, sum, wp, row_data<float>(out), rows, cols, e);
}

}  // namespace

// x += delta; returns weight * x / sqrt(mean(x^2) + eps), row by row. delta fp32 or bf16 (a bf16
// GEMM's product, widened exactly); the result fp32, or rounded to bf16 (`bf16_out`) for a bf16 GEMM.
torch::Tensor add_rms_norm_(torch::Tensor& x, const torch::Tensor& delta, const torch::Tensor& weight, double eps,
                            bool bf16_out, const c10::optional<torch::Tensor>& given) {
  check_add_rms_norm(x, delta, weight);
  const int64_t rows = x.size(0), cols = x.size(1);
  auto out = output_or_new("add_rms_norm_", given, {rows, cols},
                           x.options().dtype(bf16_out ? torch::kBFloat16 : torch::kFloat), x, delta, weight);
  add_rms_norm_any(x, delta, weight, eps, bf16_out, {x.data_ptr<float>(), x.stride(0), 0, cols}, out);
  return out;
}

void add_rms_norm_into(const torch::Tensor& x, const torch::Tensor& delta, const torch::Tensor& weight, double eps,
                       bool bf16_out, const torch::Tensor& sum, const torch::Tensor& out) {
  check_add_rms_norm(x, delta, weight);
  const int64_t rows = x.size(0), cols = x.size(1);
  check_output("add_rms_norm_into", sum, {rows, cols}, x.options(), x, delta);
  check_output("add_rms_norm_into", out, {rows, cols}, x.options().dtype(bf16_out ? torch::kBFloat16 : torch::kFloat), x,
               delta, weight, sum);
  const auto [first, last] = team_part((cols + kLanes - 1) / kLanes);
  add_rms_norm_any(x, delta, weight, eps, bf16_out, {sum.data_ptr<float>(), cols, first * kLanes, last * kLanes}, out);
}

// weight * x / sqrt(mean(x^2) + eps), row by row, x fp32 and untouched: add_rms_norm_'s bits for a delta of
// -0.0 (x + -0.0 is x), in one call where torch's rms_norm on the CPU runs a dozen ops.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps,
                       const c10::optional<torch::Tensor>& given) {
  check_rows(x, "x");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
              weight.scalar_type() == torch::kFloat, "shapes do not match");
  auto out = output_or_new("rms_norm", given, {x.size(0), x.size(1)}, x.options(), x, weight);
  float* xp = const_cast<float*>(x.data_ptr<float>());  // in place: nothing stored
  add_rms_norm_rows<false>(xp, x.stride(0), static_cast<const float*>(nullptr), 0, {xp, x.stride(0), 0, 0},
                           weight.data_ptr<float>(), out.data_ptr<float>(), x.size(0), x.size(1),
                           static_cast<float>(eps));
  return out;
}

namespace {

template <typename T>
void rope_rows(const T* xp, int64_t xs, const float* cp, int64_t cs, const float* sp, int64_t ss, float* op,
               int64_t rows, int64_t heads, int64_t dim) {
  const int64_t half = dim / 2;
  at::parallel_for(0, rows, kGrainRows, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      for (int64_t h = 0; h < heads; ++h) {
        const T* xh = xp + r * xs + h * dim;
        float* oh = op + (r * heads + h) * dim;
        for (int64_t c = 0; c < dim; c += kLanes) {
          const int64_t rolled = c < half ? c + half : c - half;
          const Vec a = vmul(vload_row(xh + c), vload(cp + r * cs + c));
          const Vec b = vmul(vload_row(xh + rolled), vload(sp + r * ss + c));
          vstore(oh + c, vadd(a, b));
        }
      }
    }
  });
}

void check_rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& signed_sin) {
  TORCH_CHECK(x.dim() == 3 && (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16) &&
              x.stride(2) == 1 && x.stride(1) == x.size(2), "x must be [T, heads, dim] fp32 or bf16 with contiguous heads");
  check_rows(cos, "cos");
  check_rows(signed_sin, "signed_sin");
  TORCH_CHECK(x.size(2) % 32 == 0 && cos.size(0) == x.size(0) && cos.size(1) == x.size(2) &&
              signed_sin.sizes() == cos.sizes(), "rope needs head_dim a multiple of 32 and one cos/sin row per token");
}

}  // namespace

// x [T, heads, dim] (rows may be strided; fp32, or bf16 widened exactly) -> x * cos + roll(x, dim/2) *
// signed_sin in fp32, with cos and signed_sin [T, dim]: the same three roundings as the op-by-op
// formula on fp32 x (no fused multiply-add), so the result is bitwise the formula's.
void rope_into(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& signed_sin,
               const torch::Tensor& out) {
  check_rope(x, cos, signed_sin);
  check_output("rope", out, {x.size(0), x.size(1), x.size(2)}, x.options().dtype(torch::kFloat), x, cos, signed_sin);
  const int64_t rows = x.size(0), heads = x.size(1), dim = x.size(2);
  const float* cp = cos.data_ptr<float>();
  const float* sp = signed_sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (x.scalar_type() == torch::kBFloat16) {
    rope_rows(row_data<const uint16_t>(x), x.stride(0), cp, cos.stride(0), sp, signed_sin.stride(0), op, rows, heads, dim);
  } else {
    rope_rows(row_data<const float>(x), x.stride(0), cp, cos.stride(0), sp, signed_sin.stride(0), op, rows, heads, dim);
  }
}

torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& signed_sin,
                   const c10::optional<torch::Tensor>& given) {
  check_rope(x, cos, signed_sin);
  auto out = given_or_empty(given, {x.size(0), x.size(1), x.size(2)}, x.options().dtype(torch::kFloat));
  rope_into(x, cos, signed_sin, out);
  return out;
}

namespace {

// silu(gate) * up over kLanes columns (n of them valid), in fp32.
inline Vec silu_times(Vec gate, Vec up) {
  return vmul(vdiv(gate, vadd(vset1(1.f), exp_ps(vsub(vzero(), gate)))), up);
}

// silu(gate) * up row by row, `load` giving fp32 vectors and `store` taking them; inside DecodeLayers' team, this
// thread's part of the columns (in whole vectors).
template <typename T, typename Load, typename Store>
void silu_mul_rows(const T* gp, int64_t gs, T* op, int64_t rows, int64_t inner, const Load& load, const Store& store) {
  rows_by_part(rows, (inner + kLanes - 1) / kLanes, [&](int64_t r0, int64_t r1, int64_t v0, int64_t v1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = gp + r * gs;
      for (int64_t c = v0 * kLanes; c < std::min(inner, v1 * kLanes); c += kLanes) {
        const int64_t n = inner - c;  // a partial last vector loaded and stored lane by lane
        store(op + r * inner + c, silu_times(load(g + c, n), load(g + inner + c, n)), n);
      }
    }
  });
}

void check_gate_up(const torch::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 &&
              (gate_up.scalar_type() == torch::kFloat || gate_up.scalar_type() == torch::kBFloat16),
              "gate_up must be a 2-D fp32 or bf16 tensor with contiguous rows");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up needs an even width");
}

}  // namespace

// bf16 in, bf16 out, computed in fp32 between: what the fp32 kernel gives on the widened input, rounded as torch
// rounds (NaN to 0xFFFF), bit for bit, without the widened copies (widened bf16's GEMMs give and take bf16).
void silu_mul_into(const torch::Tensor& gate_up, const torch::Tensor& out) {
  check_gate_up(gate_up);
  const int64_t rows = gate_up.size(0), inner = gate_up.size(1) / 2, gs = gate_up.stride(0);
  check_output("silu_mul", out, {rows, inner}, gate_up.options(), gate_up);
  if (gate_up.scalar_type() == torch::kBFloat16) {
    silu_mul_rows(reinterpret_cast<const uint16_t*>(gate_up.data_ptr()), gs, reinterpret_cast<uint16_t*>(out.data_ptr()),
                  rows, inner, [](const uint16_t* p, int64_t n) { return vload_bf16_n(p, n); },
                  [](uint16_t* p, Vec v, int64_t n) { vstore_bf16_n(p, v, n); });
  } else {
    silu_mul_rows(gate_up.data_ptr<float>(), gs, out.data_ptr<float>(), rows, inner,
                  [](const float* p, int64_t n) { return vload_n(p, n); },
                  [](float* p, Vec v, int64_t n) { vstore_n(p, v, n); });
  }
}

// silu(gate) * up of a fused [rows, 2 * inner] projection, in its dtype (fp32 or bf16).
torch::Tensor silu_mul(const torch::Tensor& gate_up, const c10::optional<torch::Tensor>& given) {
  check_gate_up(gate_up);
  auto out = given_or_empty(given, {gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  silu_mul_into(gate_up, out);
  return out;
}

namespace {

struct FirstMax {
  int64_t index;
  float value;
  bool nan;
};

// The first index of row[begin, end)'s maximum, or of its first NaN (begin < end).
FirstMax first_max(const float* row, int64_t begin, int64_t end) {
  const Vec lowest = vset1(-INFINITY);
  Vec best = lowest;
  uint32_t nan = 0;
  for (int64_t c = begin; c < end; c += kLanes) {
    const Vec v = vload_n_or(row + c, end - c, lowest);
    nan |= nan_bits(v);
    best = vmax(best, v);
  }
  if (nan) {
    int64_t index = begin;
    while (!std::isnan(row[index])) ++index;
    return {index, row[index], true};
  }
  const float value = vmax_of(best);
  const Vec top = vset1(value);
  for (int64_t c = begin; c < end; c += kLanes) {
    const uint32_t hit = equal_bits(vload_n(row + c, end - c), top, end - c);
    if (hit) return {c + __builtin_ctz(hit), value, false};
  }
  return {begin, value, false};  // not reached: some lane holds the maximum
}

// Fewer rows than threads, this wide or wider: each row's parts on all threads. A one-stream step's 49152 logits
// were written by both threads (the LM head's halves of its panels), each half in its writer's cache.
constexpr int64_t kSplitColumns = 16384;

}  // namespace

// The first index of each row's maximum, NaN counting as the maximum (torch.argmax's rule).
torch::Tensor argmax_rows(const torch::Tensor& logits) {
  check_rows(logits, "logits");
  const int64_t rows = logits.size(0), cols = logits.size(1), threads = at::get_num_threads();
  TORCH_CHECK(cols > 0, "logits need at least one column");
  auto out = torch::empty({rows}, logits.options().dtype(torch::kLong));
  const float* lp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t ls = logits.stride(0);
  if (rows >= threads || cols < kSplitColumns || at::in_parallel_region()) {
    at::parallel_for(0, rows, 1, [&](int64_t first, int64_t last) {
      for (int64_t r = first; r < last; ++r) op[r] = first_max(lp + r * ls, 0, cols).index;
    });
    return out;
  }
  std::vector<FirstMax> parts(threads);
  for (int64_t r = 0; r < rows; ++r) {
    at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
      for (int64_t p = first; p < last; ++p) parts[p] = first_max(lp + r * ls, cols * p / threads, cols * (p + 1) / threads);
    });
    FirstMax best = parts[0];  // the first part with a NaN, else the first with the largest maximum
    for (int64_t p = 1; p < threads && !best.nan; ++p) {
      if (parts[p].nan || parts[p].value > best.value) best = parts[p];
    }
    op[r] = best.index;
  }
  return out;
}
