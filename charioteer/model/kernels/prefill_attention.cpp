// A prompt chunk's attention in fp32 vectors (flash attention: one pass over the keys, softmax
// online), for CPUs without AMX tiles (amx_attention.cpp is the tile version).
//
// torch's SDPA on the CPU runs SmolLM2's chunks (head_dim 64) at 60-90 GFLOP/s on a 2-core Zen 4
// whose fp32 GEMMs reach 225: it takes a later chunk only with an explicit mask, scores every
// masked pair, and its per-block GEMM calls are small. Here each block of 16 queries of one head
// reads only the keys it sees, 128 at a time, with register-blocked products: S = Q K^T over K
// packed key-major per dimension, and O += P V over V rows read whole. K and V of each KV head are
// packed once per call (widened to fp32 from a bf16 cache), so the query heads of a group share them.
//
// Precision: fp32 throughout (bf16 inputs widened exactly); the scale is folded into Q, the exp is
// exp_ps's (about 1 ulp), and sums run in key order within each block.
#include "kernels.h"
#include "vec_math.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>

namespace {

constexpr int64_t kRows = 16;                  // queries of one head per work item
constexpr int64_t kKeyBlock = 128;             // keys per softmax step
constexpr int64_t kKeyStrip = 2 * kLanes;      // keys one score microkernel call covers
constexpr int kScoreRows = kLanes == 16 ? 8 : 4;  // S rows per microkernel: 2 x kScoreRows accumulators
constexpr int kValueRows = kLanes == 16 ? 4 : 2;  // P V rows per microkernel, 4 vectors of output columns each
constexpr int64_t kColumns = 4 * kLanes;       // output columns per P V microkernel call
constexpr int64_t kMaxDim = 256;

inline float widen(float x) { return x; }
inline float widen(uint16_t bf16) {  // exact: bf16 is the top half of an fp32's bits
  const uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

// One strip of a KV head's K [keys, dim] as [dim][kKeyStrip]: per dimension, the strip's keys side
// by side, zero past `keys`.
template <typename T>
void pack_strip(const T* k, int64_t stride, int64_t first, int64_t keys, int64_t dim, float* dst) {
  for (int64_t j = 0; j < kKeyStrip; ++j) {
    const int64_t key = first + j;
    const T* row = k + key * stride;
    for (int64_t d = 0; d < dim; ++d) dst[d * kKeyStrip + j] = key < keys ? widen(row[d]) : 0.f;
  }
}

// S [R rows x kKeyStrip keys] = Q [R x dim] . K^T for one packed strip of keys.
template <int R>
inline void score_strip(const float* q, int64_t dim, const float* kt, float* s, int64_t s_stride) {
  Vec acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vzero();
  for (int64_t d = 0; d < dim; ++d) {
    const Vec k0 = vload(kt + d * kKeyStrip), k1 = vload(kt + d * kKeyStrip + kLanes);
    for (int r = 0; r < R; ++r) {
      const Vec x = vset1(q[r * dim + d]);
      acc[r][0] = vfma(x, k0, acc[r][0]);
      acc[r][1] = vfma(x, k1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    vstore(s + r * s_stride, acc[r][0]);
    vstore(s + r * s_stride + kLanes, acc[r][1]);
  }
}

// O [R rows x kColumns] = O * rescale + P [R x keys] . V [keys x kColumns], V read in place (rows
// `v_stride` apart, fp32 or bf16 widened as read) up to `valid` keys: P is 0 past them.
template <int R, typename T>
inline void value_columns(const float* p, int64_t p_stride, const T* v, int64_t v_stride, int64_t dim, int64_t keys,
                          const float* rescale, float* o) {
  Vec acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = vmul(vload(o + r * dim + c * kLanes), vset1(rescale[r]));
  for (int64_t j = 0; j < keys; ++j) {
    const T* row = v + j * v_stride;
    const Vec v0 = vload_row(row), v1 = vload_row(row + kLanes), v2 = vload_row(row + 2 * kLanes),
              v3 = vload_row(row + 3 * kLanes);
    for (int r = 0; r < R; ++r) {
      const Vec x = vset1(p[r * p_stride + j]);
      acc[r][0] = vfma(x, v0, acc[r][0]);
      acc[r][1] = vfma(x, v1, acc[r][1]);
      acc[r][2] = vfma(x, v2, acc[r][2]);
      acc[r][3] = vfma(x, v3, acc[r][3]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) vstore(o + r * dim + c * kLanes, acc[r][c]);
}

struct Block {  // one head's block of up to kRows queries, and its running softmax
  alignas(64) float q[kRows * kMaxDim];
  alignas(64) float s[kRows * kKeyBlock];
  alignas(64) float o[kRows * kMaxDim];
  float max[kRows], sum[kRows], rescale[kRows];
};

// Row i's softmax step over a block's scores: the first `valid` of `width` are seen (the rest
// become 0 in place), the row's new maximum, sum, and the factor its earlier output shrinks by.
void softmax_row(Block& b, int64_t i, int64_t valid, int64_t width) {
  float* s = b.s + i * kKeyBlock;
  valid = std::min(valid, width);
  if (valid <= 0) {
    std::memset(s, 0, width * sizeof(float));
    b.rescale[i] = 1.f;
    return;
  }
  const Vec lowest = vset1(-std::numeric_limits<float>::infinity());
  Vec top = lowest;
  for (int64_t c = 0; c < valid; c += kLanes) top = vmax(top, vload_n_or(s + c, valid - c, lowest));
  const float peak = std::max(b.max[i], vmax_of(top));
  const Vec shift = vset1(peak);
  Vec total = vzero();
  for (int64_t c = 0; c < width; c += kLanes) {
    const Vec e = vkeep_n(exp_ps(vsub(vload(s + c), shift)), valid - c);
    total = vadd(total, e);
    vstore(s + c, e);
  }
  b.rescale[i] = std::exp(b.max[i] - peak);  // 0 on the first step (max is -inf)
  b.sum[i] = b.sum[i] * b.rescale[i] + vsum(total);
  b.max[i] = peak;
}

template <typename Q, typename T, typename O>
void attend_blocks(const Q* qin, int64_t q_stride, const float* kp, const T* v, int64_t v_stride, int64_t padded,
                   int64_t n, int64_t heads, int64_t group, int64_t dim, int64_t start, float scale, O* out,
                   int64_t out_stride) {
  const int64_t blocks = (n + kRows - 1) / kRows, items = blocks * heads;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), items);
  const Vec factor = vset1(scale);
  // Item i is (query block i / heads, head i % heads): later blocks see more keys, so each thread
  // takes every threads-th item rather than a contiguous run.
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    auto block = std::make_unique<Block>();
    Block& b = *block;
    for (int64_t t = first; t < last; ++t)
      for (int64_t item = t; item < items; item += threads) {
        const int64_t row0 = item / heads * kRows, h = item % heads, g = h / group;
        const int64_t rows = std::min(kRows, n - row0);
        // rows past `rows` are zero queries, computed up to the microkernels' row counts
        const int64_t score_rows = (rows + kScoreRows - 1) / kScoreRows * kScoreRows;
        const int64_t value_rows = (rows + kValueRows - 1) / kValueRows * kValueRows;
        for (int64_t i = 0; i < kRows; ++i) {
          const Q* row = qin + (row0 + i) * q_stride + h * dim;
          for (int64_t d = 0; d < dim; d += kLanes)
            vstore(b.q + i * dim + d, i < rows ? vmul(vload_row(row + d), factor) : vzero());
          b.max[i] = -std::numeric_limits<float>::infinity();
          b.sum[i] = 0.f;
        }
        std::fill(b.o, b.o + kRows * dim, 0.f);
        const int64_t seen = start + row0 + rows;  // keys the block's last query sees
        const float* kg = kp + g * padded * dim;
        const T* vg = v + g * dim;
        for (int64_t key0 = 0; key0 < seen; key0 += kKeyBlock) {
          const int64_t span = std::min(kKeyBlock, seen - key0), width = (span + kKeyStrip - 1) / kKeyStrip * kKeyStrip;
          for (int64_t r = 0; r < score_rows; r += kScoreRows)
            for (int64_t j = 0; j < width; j += kKeyStrip)
              score_strip<kScoreRows>(b.q + r * dim, dim, kg + (key0 + j) * dim, b.s + r * kKeyBlock + j, kKeyBlock);
          for (int64_t i = 0; i < value_rows; ++i) softmax_row(b, i, start + row0 + i + 1 - key0, width);
          for (int64_t r = 0; r < value_rows; r += kValueRows)
            for (int64_t c = 0; c < dim; c += kColumns)
              value_columns<kValueRows>(b.s + r * kKeyBlock, kKeyBlock, vg + key0 * v_stride + c, v_stride, dim, span,
                                        b.rescale + r, b.o + r * dim + c);
        }
        for (int64_t i = 0; i < rows; ++i) {
          const Vec inverse = vset1(1.f / b.sum[i]);
          O* dst = out + (row0 + i) * out_stride + h * dim;
          for (int64_t c = 0; c < dim; c += kLanes) {
            const Vec r = vmul(vload(b.o + i * dim + c), inverse);
            if constexpr (std::is_same_v<O, float>) vstore(dst + c, r);
            else vstore_bf16(dst + c, r);
          }
        }
      }
  });
}

bool fp32_or_bf16(const torch::Tensor& t) {
  return t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kBFloat16;
}

// Every KV head's K (fp32 or bf16) as [kv_heads][padded / kKeyStrip][dim][kKeyStrip] into `packed`.
template <typename T>
void pack_keys(const T* k, int64_t stride, int64_t keys, int64_t padded, int64_t kv_heads, int64_t dim, float* packed) {
  const int64_t strips = padded / kKeyStrip;
  at::parallel_for(0, kv_heads * strips, 16, [&](int64_t first, int64_t last) {
    for (int64_t job = first; job < last; ++job) {
      const int64_t g = job / strips, strip = job % strips;
      pack_strip(k + g * dim, stride, strip * kKeyStrip, keys, dim, packed + (g * strips + strip) * dim * kKeyStrip);
    }
  });
}

}  // namespace

void prefill_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t start,
                       double scale, torch::Tensor& out) {
  for (const torch::Tensor* t : std::initializer_list<const torch::Tensor*>{&q, &k, &v, &out})
    TORCH_CHECK(t->dim() == 3 && fp32_or_bf16(*t) && t->stride(2) == 1 && t->stride(1) == t->size(2),
                "q, k, v and out must be fp32 or bf16 [tokens, heads, dim] with contiguous heads");
  const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k.size(1), keys = k.size(0);
  TORCH_CHECK(dim % kColumns == 0 && dim <= kMaxDim, "head_dim must be a multiple of ", kColumns, ", at most ", kMaxDim);
  TORCH_CHECK(v.sizes() == k.sizes() && v.scalar_type() == k.scalar_type() && k.size(2) == dim && heads % kv_heads == 0,
              "k and v must be alike and match q's heads");
  TORCH_CHECK(start >= 0 && keys == start + n, "the context must hold start + the chunk's tokens");
  TORCH_CHECK(out.sizes() == q.sizes(), "out must have q's shape");
  if (n == 0) return;
  const int64_t padded = (keys + kKeyStrip - 1) / kKeyStrip * kKeyStrip, group = heads / kv_heads;
  auto packed = torch::empty({kv_heads, padded * dim}, k.options().dtype(torch::kFloat));
  float* kp = packed.data_ptr<float>();
  const auto s = static_cast<float>(scale);
  const auto run = [&](const auto* qin, const auto* vin, auto* o) {
    pack_keys(reinterpret_cast<decltype(vin)>(k.data_ptr()), k.stride(0), keys, padded, kv_heads, dim, kp);
    attend_blocks(qin, q.stride(0), kp, vin, v.stride(0), padded, n, heads, group, dim, start, s, o, out.stride(0));
  };
  const auto with_kv = [&](const auto* qin, auto* o) {
    if (k.scalar_type() == torch::kFloat) run(qin, v.data_ptr<float>(), o);
    else run(qin, reinterpret_cast<const uint16_t*>(v.data_ptr()), o);
  };
  const auto into = [&](const auto* qin) {
    if (out.scalar_type() == torch::kFloat) with_kv(qin, out.data_ptr<float>());
    else with_kv(qin, reinterpret_cast<uint16_t*>(out.data_ptr()));
  };
  if (q.scalar_type() == torch::kFloat) into(q.data_ptr<float>());
  else into(reinterpret_cast<const uint16_t*>(q.data_ptr()));
}
