// y = x @ w.T for decode-sized batches (up to a few dozen rows), on AVX-512 or AVX2 CPUs.
//
// The weight is repacked once into panels of kPanel output columns, [N/kPanel][K][kPanel], so each
// panel is one contiguous stream. Rows run in blocks of up to kRowBlock: per k, the panel's weight
// vectors are loaded and each row's x[m, k] is broadcast into that row's accumulators. K is walked
// in slices so a panel slice stays in L1 while every row block uses it, and the stream is
// prefetched into L2 ahead of use. Each output is summed over k in order, so a row's result does
// not depend on the other rows in the batch (nor on the row blocking).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "kernels.h"
#include "vec_math.h"

#include <algorithm>
#include <array>
#include <utility>

namespace {

// The accumulators fill most of the vector registers: AVX-512's 32 hold 8 rows x 2 vectors (32
// columns); AVX2's 16 hold 4 rows x 3 vectors (24 columns), with 3 left for the weights and one
// for the broadcast.
#if defined(__AVX512F__)
constexpr int kPanelVecs = 2;
constexpr int64_t kRowBlock = 8;
#else
constexpr int kPanelVecs = 3;
constexpr int64_t kRowBlock = 4;
#endif
constexpr int64_t kPanel = kPanelVecs * kLanes;  // output columns per panel
constexpr int64_t kSlice = 128;                  // k per L1-resident panel slice
constexpr int64_t kPrefetchK = 4096 / kPanel;    // prefetch distance, in k steps (16 KB ahead)

// Rows [0, Rows) of a block times one panel over k in [k0, k1), into y's first `cols` columns.
template <int Rows>
void microkernel(const float* x, int64_t ldx, const float* panel, int64_t k0, int64_t k1, float* y, int64_t ldy,
                 int64_t cols) {
  Vec acc[Rows][kPanelVecs];
  for (int m = 0; m < Rows; ++m)
    for (int v = 0; v < kPanelVecs; ++v)  // from k0 > 0 on, carry on the previous slices' sums, in k order
      acc[m][v] = k0 == 0 ? vzero() : vload_n(y + m * ldy + v * kLanes, cols - v * kLanes);
  for (int64_t k = k0; k < k1; ++k) {
    const float* ahead = panel + (k + kPrefetchK) * kPanel;
    for (int64_t c = 0; c < kPanel; c += 16) _mm_prefetch(reinterpret_cast<const char*>(ahead + c), _MM_HINT_T2);
    Vec w[kPanelVecs];
    for (int v = 0; v < kPanelVecs; ++v) w[v] = vload(panel + k * kPanel + v * kLanes);
    for (int m = 0; m < Rows; ++m) {
      const Vec xb = vset1(x[m * ldx + k]);
      for (int v = 0; v < kPanelVecs; ++v) acc[m][v] = vfma(xb, w[v], acc[m][v]);
    }
  }
  for (int m = 0; m < Rows; ++m)
    for (int v = 0; v < kPanelVecs; ++v) vstore_n(y + m * ldy + v * kLanes, acc[m][v], cols - v * kLanes);
}

using Microkernel = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*, int64_t, int64_t);

// kMicrokernels[r] runs a block of r rows.
template <int... R>
constexpr std::array<Microkernel, sizeof...(R) + 1> microkernels(std::integer_sequence<int, R...>) {
  return {nullptr, microkernel<R + 1>...};
}
constexpr auto kMicrokernels = microkernels(std::make_integer_sequence<int, kRowBlock>());

}  // namespace

int64_t panel_width() { return kPanel; }

torch::Tensor panel_linear(const torch::Tensor& x, const torch::Tensor& panels, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.device().is_cpu(), "x must be a 2-D fp32 CPU tensor");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.is_contiguous() &&
              panels.scalar_type() == torch::kFloat, "panels must be packed into ", kPanel, "-column panels for this build (cpu_kernels.pack)");
  const int64_t rows = x.size(0), k_dim = x.size(1), num_panels = panels.size(0);
  TORCH_CHECK(panels.size(1) == k_dim, "x has ", k_dim, " columns, the weight ", panels.size(1));
  TORCH_CHECK(0 < n && n <= num_panels * kPanel, "n out of range");
  auto y = torch::empty({rows, n}, x.options());
  if (rows == 0) return y;
  // x is read in place (its rows may be strided): a K slice of a row block is at most 4 KB, which stays in L1
  // beside the panel slice. Copying x into a broadcast-friendly layout first cost about 1 ns an
  // element on one thread, 1.6 ms of a 16-row SmolLM2 decode step.
  const auto xc = x.stride(1) == 1 ? x : x.contiguous();
  const float* xs = xc.data_ptr<float>();
  const int64_t ldx = xc.stride(0);
  const float* w = panels.data_ptr<float>();
  float* out = y.data_ptr<float>();
  const int64_t blocks = (rows + kRowBlock - 1) / kRowBlock;
  at::parallel_for(0, num_panels, 1, [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p) {
      const int64_t n0 = p * kPanel;
      for (int64_t k0 = 0; k0 < k_dim; k0 += kSlice) {
        const int64_t k1 = std::min(k_dim, k0 + kSlice);
        for (int64_t b = 0; b < blocks; ++b) {
          const int64_t block_rows = std::min(kRowBlock, rows - b * kRowBlock);
          kMicrokernels[block_rows](xs + b * kRowBlock * ldx, ldx, w + p * k_dim * kPanel, k0, k1,
                                    out + b * kRowBlock * n + n0, n, n - n0);
        }
      }
    }
  });
  return y;
}
