// A prompt chunk's attention on AMX tiles (flash attention: one pass over the keys, softmax online).
//
// Query i of the chunk sits at position start + i and sees keys 0 .. start + i. torch's SDPA on
// the CPU takes such a chunk only with an explicit mask, computes every masked score, and its
// causal mode skips little; at SmolLM2's shapes inside a serving step it ran 0.7 G query-key pairs
// a second. Here each block of 16 queries of one head reads only the keys it sees, 128 at a time:
// S = Q K^T on tiles, the softmax in fp32 vectors, P rounded to bf16, and P V back on tiles. K and V
// of each KV head are first laid out once in the order the B tiles read them, so the query heads of
// a group share that copy.
//
// Precision is SDPA's in bf16: bf16 products summed in fp32, P rounded to bf16 before P V, the
// running sums and the output's division in fp32.
#include "amx_tiles.h"
#include "kernels.h"
#include "vec_math.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>

namespace {

constexpr int64_t kKeyBlock = 256;  // keys per softmax step (128: 512 queries at 512 1.10x slower, others 0.97-1.07x)
constexpr int64_t kMaxDim = 128;
constexpr int64_t kMaxColTiles = 4;  // C tiles 0-3 take P V, 16 output columns each; 4 is S, 5 an A tile, 6 a B tile

// One KV head's K [keys, dim] as S = Q K^T's B tiles: [key/16][dim/32][16 rows][16 keys x 2 dims],
// padded with zero keys to `padded`.
void pack_keys(const uint16_t* k, int64_t stride, int64_t keys, int64_t padded, int64_t dim, uint16_t* dst) {
  const int64_t steps = dim / kTileK;
  auto* out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t block = 0; block < padded / kTileN; ++block)
    for (int64_t step = 0; step < steps; ++step)
      for (int64_t key = 0; key < kTileN; ++key) {
        const int64_t index = block * kTileN + key;
        const auto* row = reinterpret_cast<const uint32_t*>(k + index * stride) + step * kTileRows;
        uint32_t* tile = out + (block * steps + step) * kTileRows * kTileN;
        for (int64_t r = 0; r < kTileRows; ++r) tile[r * kTileN + key] = index < keys ? row[r] : 0;
      }
}

// One KV head's V [keys, dim] as P V's B tiles: [dim/16][key/32][16 rows][16 dims x 2 keys], padded
// with zero keys (P is 0 there, and 0 * garbage could be NaN).
void pack_values(const uint16_t* v, int64_t stride, int64_t keys, int64_t padded, int64_t dim, uint16_t* dst) {
  const int64_t steps = padded / kTileK;
  auto* out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t step = 0; step < steps; ++step)
    for (int64_t r = 0; r < kTileRows; ++r) {
      const int64_t first = step * kTileK + 2 * r;
      const uint16_t* even = first < keys ? v + first * stride : nullptr;
      const uint16_t* odd = first + 1 < keys ? v + (first + 1) * stride : nullptr;
      for (int64_t col = 0; col < dim; ++col) {
        const uint32_t low = even ? even[col] : 0, high = odd ? odd[col] : 0;
        out[((col / kTileN * steps + step) * kTileRows + r) * kTileN + col % kTileN] = low | high << 16;
      }
    }
}

// C tiles 0..T-1 (+)= P [16 x 32 keys per step] . V over `steps` key steps, for T 16-column blocks.
template <int T>
__attribute__((target("amx-tile,amx-bf16"))) void pv_tiles(const uint16_t* p, int64_t p_stride, const uint16_t* v,
                                                          int64_t v_block, int64_t steps, float* c, int64_t c_stride) {
  if (T > 0) _tile_zero(0);
  if (T > 1) _tile_zero(1);
  if (T > 2) _tile_zero(2);
  if (T > 3) _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(5, p + s * kTileK, p_stride);
    const uint16_t* b = v + s * kTileElems;
    if (T > 0) { _tile_loadd(6, b, 64); _tile_dpbf16ps(0, 5, 6); }
    if (T > 1) { _tile_loadd(6, b + v_block, 64); _tile_dpbf16ps(1, 5, 6); }
    if (T > 2) { _tile_loadd(6, b + 2 * v_block, 64); _tile_dpbf16ps(2, 5, 6); }
    if (T > 3) { _tile_loadd(6, b + 3 * v_block, 64); _tile_dpbf16ps(3, 5, 6); }
  }
  if (T > 0) _tile_stored(0, c, c_stride);
  if (T > 1) _tile_stored(1, c + kTileN, c_stride);
  if (T > 2) _tile_stored(2, c + 2 * kTileN, c_stride);
  if (T > 3) _tile_stored(3, c + 3 * kTileN, c_stride);
}

// S [16 x 16 keys] = Q [16 x dim] . K^T of one 16-key block, into s (row stride s_stride bytes).
__attribute__((target("amx-tile,amx-bf16"))) void score_tile(const uint16_t* q, int64_t dim, const uint16_t* k,
                                                            float* s, int64_t s_stride) {
  _tile_zero(4);
  for (int64_t step = 0; step < dim / kTileK; ++step) {
    _tile_loadd(5, q + step * kTileK, dim * 2);
    _tile_loadd(6, k + step * kTileElems, 64);
    _tile_dpbf16ps(4, 5, 6);
  }
  _tile_stored(4, s, s_stride);
}

struct Block {  // one head's block of up to 16 queries, and its running softmax
  alignas(64) uint16_t q[kTileRows * kMaxDim];
  alignas(64) float s[kTileRows * kKeyBlock];
  alignas(64) uint16_t p[kTileRows * kKeyBlock];
  alignas(64) float o[kTileRows * kMaxDim];
  alignas(64) float delta[kTileRows * kMaxDim];
  alignas(64) float max[kTileRows], sum[kTileRows], rescale[kTileRows], total[kTileRows];
};

#if defined(__AVX512F__)
// P's rounding to bf16 with AVX512-BF16's own instruction (every CPU with AMX-BF16 has it): a third of the
// softmax's instructions went to rounding in integer steps. To nearest even as vstore_bf16, except that a value
// below bf16's smallest normal comes out 0 (a probability under 1e-38 of the row's largest).
#define SOFTMAX_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
SOFTMAX_TARGET inline void store_p(uint16_t* p, Vec e) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
}
#else
#define SOFTMAX_TARGET
inline void store_p(uint16_t* p, Vec e) { vstore_bf16(p, e); }
#endif

// Row i's softmax step over the block's first `valid` scores (the rest masked), in base 2 (`scale`
// includes log2(e)): its new maximum (the old one left in b.rescale for softmax_rescale), P (bf16) over
// the block's first `width` columns, 0 where masked, and its sum, added into b.sum once rescaled.
SOFTMAX_TARGET void softmax_row(Block& b, int64_t i, int64_t valid, int64_t width, float scale) {
  const float* s = b.s + i * kKeyBlock;
  uint16_t* p = b.p + i * kKeyBlock;
  valid = std::min(valid, width);
  b.rescale[i] = b.max[i];
  if (valid <= 0) {
    std::memset(p, 0, width * sizeof(uint16_t));
    b.total[i] = 0.f;
    return;
  }
  const float peak = running_max(s, valid, b.max[i], scale);
  const Vec shift = vset1(-peak), factor = vset1(scale);
  Vec total = vzero();
  int64_t c = 0;
  for (; c + kLanes <= valid; c += kLanes) {
    const Vec e = exp2_for_bf16(vfma(vload(s + c), factor, shift));
    total = vadd(total, e);
    store_p(p + c, e);
  }
  if (c < valid) {
    const Vec e = vkeep_n(exp2_for_bf16(vfma(vload(s + c), factor, shift)), valid - c);
    total = vadd(total, e);
    store_p(p + c, e);
    c += kLanes;
  }
  if (c < width) std::memset(p + c, 0, (width - c) * sizeof(uint16_t));
  b.total[i] = vsum(total);
  b.max[i] = peak;
}

// After every row's softmax_row: each row's factor 2^(old max - new max), 1 where the maximum held, in one
// vector pass instead of a call to exp2 a row; then its sum. Where the old maximum is -inf (no key seen yet, so
// the row's output and sum are still 0) the factor is tiny rather than 0 (exp_ps' clamp), and a row still all
// masked (-inf - -inf: NaN, which vmax turns into its second operand) likewise: 0 times it is 0 all the same.
void softmax_rescale(Block& b) {
  for (int64_t i = 0; i < kTileRows; i += kLanes) {
    const Vec shift = vsub(vload(b.rescale + i), vload(b.max + i));
    const Vec rescale = exp_ps(vmul(vmax(shift, vset1(-200.f)), vset1(static_cast<float>(M_LN2))));
    vstore(b.rescale + i, rescale);
    vstore(b.sum + i, vfma(vload(b.sum + i), rescale, vload(b.total + i)));
  }
}

template <int T>
void pv_blocks(Block& b, const uint16_t* v, int64_t v_block, int64_t key_step, int64_t steps, int64_t dim) {
  for (int64_t col = 0; col < dim / kTileN; col += T)
    pv_tiles<T>(b.p, kKeyBlock * 2, v + (col * v_block + key_step * kTileElems), v_block, steps, b.delta + col * kTileN,
                dim * 4);
}

}  // namespace

void amx_prefill_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t start,
                           double scale, torch::Tensor& out) {
  TORCH_CHECK(amx_ready(), "AMX tile state was refused to this process (arch_prctl)");
  for (const auto* t : {&q, &k, &v})
    TORCH_CHECK(t->dim() == 3 && (t->scalar_type() == torch::kBFloat16 || (t == &q && t->scalar_type() == torch::kFloat)) &&
                    t->stride(2) == 1 && t->stride(1) == t->size(2),
                "q (fp32 or bf16), k and v (bf16) must be [tokens, heads, dim] with contiguous heads");
  const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k.size(1), keys = k.size(0);
  TORCH_CHECK(dim % kTileK == 0 && dim <= kMaxDim, "head_dim must be a multiple of 32, at most 128");
  TORCH_CHECK(v.sizes() == k.sizes() && k.size(2) == dim && heads % kv_heads == 0, "k and v must match q's heads");
  TORCH_CHECK(start >= 0 && keys == start + n, "the context must hold start + the chunk's tokens");
  TORCH_CHECK(out.sizes() == q.sizes() && out.stride(2) == 1 && out.stride(1) == dim &&
              (out.scalar_type() == torch::kFloat || out.scalar_type() == torch::kBFloat16), "out must be like q, fp32 or bf16");
  if (n == 0) return;
  const int64_t padded = (keys + kKeyBlock - 1) / kKeyBlock * kKeyBlock, group = heads / kv_heads;
  auto packed = torch::empty({2, kv_heads, padded * dim}, k.options());
  auto* kp = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  uint16_t* vp = kp + kv_heads * padded * dim;
  const auto* kin = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const auto* vin = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  at::parallel_for(0, 2 * kv_heads, 1, [&](int64_t first, int64_t last) {
    for (int64_t job = first; job < last; ++job) {
      const int64_t g = job % kv_heads;
      if (job < kv_heads) pack_keys(kin + g * dim, k.stride(0), keys, padded, dim, kp + g * padded * dim);
      else pack_values(vin + g * dim, v.stride(0), keys, padded, dim, vp + g * padded * dim);
    }
  });

  const bool q_fp32 = q.scalar_type() == torch::kFloat;  // rounded to bf16 as each block takes its rows
  const auto* qin = q_fp32 ? nullptr : reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const float* qin_fp32 = q_fp32 ? q.data_ptr<float>() : nullptr;
  const bool bf16_out = out.scalar_type() == torch::kBFloat16;
  float* out_fp32 = bf16_out ? nullptr : out.data_ptr<float>();
  auto* out_bf16 = bf16_out ? reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) : nullptr;
  const float scale2 = static_cast<float>(scale * M_LOG2E);
  const int64_t blocks = (n + kTileRows - 1) / kTileRows, items = blocks * heads, v_block = padded * kTileRows;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), items);
  // Item i is (query block i / heads, head i % heads): later blocks see more keys, so each thread
  // takes every threads-th item rather than a contiguous run.
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    auto block = std::make_unique<Block>();
    Block& b = *block;
    configure_tiles({});
    for (int64_t t = first; t < last; ++t)
      for (int64_t item = t; item < items; item += threads) {
        const int64_t row0 = item / heads * kTileRows, h = item % heads, g = h / group;
        const int64_t rows = std::min(kTileRows, n - row0);
        for (int64_t i = 0; i < kTileRows; ++i) {
          uint16_t* dst = b.q + i * dim;
          const int64_t from = (row0 + i) * q.stride(0) + h * dim;
          if (i >= rows) std::memset(dst, 0, dim * 2);
          else if (q_fp32) for (int64_t c = 0; c < dim; c += kLanes) vstore_bf16(dst + c, vload(qin_fp32 + from + c));
          else std::memcpy(dst, qin + from, dim * 2);
          b.max[i] = -std::numeric_limits<float>::infinity();
          b.sum[i] = 0.f;
        }
        std::fill(b.o, b.o + kTileRows * dim, 0.f);
        const int64_t seen = start + row0 + rows;  // keys the block's last query sees
        const uint16_t* kg = kp + g * padded * dim;
        const uint16_t* vg = vp + g * padded * dim;
        for (int64_t key0 = 0; key0 < seen; key0 += kKeyBlock) {
          const int64_t width = std::min(kKeyBlock, seen - key0);
          for (int64_t j = 0; j < width; j += kTileN)
            score_tile(b.q, dim, kg + (key0 + j) / kTileN * (dim / kTileK) * kTileElems, b.s + j, kKeyBlock * 4);
          const int64_t steps = (width + kTileK - 1) / kTileK;
          for (int64_t i = 0; i < kTileRows; ++i)
            softmax_row(b, i, std::min(start + row0 + i + 1, seen) - key0, steps * kTileK, scale2);
          softmax_rescale(b);
          if (dim % (kTileN * kMaxColTiles) == 0) pv_blocks<kMaxColTiles>(b, vg, v_block, key0 / kTileK, steps, dim);
          else pv_blocks<2>(b, vg, v_block, key0 / kTileK, steps, dim);
          for (int64_t i = 0; i < kTileRows; ++i) {
            const Vec shrink = vset1(b.rescale[i]);
            float* o = b.o + i * dim;
            const float* d = b.delta + i * dim;
            for (int64_t c = 0; c < dim; c += kLanes) vstore(o + c, vfma(vload(o + c), shrink, vload(d + c)));
          }
        }
        for (int64_t i = 0; i < rows; ++i) {
          const Vec inverse = vset1(1.f / b.sum[i]);
          const int64_t offset = (row0 + i) * out.stride(0) + h * dim;
          for (int64_t c = 0; c < dim; c += kLanes) {
            const Vec r = vmul(vload(b.o + i * dim + c), inverse);
            if (bf16_out) vstore_bf16(out_bf16 + offset + c, r);
            else vstore(out_fp32 + offset + c, r);
          }
        }
      }
    release_tiles();
  });
}
