// A prompt chunk's attention in vectors (flash attention: one pass over the keys, softmax online),
// for CPUs without AMX tiles (amx_attention.cpp is the tile version).
//
// torch's SDPA on the CPU runs SmolLM2's chunks (head_dim 64) at 45-80 GFLOP/s on a 2-core Zen 4
// whose fp32 GEMMs reach 225: it takes a later chunk only with an explicit mask, scores every
// masked pair, and its per-block GEMM calls are small. Here each block of 16 queries of one head
// reads only the keys it sees, 128 at a time, with register-blocked products: S = Q K^T over K
// packed key-major, and O += P V. Each KV head's K is packed once per call, so the query heads of a
// group share it.
//
// Two kinds of products:
// - fp32 (any build): q, K and V widened exactly from bf16 where they are bf16, K packed per
//   dimension, V rows read in place; fp32 throughout.
// - bf16 (`bf16_products`, the AVX-512 build on a CPU with AVX512-BF16): vdpbf16ps, two bf16
//   products summed into fp32 per lane, on q rounded to bf16, K packed as key-wise dimension pairs
//   and V as dimension-wise key pairs; P rounded to bf16 for P V, as SDPA does in bf16 and the AMX
//   kernel does. Half the instructions of fp32's FMAs.
// Both: scores scaled in fp32, exp_ps's exp (about 1 ulp), running sums and the output's division
// in fp32, sums in key order within each block.
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

constexpr int64_t kPairStrip = 16;  // bf16 products: keys per packed K vector (one lane each, a pair of dimensions)

inline uint32_t pair_at(const uint16_t* p) {  // two adjacent bf16 values as one 32-bit lane
  uint32_t pair;
  std::memcpy(&pair, p, sizeof pair);
  return pair;
}

// bf16 products: one strip of a KV head's K [keys, dim] as [dim / 2][kPairStrip keys][2 dims], zero
// past `keys`; and its V as [keys / 2][dim][2 keys] from key pair `first` on, zero past `keys`.
void pack_key_pairs(const uint16_t* k, int64_t stride, int64_t first, int64_t keys, int64_t dim, uint32_t* dst) {
  for (int64_t j = 0; j < kPairStrip; ++j) {
    const int64_t key = first + j;
    for (int64_t d = 0; d < dim; d += 2) dst[d / 2 * kPairStrip + j] = key < keys ? pair_at(k + key * stride + d) : 0;
  }
}

void pack_value_pairs(const uint16_t* v, int64_t stride, int64_t pair, int64_t keys, int64_t dim, uint32_t* dst) {
  const int64_t even = 2 * pair, odd = even + 1;
  for (int64_t d = 0; d < dim; ++d) {
    const uint32_t low = even < keys ? v[even * stride + d] : 0, high = odd < keys ? v[odd * stride + d] : 0;
    dst[d] = low | high << 16;
  }
}

#if defined(__AVX512F__)
#define BF16_PRODUCTS __attribute__((target("avx512f,avx512bw,avx512bf16")))

// S [R rows x 2 kPairStrip keys] = Q [R x dim] (bf16) . K^T for two packed strips of key pairs.
template <int R>
BF16_PRODUCTS void score_pairs(const uint16_t* q, int64_t dim, const uint32_t* k0, float* s, int64_t s_stride) {
  const uint32_t* k1 = k0 + dim / 2 * kPairStrip;
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim / 2; ++d) {
    const auto w0 = (__m512bh)_mm512_loadu_si512(k0 + d * kPairStrip);
    const auto w1 = (__m512bh)_mm512_loadu_si512(k1 + d * kPairStrip);
    for (int r = 0; r < R; ++r) {
      const auto x = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pair_at(q + r * dim + 2 * d)));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, w1);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(s + r * s_stride, acc[r][0]);
    _mm512_storeu_ps(s + r * s_stride + kPairStrip, acc[r][1]);
  }
}

// O [R rows x 64 columns] = O * rescale + P [R x 2 pairs keys] (bf16) . V over packed key pairs
// (`dim` pairs apart).
template <int R>
BF16_PRODUCTS void value_pairs(const uint16_t* p, int64_t p_stride, const uint32_t* v, int64_t dim, int64_t pairs,
                               const float* rescale, float* o) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * dim + c * 16), _mm512_set1_ps(rescale[r]));
  for (int64_t j = 0; j < pairs; ++j) {
    const uint32_t* row = v + j * dim;
    __m512bh w[4];
    for (int c = 0; c < 4; ++c) w[c] = (__m512bh)_mm512_loadu_si512(row + c * 16);
    for (int r = 0; r < R; ++r) {
      const auto x = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pair_at(p + r * p_stride + 2 * j)));
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], x, w[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(o + r * dim + c * 16, acc[r][c]);
}
#else
// Never called: the entry point takes bf16 products in the AVX-512 build only.
template <int R>
void score_pairs(const uint16_t*, int64_t, const uint32_t*, float*, int64_t) {}
template <int R>
void value_pairs(const uint16_t*, int64_t, const uint32_t*, int64_t, int64_t, const float*, float*) {}
#endif

struct Block {  // one head's block of up to kRows queries, and its running softmax
  alignas(64) float q[kRows * kMaxDim];       // fp32 products
  alignas(64) uint16_t q16[kRows * kMaxDim];  // bf16 products: q rounded
  alignas(64) float s[kRows * kKeyBlock];
  alignas(64) uint16_t p16[kRows * kKeyBlock];  // bf16 products: P rounded
  alignas(64) float o[kRows * kMaxDim];
  float max[kRows], sum[kRows], rescale[kRows];
};

// Row i's softmax step over a block's scores (times `scale`, > 0): the first `valid` of `width` are
// seen (the rest become 0 in place), the row's new maximum, sum, and the factor its earlier output
// shrinks by.
void softmax_row(Block& b, int64_t i, int64_t valid, int64_t width, float scale) {
  float* s = b.s + i * kKeyBlock;
  valid = std::min(valid, width);
  if (valid <= 0) {
    std::memset(s, 0, width * sizeof(float));
    b.rescale[i] = 1.f;
    return;
  }
  const float peak = running_max(s, valid, b.max[i], scale);
  const Vec shift = vset1(-peak), factor = vset1(scale);
  Vec total = vzero();
  for (int64_t c = 0; c < width; c += kLanes) {
    const Vec e = vkeep_n(exp_ps(vfma(vload(s + c), factor, shift)), valid - c);
    total = vadd(total, e);
    vstore(s + c, e);
  }
  b.rescale[i] = std::exp(b.max[i] - peak);  // 0 on the first step (max is -inf)
  b.sum[i] = b.sum[i] * b.rescale[i] + vsum(total);
  b.max[i] = peak;
}

struct Call {  // one call's packed K, its V, and their shapes
  const void* keys;    // fp32 products: [kv_heads][padded / kKeyStrip][dim][kKeyStrip] fp32; bf16: pack_key_pairs'
  const void* values;  // fp32 products: V itself (fp32 or bf16), rows v_stride apart; bf16: pack_value_pairs'
  int64_t v_stride, padded, n, heads, group, dim, start;
  float scale;
};

// The item's queries into the block: scaled later, in the softmax; rounded to bf16 for bf16 products.
template <bool Bf16, typename Q>
void load_queries(Block& b, const Q* q, int64_t q_stride, int64_t rows, int64_t dim) {
  for (int64_t i = 0; i < kRows; ++i) {
    for (int64_t d = 0; d < dim; d += kLanes) {
      const Vec x = i < rows ? vload_row(q + i * q_stride + d) : vzero();
      if constexpr (Bf16) vstore_bf16(b.q16 + i * dim + d, x);
      else vstore(b.q + i * dim + d, x);
    }
    b.max[i] = -std::numeric_limits<float>::infinity();
    b.sum[i] = 0.f;
  }
  std::fill(b.o, b.o + kRows * dim, 0.f);
}

// One key block [key0, key0 + span) of KV head g for the block's first `rows` queries (query i at
// position `first` + i).
template <bool Bf16, typename V>
void attend_key_block(Block& b, const Call& c, int64_t g, int64_t key0, int64_t span, int64_t first, int64_t rows) {
  const int64_t dim = c.dim, width = (span + kKeyStrip - 1) / kKeyStrip * kKeyStrip;
  // rows past `rows` are zero queries, computed up to the microkernels' row counts
  const int64_t score_rows = (rows + kScoreRows - 1) / kScoreRows * kScoreRows;
  const int64_t value_rows = (rows + kValueRows - 1) / kValueRows * kValueRows;
  for (int64_t r = 0; r < score_rows; r += kScoreRows)
    for (int64_t j = 0; j < width; j += kKeyStrip) {
      float* s = b.s + r * kKeyBlock + j;
      if constexpr (Bf16)
        score_pairs<kScoreRows>(b.q16 + r * dim, dim,
                                static_cast<const uint32_t*>(c.keys) + (g * c.padded + key0 + j) * dim / 2, s, kKeyBlock);
      else
        score_strip<kScoreRows>(b.q + r * dim, dim, static_cast<const float*>(c.keys) + (g * c.padded + key0 + j) * dim,
                                s, kKeyBlock);
    }
  for (int64_t i = 0; i < value_rows; ++i) softmax_row(b, i, first + i + 1 - key0, width, c.scale);
  if constexpr (Bf16)
    for (int64_t i = 0; i < value_rows; ++i)
      for (int64_t j = 0; j < width; j += kLanes) vstore_bf16(b.p16 + i * kKeyBlock + j, vload(b.s + i * kKeyBlock + j));
  for (int64_t r = 0; r < value_rows; r += kValueRows)
    for (int64_t col = 0; col < dim; col += kColumns) {
      if constexpr (Bf16)
        value_pairs<kValueRows>(b.p16 + r * kKeyBlock, kKeyBlock,
                                static_cast<const uint32_t*>(c.values) + (g * c.padded + key0) / 2 * dim + col, dim,
                                (span + 1) / 2, b.rescale + r, b.o + r * dim + col);
      else
        value_columns<kValueRows>(b.s + r * kKeyBlock, kKeyBlock,
                                  static_cast<const V*>(c.values) + key0 * c.v_stride + g * dim + col, c.v_stride, dim,
                                  span, b.rescale + r, b.o + r * dim + col);
    }
}

template <bool Bf16, typename Q, typename V, typename O>
void attend_blocks(const Q* q, int64_t q_stride, const Call& c, O* out, int64_t out_stride) {
  const int64_t blocks = (c.n + kRows - 1) / kRows, items = blocks * c.heads, dim = c.dim;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), items);
  // Item i is (query block i / heads, head i % heads): later blocks see more keys, so each thread
  // takes every threads-th item rather than a contiguous run.
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    auto block = std::make_unique<Block>();
    Block& b = *block;
    for (int64_t t = first; t < last; ++t)
      for (int64_t item = t; item < items; item += threads) {
        const int64_t row0 = item / c.heads * kRows, h = item % c.heads, rows = std::min(kRows, c.n - row0);
        load_queries<Bf16>(b, q + row0 * q_stride + h * dim, q_stride, rows, dim);
        const int64_t seen = c.start + row0 + rows;  // keys the block's last query sees
        for (int64_t key0 = 0; key0 < seen; key0 += kKeyBlock)
          attend_key_block<Bf16, V>(b, c, h / c.group, key0, std::min(kKeyBlock, seen - key0), c.start + row0, rows);
        for (int64_t i = 0; i < rows; ++i) {
          const Vec inverse = vset1(1.f / b.sum[i]);
          O* dst = out + (row0 + i) * out_stride + h * dim;
          for (int64_t col = 0; col < dim; col += kLanes) {
            const Vec r = vmul(vload(b.o + i * dim + col), inverse);
            if constexpr (std::is_same_v<O, float>) vstore(dst + col, r);
            else vstore_bf16(dst + col, r);
          }
        }
      }
  });
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

// bf16 products: every KV head's K into `keys` ([kv_heads][padded / kPairStrip][dim / 2][kPairStrip]) and
// V into `values` ([kv_heads][padded / 2][dim]), pairs of bf16 in each uint32.
void pack_pairs(const uint16_t* k, const uint16_t* v, int64_t k_stride, int64_t v_stride, int64_t keys,
                int64_t padded, int64_t kv_heads, int64_t dim, uint32_t* key_pairs, uint32_t* value_pairs) {
  const int64_t strips = padded / kPairStrip, pairs = padded / 2;
  at::parallel_for(0, kv_heads * (strips + pairs), 16, [&](int64_t first, int64_t last) {
    for (int64_t job = first; job < last; ++job) {
      const int64_t g = job / (strips + pairs), i = job % (strips + pairs);
      if (i < strips)
        pack_key_pairs(k + g * dim, k_stride, i * kPairStrip, keys, dim, key_pairs + (g * strips + i) * dim / 2 * kPairStrip);
      else
        pack_value_pairs(v + g * dim, v_stride, i - strips, keys, dim, value_pairs + (g * pairs + i - strips) * dim);
    }
  });
}

template <bool Bf16, typename V>
void attend_each(const torch::Tensor& q, const Call& call, torch::Tensor& out) {
  const auto into = [&](const auto* qin) {
    if (out.scalar_type() == torch::kFloat)
      attend_blocks<Bf16, std::remove_cv_t<std::remove_pointer_t<decltype(qin)>>, V>(qin, q.stride(0), call,
                                                                                      out.data_ptr<float>(), out.stride(0));
    else
      attend_blocks<Bf16, std::remove_cv_t<std::remove_pointer_t<decltype(qin)>>, V>(
          qin, q.stride(0), call, reinterpret_cast<uint16_t*>(out.data_ptr()), out.stride(0));
  };
  if (q.scalar_type() == torch::kFloat) into(q.data_ptr<float>());
  else into(reinterpret_cast<const uint16_t*>(q.data_ptr()));
}

}  // namespace

void prefill_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t start,
                       double scale, torch::Tensor& out, bool bf16_products) {
  for (const torch::Tensor* t : std::initializer_list<const torch::Tensor*>{&q, &k, &v, &out})
    TORCH_CHECK(t->dim() == 3 && fp32_or_bf16(*t) && t->stride(2) == 1 && t->stride(1) == t->size(2),
                "q, k, v and out must be fp32 or bf16 [tokens, heads, dim] with contiguous heads");
  const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k.size(1), keys = k.size(0);
  TORCH_CHECK(dim % kColumns == 0 && dim <= kMaxDim, "head_dim must be a multiple of ", kColumns, ", at most ", kMaxDim);
  TORCH_CHECK(v.sizes() == k.sizes() && v.scalar_type() == k.scalar_type() && k.size(2) == dim && heads % kv_heads == 0,
              "k and v must be alike and match q's heads");
  TORCH_CHECK(start >= 0 && keys == start + n, "the context must hold start + the chunk's tokens");
  TORCH_CHECK(out.sizes() == q.sizes(), "out must have q's shape");
  TORCH_CHECK(!bf16_products || k.scalar_type() == torch::kBFloat16, "bf16 products take bf16 K and V");
#if !defined(__AVX512F__)
  TORCH_CHECK(!bf16_products, "bf16 products are in the avx512 build only");
#endif
  if (n == 0) return;
  const int64_t padded = (keys + kKeyStrip - 1) / kKeyStrip * kKeyStrip;
  Call call{nullptr, nullptr, v.stride(0), padded, n, heads, heads / kv_heads, dim, start, static_cast<float>(scale)};
  const auto* kin = reinterpret_cast<const uint16_t*>(k.data_ptr());
  const auto* vin = reinterpret_cast<const uint16_t*>(v.data_ptr());
  if (bf16_products) {
    auto packed = torch::empty({2, kv_heads, padded * dim / 2}, k.options().dtype(torch::kInt));
    auto* kp = reinterpret_cast<uint32_t*>(packed.data_ptr<int32_t>());
    pack_pairs(kin, vin, k.stride(0), v.stride(0), keys, padded, kv_heads, dim, kp, kp + kv_heads * padded * dim / 2);
    call.keys = kp;
    call.values = kp + kv_heads * padded * dim / 2;
    attend_each<true, uint32_t>(q, call, out);
    return;
  }
  auto packed = torch::empty({kv_heads, padded * dim}, k.options().dtype(torch::kFloat));
  call.keys = packed.data_ptr<float>();
  call.values = v.data_ptr();
  if (k.scalar_type() == torch::kFloat) {
    pack_keys(k.data_ptr<float>(), k.stride(0), keys, padded, kv_heads, dim, packed.data_ptr<float>());
    attend_each<false, float>(q, call, out);
  } else {
    pack_keys(kin, k.stride(0), keys, padded, kv_heads, dim, packed.data_ptr<float>());
    attend_each<false, uint16_t>(q, call, out);
  }
}
