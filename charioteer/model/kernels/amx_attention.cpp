// A prompt chunk's attention on AMX tiles (flash attention: one pass over the keys, softmax online).
//
// Query i of the chunk sits at position start + i and sees keys 0 .. start + i. torch's SDPA on
// the CPU takes such a chunk only with an explicit mask, computes every masked score, and its
// causal mode skips little; at SmolLM2's shapes inside a serving step it ran 0.7 G query-key pairs
// a second. Here each block of 16 queries of one head reads only the keys it sees, 256 at a time:
// S = Q K^T on tiles, the softmax in fp32 vectors, P rounded to bf16, and P V back on tiles. K and V
// of each KV head are first laid out in the order the B tiles read them (K transposed 16 x 16 dwords at
// a time, V's key pairs interleaved), so the query heads of a group share that copy. Where the KV heads
// divide among the threads, each thread lays out one head at a time into its own buffer and runs all
// of that head's query blocks from L2; else every head is laid out first and the items are striped.
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
#include <vector>

namespace {

constexpr int64_t kKeyBlock = 256;  // keys per softmax step (128: 512 queries at 512 1.10x slower, others 0.97-1.07x)
constexpr int64_t kMaxDim = 128;
constexpr int64_t kMaxColTiles = 4;  // C tiles 0-3 take P V, 16 output columns each; 4 is S, 5 an A tile, 6 a B tile

#define PACK_TARGET __attribute__((target("avx512f,avx512bw")))

// The 16 x 16 dwords at r[0..15] transposed in place: r[i] lane j <- r[j] lane i.
PACK_TARGET inline void transpose_16x16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8)
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
}

// One KV head's K [keys, dim] as S = Q K^T's B tiles: [key/16][dim/32][16 rows][16 keys x 2 dims],
// padded with zero keys to `padded`: each tile the transpose of 16 keys' dwords.
PACK_TARGET void pack_keys(const uint16_t* k, int64_t stride, int64_t keys, int64_t padded, int64_t dim, uint16_t* dst) {
  const int64_t steps = dim / kTileK;
  for (int64_t block = 0; block < padded / kTileN; ++block)
    for (int64_t step = 0; step < steps; ++step) {
      __m512i r[16];
      for (int64_t key = 0; key < kTileN; ++key) {
        const int64_t index = block * kTileN + key;
        r[key] = index < keys ? _mm512_loadu_si512(k + index * stride + step * kTileK) : _mm512_setzero_si512();
      }
      transpose_16x16(r);
      uint16_t* tile = dst + (block * steps + step) * kTileElems;
      for (int64_t row = 0; row < kTileRows; ++row) _mm512_store_si512(tile + row * kTileK, r[row]);
    }
}

// One KV head's V [keys, dim] as P V's B tiles: [dim/16][key/32][16 rows][16 dims x 2 keys], padded
// with zero keys (P is 0 there, and 0 * garbage could be NaN): each tile row two keys' 16 dims interleaved.
PACK_TARGET void pack_values(const uint16_t* v, int64_t stride, int64_t keys, int64_t padded, int64_t dim, uint16_t* dst) {
  alignas(64) static const uint16_t kLow[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i low = _mm512_load_si512(kLow), high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  const int64_t steps = padded / kTileK;
  for (int64_t step = 0; step < steps; ++step)
    for (int64_t r = 0; r < kTileRows; ++r) {
      const int64_t first = step * kTileK + 2 * r;
      for (int64_t col = 0; col < dim; col += kTileK) {
        const __m512i even = first < keys ? _mm512_loadu_si512(v + first * stride + col) : _mm512_setzero_si512();
        const __m512i odd = first + 1 < keys ? _mm512_loadu_si512(v + (first + 1) * stride + col) : _mm512_setzero_si512();
        uint16_t* row = dst + ((col / kTileN * steps + step) * kTileRows + r) * kTileK;
        _mm512_store_si512(row, _mm512_permutex2var_epi16(even, low, odd));
        _mm512_store_si512(row + steps * kTileElems, _mm512_permutex2var_epi16(even, high, odd));
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

// The chunk's queries and output as attend_block reads and writes them.
struct Chunk {
  const uint16_t* q_bf16;
  const float* q_fp32;
  int64_t q_stride, n, start, dim, padded;
  float scale2;
  float* out_fp32;
  uint16_t* out_bf16;
  int64_t out_stride;
};

// One item: a block of up to 16 queries (rows row0.. of the chunk) of query head h, against its KV head's
// packed K (kg) and V (vg), into the chunk's output.
void attend_block(Block& b, const Chunk& c, int64_t row0, int64_t h, const uint16_t* kg, const uint16_t* vg) {
  const int64_t dim = c.dim, rows = std::min(kTileRows, c.n - row0), v_block = c.padded * kTileRows;
  for (int64_t i = 0; i < kTileRows; ++i) {
    uint16_t* dst = b.q + i * dim;
    const int64_t from = (row0 + i) * c.q_stride + h * dim;
    if (i >= rows) std::memset(dst, 0, dim * 2);
    else if (c.q_fp32) for (int64_t col = 0; col < dim; col += kLanes) vstore_bf16(dst + col, vload(c.q_fp32 + from + col));
    else std::memcpy(dst, c.q_bf16 + from, dim * 2);
    b.max[i] = -std::numeric_limits<float>::infinity();
    b.sum[i] = 0.f;
  }
  std::fill(b.o, b.o + kTileRows * dim, 0.f);
  const int64_t seen = c.start + row0 + rows;  // keys the block's last query sees
  for (int64_t key0 = 0; key0 < seen; key0 += kKeyBlock) {
    const int64_t width = std::min(kKeyBlock, seen - key0);
    for (int64_t j = 0; j < width; j += kTileN)
      score_tile(b.q, dim, kg + (key0 + j) / kTileN * (dim / kTileK) * kTileElems, b.s + j, kKeyBlock * 4);
    const int64_t steps = (width + kTileK - 1) / kTileK;
    for (int64_t i = 0; i < kTileRows; ++i)
      softmax_row(b, i, std::min(c.start + row0 + i + 1, seen) - key0, steps * kTileK, c.scale2);
    softmax_rescale(b);
    if (dim % (kTileN * kMaxColTiles) == 0) pv_blocks<kMaxColTiles>(b, vg, v_block, key0 / kTileK, steps, dim);
    else pv_blocks<2>(b, vg, v_block, key0 / kTileK, steps, dim);
    for (int64_t i = 0; i < kTileRows; ++i) {
      const Vec shrink = vset1(b.rescale[i]);
      float* o = b.o + i * dim;
      const float* d = b.delta + i * dim;
      for (int64_t col = 0; col < dim; col += kLanes) vstore(o + col, vfma(vload(o + col), shrink, vload(d + col)));
    }
  }
  for (int64_t i = 0; i < rows; ++i) {
    const Vec inverse = vset1(1.f / b.sum[i]);
    const int64_t offset = (row0 + i) * c.out_stride + h * dim;
    for (int64_t col = 0; col < dim; col += kLanes) {
      const Vec r = vmul(vload(b.o + i * dim + col), inverse);
      if (c.out_bf16) vstore_bf16(c.out_bf16 + offset + col, r);
      else vstore(c.out_fp32 + offset + col, r);
    }
  }
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
  const int64_t padded = (keys + kKeyBlock - 1) / kKeyBlock * kKeyBlock, group = heads / kv_heads, head_elems = padded * dim;
  const bool q_fp32 = q.scalar_type() == torch::kFloat, bf16_out = out.scalar_type() == torch::kBFloat16;
  const Chunk chunk{q_fp32 ? nullptr : reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()),
                    q_fp32 ? q.data_ptr<float>() : nullptr, q.stride(0), n, start, dim, padded,
                    static_cast<float>(scale * M_LOG2E), bf16_out ? nullptr : out.data_ptr<float>(),
                    bf16_out ? reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) : nullptr, out.stride(0)};
  const auto* kin = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const auto* vin = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  const int64_t threads = at::get_num_threads();
  if (kv_heads % threads == 0) {
    // Each thread packs its KV heads one at a time into its own buffer, which stays in L2 while every
    // query block of the head's group reads it: with packed heads shared, a thread's consecutive items
    // read different heads' copies from memory (LLaMA-7B's 32 heads: 16.8 MB for 1024 keys).
    at::parallel_for(0, kv_heads, 1, [&](int64_t first, int64_t last) {
      thread_local std::vector<char> buffer;
      uint16_t* const kp = aligned_buffer<uint16_t>(buffer, 2 * head_elems);
      auto block = std::make_unique<Block>();
      configure_tiles({});
      for (int64_t g = first; g < last; ++g) {
        pack_keys(kin + g * dim, k.stride(0), keys, padded, dim, kp);
        pack_values(vin + g * dim, v.stride(0), keys, padded, dim, kp + head_elems);
        for (int64_t h = g * group; h < (g + 1) * group; ++h)
          for (int64_t row0 = 0; row0 < n; row0 += kTileRows) attend_block(*block, chunk, row0, h, kp, kp + head_elems);
      }
      release_tiles();
    });
    return;
  }
  // Fewer KV heads than threads, or not a multiple: every head packed once, then (query block, head)
  // items striped over the threads (later blocks see more keys), the query heads of a group sharing a copy.
  thread_local std::vector<char> shared;
  uint16_t* const kp = aligned_buffer<uint16_t>(shared, 2 * kv_heads * head_elems);
  uint16_t* const vp = kp + kv_heads * head_elems;
  at::parallel_for(0, 2 * kv_heads, 1, [&](int64_t first, int64_t last) {
    for (int64_t job = first; job < last; ++job) {
      const int64_t g = job % kv_heads;
      if (job < kv_heads) pack_keys(kin + g * dim, k.stride(0), keys, padded, dim, kp + g * head_elems);
      else pack_values(vin + g * dim, v.stride(0), keys, padded, dim, vp + g * head_elems);
    }
  });
  const int64_t items = (n + kTileRows - 1) / kTileRows * heads, workers = std::min(threads, items);
  at::parallel_for(0, workers, 1, [&](int64_t first, int64_t last) {
    auto block = std::make_unique<Block>();
    configure_tiles({});
    for (int64_t t = first; t < last; ++t)
      for (int64_t item = t; item < items; item += workers) {
        const int64_t h = item % heads, g = h / group;
        attend_block(*block, chunk, item / heads * kTileRows, h, kp + g * head_elems, vp + g * head_elems);
      }
    release_tiles();
  });
}
