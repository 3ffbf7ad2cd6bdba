// Decode-sized GEMMs on int8 weights with AVX512-VNNI's vpdpwssd, for the rows below the tile kernels'
// (llama.INT8_TILE_MIN_ROWS): one request's decode step, above all.
//
// The panel kernel widens each int8 weight to fp32 (two instructions per 16 weights) for one FMA, so
// from a few rows on, or with the weights in cache, it is bound by that widening (at one row from
// memory, memory bounds both on a Zen 4: BENCHMARKS.md). Here x is quantized instead: each row's
// every block of kBlockK values to int16 with its own scale (its largest magnitude over 32767, so a
// value is off by at most 1/65534 of its block's largest: a thousand times finer than bf16's
// rounding for values near the largest, and blocks keep one outlier from coarsening a whole row).
// Weights are sign-extended to int16, two k rows interleaved per column, and vpdpwssd adds both
// products of a column's k pair into an int32 sum: 32 weights in three instructions. Sums are exact
// within a block (at most 128 * 32767 * 128 < 2^31), turned into fp32 there, scaled by the block's
// scale and added up block after block in k order, then times the column's scale.
//
// The weight is the panel kernel's ([N/32][K][32] int8, cpu_kernels.pack), so the model keeps one copy.
// A row's result depends on its own row of x alone. In the AVX-512 build only (the functions carry
// AVX512-VNNI's target attribute); the caller checks the CPU first (cpu_kernels.vnni_unavailable_reason).
#include "kernels.h"
#include "vec_math.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// The largest |x[i]| of n values (0 for none).
inline float largest_magnitude(const float* x, int64_t n) {
  Vec top = vzero();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Vec v = vload(x + i);
    top = vmax(vmax(v, vsub(vzero(), v)), top);
  }
  float largest = vmax_of(top);
  for (; i < n; ++i) largest = std::max(largest, std::fabs(x[i]));
  return largest;
}

// q[i] = x[i] * inv rounded to the nearest integer (ties to even, as nearbyint) and held to +-limit (32767 for
// int16 q, 127 for int8), in vectors; with `sums`, sums[h] = the sum of q over values [h * part, (h + 1) * part)
// (part a multiple of kLanes) times `scale`. The rounded values are whole numbers in fp32, and a part's sum of at
// most 32 of them is below 2^24, so it is summed exactly in the vectors: the integer sum's float.
template <typename Q>
inline void quantize_values(const float* x, int64_t n, float inv, Q* q, float* sums = nullptr, int64_t part = 1,
                            float scale = 0.f) {
  constexpr float limit = std::is_same_v<Q, int16_t> ? 32767.f : 127.f;
  const Vec times = vset1(inv), low = vset1(-limit), high = vset1(limit);
  Vec total = vzero();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Vec v = vmin(vmax(vround(vmul(vload(x + i), times)), low), high);
    total = vadd(total, v);
    if (sums != nullptr && (i + kLanes) % part == 0) {
      sums[i / part] = vsum(total) * scale;
      total = vzero();
    }
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<Q, int16_t>)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(v)));
    else
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)));
#else
    const __m256i w = _mm256_cvtps_epi32(v);
    const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
    if constexpr (std::is_same_v<Q, int16_t>) _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), words);
    else _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), _mm_packs_epi16(words, words));
#endif
  }
  float rest = sums != nullptr ? vsum(total) : 0.f;  // a part cut short by n (whole numbers, exact)
  for (; i < n; ++i) {
    q[i] = static_cast<Q>(std::clamp(std::nearbyint(x[i] * inv), -limit, limit));
    rest += q[i];
  }
  if (sums != nullptr && n % part != 0) sums[n / part] = rest * scale;
}

// quantize_values on a row's int16 pairs or int8 quads (`bytes`), from value k0.
inline void quantize_any(const float* x, int64_t n, float inv, int32_t* row, int64_t k0, bool bytes,
                         float* sums = nullptr, int64_t part = 1, float scale = 0.f) {
  if (bytes) quantize_values(x, n, inv, reinterpret_cast<int8_t*>(row) + k0, sums, part, scale);
  else quantize_values(x, n, inv, reinterpret_cast<int16_t*>(row) + k0, sums, part, scale);
}

}  // namespace

QuantizedRows quantized_rows_buffers(int64_t m, int64_t kp, int64_t blocks, int64_t sums) {
  thread_local std::vector<int32_t> pairs;
  thread_local std::vector<float> scales, block_sums;
  pairs.resize(std::max<size_t>(pairs.size(), m * kp));
  scales.resize(std::max<size_t>(scales.size(), m * blocks));
  block_sums.resize(std::max<size_t>(block_sums.size(), m * sums));
  return {pairs.data(), scales.data(), sums ? block_sums.data() : nullptr};
}

// x [m, k] -> int16 pairs, [m][kp] int32 each holding (x[2j], x[2j+1]) (kp = ceil(k/2), zero padded), or with
// `bytes` int8 quads, [m][kq] int32 each holding x[4j] to x[4j+3] (kq = ceil(k/4)); one fp32 scale per row and
// block of `block` values ([m][blocks]: its largest magnitude / 32767, or / 127) and, where `sums` is given, the
// sum of the quantized x over each of a block's `sum_parts` parts (the exact integer sum times the scale, as
// llama.cpp's Q8_1 keeps it: a GGUF weight's offset m then multiplies x's rounding no more than its d * q terms
// do, where m times the sum of x itself left the offset's share of the rounding in, 2-3x the product's error
// on SmolLM2's Q4_1 layers, at int8 and int16 alike). Rows in parallel once there are 16K values (a prompt
// chunk's: one thread took a fifth of a 512-row GGUF GEMM's time quantizing); each value's bits as the scalar
// formula's.
void quantize_rows(const float* x, int64_t ldx, int64_t m, int64_t k, int64_t block, int32_t* pairs, float* scales,
                   float* sums, int64_t sum_parts, bool bytes) {
  const int64_t width = bytes ? 4 : 2, stride = (k + width - 1) / width, part = block / sum_parts;
  const int64_t blocks = (k + block - 1) / block;
  const float levels = bytes ? 127.f : 32767.f;
  TORCH_CHECK(sum_parts > 0 && block % sum_parts == 0 && (!sums || part % kLanes == 0),
              "quantize_rows: a block splits into equal sum parts of whole vectors");
  at::parallel_for(0, m, std::max<int64_t>(1, 16384 / std::max<int64_t>(k, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = x + r * ldx;
      pairs[(r + 1) * stride - 1] = 0;  // k short of the last pair or quad: zero values
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t k0 = b * block, k1 = std::min(k, k0 + block);
        const float top = largest_magnitude(row + k0, k1 - k0);
        const float inv = top > 0.f ? levels / top : 0.f, scale = top / levels;
        scales[r * blocks + b] = scale;
        int32_t* quantized = pairs + r * stride;
        float* block_sums = sums ? sums + (r * blocks + b) * sum_parts : nullptr;
        quantize_any(row + k0, k1 - k0, inv, quantized, k0, bytes, block_sums, part, scale);
      }
    }
  });
}

#if defined(__AVX512F__)
#include "amx_tiles.h"  // kPairCols: the AVX-512 build's panel width

namespace {

constexpr int64_t kBlockK = 128;  // x values sharing one int16 scale; a block's int32 sums cannot overflow
constexpr int64_t kMaxRows = 8;   // rows per pass over a panel: 8 x 2 int32 sums in registers

// Column c of a panel's 32 sits in lane kLane[c] of the two sums (0-15 the first, 16-31 the second):
// unpacking two k rows' int16 interleaves within each 128-bit lane, so a sum holds columns 8L + 0..3
// (first) or 8L + 4..7 (second) in its lanes 4L .. 4L + 3.
constexpr std::array<int, 32> column_lanes() {
  std::array<int, 32> lanes{};
  for (int c = 0; c < 32; ++c) lanes[c] = (c % 8 < 4 ? 0 : 16) + 4 * (c / 8) + c % 4;
  return lanes;
}
constexpr auto kLane = column_lanes();

// Rows [0, R) of x times one 32-column panel over all of k, into y's first `cols` columns (times `wscale`).
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void panel_rows(const int32_t* pairs, int64_t kp,
                                                                       const float* xscale, int64_t blocks,
                                                                       const int8_t* panel, int64_t k, bool stream,
                                                                       const float* wscale, float* y, int64_t ldy,
                                                                       int64_t cols) {
  __m512 total[R][2];
  for (int r = 0; r < R; ++r) total[r][0] = total[r][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i sum[R][2];
    for (int r = 0; r < R; ++r) sum[r][0] = sum[r][1] = _mm512_setzero_si512();
    const int64_t p0 = b * kBlockK / 2, p1 = std::min(kp, p0 + kBlockK / 2);
    for (int64_t p = p0; p < p1; ++p) {
      const int8_t* rows = panel + 2 * p * kPairCols;  // k rows 2p and 2p + 1, 32 bytes each
      if (stream) prefetch_ahead(rows);  // the first row block reads the panel from memory
      const __m512i even = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows)));
      const __m512i odd = 2 * p + 1 < k
          ? _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows + kPairCols)))
          : _mm512_setzero_si512();
      const __m512i lo = _mm512_unpacklo_epi16(even, odd), hi = _mm512_unpackhi_epi16(even, odd);
      for (int r = 0; r < R; ++r) {
        const __m512i xb = _mm512_set1_epi32(pairs[r * kp + p]);
        sum[r][0] = _mm512_dpwssd_epi32(sum[r][0], xb, lo);
        sum[r][1] = _mm512_dpwssd_epi32(sum[r][1], xb, hi);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_set1_ps(xscale[r * blocks + b]);
      for (int v = 0; v < 2; ++v) total[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r][v]), s, total[r][v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(64) float lanes[32];
    _mm512_store_ps(lanes, total[r][0]);
    _mm512_store_ps(lanes + 16, total[r][1]);
    for (int64_t c = 0; c < cols; ++c) y[r * ldy + c] = lanes[kLane[c]] * wscale[c];
  }
}

using PanelRows = void (*)(const int32_t*, int64_t, const float*, int64_t, const int8_t*, int64_t, bool, const float*,
                           float*, int64_t, int64_t);

template <int... R>
constexpr std::array<PanelRows, sizeof...(R) + 1> panel_rows_by_count(std::integer_sequence<int, R...>) {
  return {nullptr, panel_rows<R + 1>...};
}
constexpr auto kPanelRows = panel_rows_by_count(std::make_integer_sequence<int, kMaxRows>());

}  // namespace

void vnni_linear_int8_into(const torch::Tensor& x, const torch::Tensor& panels, int64_t n, const torch::Tensor& scale,
                          const torch::Tensor& y) {
  check_int8_panels("vnni_linear_int8", x, panels, n, scale);
  const int64_t m = x.size(0), k = x.size(1), kp = (k + 1) / 2, blocks = (k + kBlockK - 1) / kBlockK;
  check_output("vnni_linear_int8", y, {m, n}, x.options(), x, panels, scale);
  if (m == 0) return;
  const QuantizedRows quantized = quantized_rows_buffers(m, kp, blocks, 0);
  const auto xc = with_rows(x);
  quantize_rows(xc->data_ptr<float>(), xc->stride(0), m, k, kBlockK, quantized.pairs, quantized.scales, nullptr);
  const auto sc = scale.expect_contiguous();
  const int32_t* pp = quantized.pairs;
  const float* xs = quantized.scales;
  const float* ws = sc->data_ptr<float>();
  const auto* w = panels.data_ptr<int8_t>();
  float* yp = y.data_ptr<float>();
  parallel_split(panels.size(0), [&](int64_t first, int64_t last) {
    for (int64_t j = first; j < last; ++j) {
      const int64_t col0 = j * kPairCols, cols = std::min(n - col0, kPairCols);
      for (int64_t r0 = 0; r0 < m; r0 += kMaxRows) {
        const int64_t rows = std::min(kMaxRows, m - r0);
        kPanelRows[rows](pp + r0 * kp, kp, xs + r0 * blocks, blocks, w + j * k * kPairCols, k, r0 == 0, ws + col0,
                         yp + r0 * n + col0, n, cols);
      }
    }
  });
}

torch::Tensor vnni_linear_int8(const torch::Tensor& x, const torch::Tensor& panels, int64_t n,
                               const torch::Tensor& scale, const c10::optional<torch::Tensor>& out) {
  check_int8_panels("vnni_linear_int8", x, panels, n, scale);
  auto y = given_or_empty(out, {x.size(0), n}, x.options());
  vnni_linear_int8_into(x, panels, n, scale, y);
  return y;
}

#else

void vnni_linear_int8_into(const torch::Tensor&, const torch::Tensor&, int64_t, const torch::Tensor&,
                          const torch::Tensor&) {
  TORCH_CHECK(false, "vnni_linear_int8 is in the avx512 build only (cpu_kernels.vnni_unavailable_reason)");
}

torch::Tensor vnni_linear_int8(const torch::Tensor&, const torch::Tensor&, int64_t, const torch::Tensor&,
                               const c10::optional<torch::Tensor>&) {
  TORCH_CHECK(false, "vnni_linear_int8 is in the avx512 build only (cpu_kernels.vnni_unavailable_reason)");
}

#endif
