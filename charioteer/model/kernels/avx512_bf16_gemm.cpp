// bf16 GEMMs of up to a few hundred rows with AVX512-BF16's vdpbf16ps, for CPUs that have it but no
// AMX tiles (AMD Zen 4, Intel Cooper Lake).
//
// Each vdpbf16ps multiplies 16 pairs of bf16 and adds both products into 16 fp32 sums: twice the
// products of an fp32 FMA. The weight is the one amx_pack writes: per 16 columns and k-pair, one
// 64-byte row holding each column's two k side by side, which is the vector vdpbf16ps takes. A pair of
// column blocks (32 columns) runs blocks of kRows rows of x over the whole of K: the first block
// streams the pair's weight from memory, the later ones find it in L2 (software prefetches 4-16
// k-steps ahead, to L1 or L2, were no faster than the hardware's on a Zen 4). Each x pair is
// broadcast to every lane. Where only this instruction set has bf16 arithmetic, oneDNN's bf16 GEMM
// (also vdpbf16ps) pays a per-call cost that decode-sized batches feel: on a Zen 4, 2 threads,
// SmolLM2's 30 layers at 16 rows took 20.5 ms through oneDNN against 30 in the panel kernel with
// the weight widened to fp32; see llama.AVX512_BF16_MAX_ROWS for this kernel's.
//
// int8 weights (avx512_bf16_linear_int8) come in the panel kernel's 32-column panels, as for
// amx_linear_int8: each panel is widened to bf16 in amx_pack's order once per call (widen_int8_steps,
// exact), into a buffer that stays in L2 while every row block reads it, then summed as above and scaled
// per column. One row's widening costs as much as its product, so the model takes it from 8 rows (1.0-1.1x
// the panel kernel there, 1.6-2.1x from 12 rows on a Zen 4: llama.INT8_TILE_MIN_ROWS).
//
// Every output is its own row of x times its column, summed over k in order (two products per
// step, as the instruction adds them), whatever the other rows of the batch: a row's result does
// not depend on them. Built into the AVX-512 build only (the functions carry AVX512-BF16's target
// attribute); the caller checks the CPU first (cpu_kernels.avx512_bf16_unavailable_reason).
#include "kernels.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include "amx_tiles.h"  // the sizes of amx_pack's layout
#include "vec_math.h"

namespace {

// 16 int8 -> 16 fp32.
__attribute__((target("avx512f"))) inline __m512 widen_16(const int8_t* at) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at))));
}

// Rows k and k + 1 of 16 columns as one bf16 B tile row: each column's pair side by side. Exact for
// int8 values.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline void store_pairs(uint16_t* dst, __m512 k0, __m512 k1) {
  // word i of cvtne2ps2bf16(k1, k0) is column i of k0 (i < 16), column i - 16 of k1
  alignas(64) static const uint16_t kPairs[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                  8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(k1, k0));
  _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(_mm512_load_si512(kPairs), both));
}

// k-steps t0 .. t1 - 1 of one 32-column int8 panel ([k][32], k rows) -> its two column blocks' bf16
// B tiles, step t's at block0 and block1 + (t - t0) tiles, zero past k: tile row r of step t holds
// k = 32t + 2r and + 1 of each column.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void widen_int8_steps(const int8_t* panel, int64_t k,
                                                                              int64_t t0, int64_t t1, uint16_t* block0,
                                                                              uint16_t* block1) {
  constexpr int64_t kAhead = 4096;  // bytes of the panel prefetched ahead (from memory, one stream)
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t kk = t0 * kTileK; kk < t1 * kTileK; kk += 2) {
    const int64_t row = (kk / kTileK - t0) * kTileElems + (kk % kTileK) / 2 * kTileK;  // where k = kk's pair goes
    const int8_t* at = panel + kk * kPairCols;
    if (kk + 1 < k) {
      _mm_prefetch(reinterpret_cast<const char*>(at) + kAhead, _MM_HINT_T0);
      store_pairs(block0 + row, widen_16(at), widen_16(at + kPairCols));
      store_pairs(block1 + row, widen_16(at + kTileN), widen_16(at + kPairCols + kTileN));
    } else {  // the last odd k, then zeros
      store_pairs(block0 + row, kk < k ? widen_16(at) : zero, zero);
      store_pairs(block1 + row, kk < k ? widen_16(at + kTileN) : zero, zero);
    }
  }
}

// The int8 GEMM's inputs, checked: x rounded to bf16 as tile_input lays it out, the scales contiguous, the
// fp32 output [M, n], and the sizes.
struct Int8Gemm {
  torch::Tensor a, scales, out;
  int64_t m, k, kb, nb;  // x's rows and columns, K's 32-value steps, n's 16-column blocks
};

Int8Gemm int8_gemm(const char* name, const torch::Tensor& x, const torch::Tensor& panels, int64_t n,
                   const torch::Tensor& scale) {
  check_int8_panels(name, x, panels, n, scale);
  const int64_t m = x.size(0), k = x.size(1), kb = (k + kTileK - 1) / kTileK;
  return {tile_input(x, kb), scale.contiguous(), torch::empty({m, n}, x.options()), m, k, kb,
          (n + kTileN - 1) / kTileN};
}

constexpr int64_t kRows = 8;                   // rows of x per block: 8 x 2 accumulators
constexpr int64_t kPairs = kTileK / 2;         // k-pairs per k-step of the packed weight (16)

// Rows [0, R) of x (bf16, K padded to kb k-steps, rows lda elements apart) times CT column blocks of
// the packed weight (b0, and b1 when CT is 2) over every k-step, into c (fp32 or, with bf16 output,
// rounded), rows ldc elements apart, `cols` valid columns from c.
template <int R, int CT>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void block(const uint16_t* a, int64_t lda, const uint16_t* b0,
                                                                 const uint16_t* b1, int64_t kb, float* c,
                                                                 uint16_t* c_bf16, int64_t ldc, int64_t cols) {
  __m512 acc[R][CT];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < CT; ++v) acc[r][v] = _mm512_setzero_ps();
  const uint16_t* b[2] = {b0, b1};
  for (int64_t t = 0; t < kb; ++t) {
    for (int64_t p = 0; p < kPairs; ++p) {
      __m512bh w[CT];
      for (int v = 0; v < CT; ++v) w[v] = (__m512bh)_mm512_loadu_si512(b[v] + (t * kPairs + p) * kTileK);
      const int64_t k = t * kTileK + 2 * p;
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        __builtin_memcpy(&pair, a + r * lda + k, sizeof(pair));
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
        for (int v = 0; v < CT; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xb, w[v]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < CT; ++v) {
      const int64_t left = cols - v * kTileN;
      if (c_bf16 != nullptr) {
        alignas(64) uint16_t rounded[kTileN];
        vstore_bf16(rounded, acc[r][v]);
        std::copy(rounded, rounded + std::min<int64_t>(left, kTileN), c_bf16 + r * ldc + v * kTileN);
      } else {
        vstore_n(c + r * ldc + v * kTileN, acc[r][v], left);
      }
    }
}

template <int CT>
using Block = void (*)(const uint16_t*, int64_t, const uint16_t*, const uint16_t*, int64_t, float*, uint16_t*,
                       int64_t, int64_t);

template <int CT, int... R>
constexpr std::array<Block<CT>, sizeof...(R) + 1> blocks(std::integer_sequence<int, R...>) {
  return {nullptr, block<R + 1, CT>...};
}
template <int CT>
constexpr auto kBlocks = blocks<CT>(std::make_integer_sequence<int, kRows>());

}  // namespace

namespace {

// Every row block of x (bf16, K padded to kb k-steps) on each pair of column blocks in turn, into out
// (fp32, or bf16 with out_bf16): pair_weight(pair) gives the pair's two blocks of bf16 weight in
// amx_pack's order (the second nullptr past the last), and done(r0, rows, col0, cols) follows each block.
template <typename PairWeight, typename Done>
void run_pairs(const uint16_t* xs, int64_t lda, int64_t m, int64_t n, int64_t nb, int64_t kb, float* out_fp32,
               uint16_t* out_bf16, const PairWeight& pair_weight, const Done& done) {
  parallel_split((nb + 1) / 2, [&](int64_t first, int64_t last) {
    for (int64_t pair = first; pair < last; ++pair) {
      const int64_t col0 = 2 * pair * kTileN, cols = std::min(n - col0, kPairCols);
      const auto [b0, b1] = pair_weight(pair);
      for (int64_t r0 = 0; r0 < m; r0 += kRows) {
        const int64_t rows = std::min(kRows, m - r0);
        float* c = out_fp32 != nullptr ? out_fp32 + r0 * n + col0 : nullptr;
        uint16_t* c_bf16 = out_bf16 != nullptr ? out_bf16 + r0 * n + col0 : nullptr;
        if (b1 != nullptr) {
          kBlocks<2>[rows](xs + r0 * lda, lda, b0, b1, kb, c, c_bf16, n, cols);
        } else {
          kBlocks<1>[rows](xs + r0 * lda, lda, b0, nullptr, kb, c, c_bf16, n, cols);
        }
        done(r0, rows, col0, cols);
      }
    }
  });
}

}  // namespace

void avx512_bf16_linear_into(const torch::Tensor& x, const torch::Tensor& packed, int64_t n, bool bf16_output,
                             const torch::Tensor& result) {
  check_tile_gemm("avx512_bf16_linear", x, packed, n);
  check_output("avx512_bf16_linear", result, {x.size(0), n},
               x.options().dtype(bf16_output ? torch::kBFloat16 : torch::kFloat), x);
  const int64_t m = x.size(0), nb = packed.size(0), kb = packed.size(1);
  if (m == 0) return;
  const auto [a, lda] = tile_rows(x, kb);
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  run_pairs(a, lda, m, n, nb, kb, bf16_output ? nullptr : result.data_ptr<float>(),
            bf16_output ? reinterpret_cast<uint16_t*>(result.data_ptr()) : nullptr,
            [&](int64_t pair) {
              const uint16_t* b0 = w + 2 * pair * kb * kTileElems;
              return std::pair(b0, 2 * pair + 1 < nb ? b0 + kb * kTileElems : nullptr);
            },
            [](int64_t, int64_t, int64_t, int64_t) {});
}

torch::Tensor avx512_bf16_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n, bool bf16_output,
                                 const c10::optional<torch::Tensor>& out) {
  auto result = tile_gemm_output("avx512_bf16_linear", x, packed, n, bf16_output, out);
  avx512_bf16_linear_into(x, packed, n, bf16_output, result);
  return result;
}

torch::Tensor avx512_bf16_linear_int8(const torch::Tensor& x, const torch::Tensor& panels, int64_t n,
                                      const torch::Tensor& scale) {
  const auto g = int8_gemm("avx512_bf16_linear_int8", x, panels, n, scale);
  if (g.m == 0) return g.out;
  const int64_t k = g.k, kb = g.kb, nb = g.nb;
  const float* sw = g.scales.data_ptr<float>();
  float* y = g.out.data_ptr<float>();
  const auto* q = static_cast<const int8_t*>(panels.data_ptr());
  run_pairs(reinterpret_cast<const uint16_t*>(g.a.data_ptr()), g.a.stride(0), g.m, n, nb, kb, y, nullptr,
            [&](int64_t pair) {  // the panel widened once, for every row block (in L2: 2 KB per 32 k)
              thread_local std::vector<uint16_t> widened;
              if (static_cast<int64_t>(widened.size()) < 2 * kb * kTileElems) widened.resize(2 * kb * kTileElems);
              uint16_t* b0 = widened.data();
              widen_int8_steps(q + pair * k * kPairCols, k, 0, kb, b0, b0 + kb * kTileElems);
              return std::pair<const uint16_t*, const uint16_t*>(b0, 2 * pair + 1 < nb ? b0 + kb * kTileElems
                                                                                       : nullptr);
            },
            [&](int64_t r0, int64_t rows, int64_t col0, int64_t cols) {
              for (int64_t r = r0; r < r0 + rows; ++r)
                for (int64_t c = col0; c < col0 + cols; ++c) y[r * n + c] *= sw[c];
            });
  return g.out;
}

#else

void avx512_bf16_linear_into(const torch::Tensor&, const torch::Tensor&, int64_t, bool, const torch::Tensor&) {
  TORCH_CHECK(false, "avx512_bf16_linear is in the avx512 build only (cpu_kernels.avx512_bf16_unavailable_reason)");
}

torch::Tensor avx512_bf16_linear(const torch::Tensor&, const torch::Tensor&, int64_t, bool,
                                 const c10::optional<torch::Tensor>&) {
  TORCH_CHECK(false, "avx512_bf16_linear is in the avx512 build only (cpu_kernels.avx512_bf16_unavailable_reason)");
}

torch::Tensor avx512_bf16_linear_int8(const torch::Tensor&, const torch::Tensor&, int64_t, const torch::Tensor&) {
  TORCH_CHECK(false, "avx512_bf16_linear_int8 is in the avx512 build only (cpu_kernels.avx512_bf16_unavailable_reason)");
}

#endif
