// y = x @ w.T for decode-sized batches (up to a few dozen rows), on AVX-512 or AVX2 CPUs.
//
// The weight is repacked once into panels of kPanel output columns, [N/kPanel][K][kPanel], so each
// panel is one contiguous stream. Rows run in blocks of up to kRowBlock: per k, the panel's weight
// vectors are loaded and each row's x[m, k] is broadcast into that row's accumulators. K is walked
// in slices so a panel slice stays in L1 while every row block uses it, and the stream is
// prefetched into L2 ahead of use. Each output is summed over k in order, so a row's result does
// not depend on the other rows in the batch (nor on the row blocking).
//
// The weight may be fp32, bf16 or int8 (with one fp32 scale per output column): a narrow weight is
// widened to fp32 exactly as it is loaded, so a memory-bound call reads half or a quarter of the
// bytes and computes the same fp32 products.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "kernels.h"
#include "vec_math.h"

#include <algorithm>
#include <array>
#include <type_traits>
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

// kLanes weights of the panel, widened to fp32 exactly: fp32 as is, bf16 (its bits as uint16) or int8.
inline Vec wload(const float* p) { return vload(p); }
inline Vec wload(const uint16_t* p) { return vload_bf16(p); }
inline Vec wload(const int8_t* p) { return vload_i8(p); }

// Rows [0, Rows) of a block times one panel slice over k in [k0, k1), into y's first `cols` columns.
// `slice` points at the slice's first k. `stream`: the slice is the weight in memory, to prefetch
// ahead of use (not a widened copy in L1). `scale` (int8 weights): the columns' scales, applied
// once the last slice (k1 == k_dim) is summed.
template <int Rows, typename W>
void microkernel(const float* x, int64_t ldx, const W* slice, bool stream, int64_t k0, int64_t k1, int64_t k_dim,
                 const float* scale, float* y, int64_t ldy, int64_t cols) {
  constexpr int64_t kPrefetchK = 16384 / (kPanel * sizeof(W));  // prefetch distance: 16 KB ahead
  Vec acc[Rows][kPanelVecs];
  for (int m = 0; m < Rows; ++m)
    for (int v = 0; v < kPanelVecs; ++v)  // from k0 > 0 on, carry on the previous slices' sums, in k order
      acc[m][v] = k0 == 0 ? vzero() : vload_n(y + m * ldy + v * kLanes, cols - v * kLanes);
  for (int64_t k = k0; k < k1; ++k) {
    const W* panel_k = slice + (k - k0) * kPanel;
    if (stream) {
      const char* ahead = reinterpret_cast<const char*>(panel_k + kPrefetchK * kPanel);
      for (int64_t c = 0; c < kPanel * int64_t(sizeof(W)); c += 64) _mm_prefetch(ahead + c, _MM_HINT_T2);
    }
    Vec w[kPanelVecs];
    for (int v = 0; v < kPanelVecs; ++v) w[v] = wload(panel_k + v * kLanes);
    for (int m = 0; m < Rows; ++m) {
      const Vec xb = vset1(x[m * ldx + k]);
      for (int v = 0; v < kPanelVecs; ++v) acc[m][v] = vfma(xb, w[v], acc[m][v]);
    }
  }
  if (scale != nullptr && k1 == k_dim)
    for (int m = 0; m < Rows; ++m)
      for (int v = 0; v < kPanelVecs; ++v) acc[m][v] = vmul(acc[m][v], vload_n(scale + v * kLanes, cols - v * kLanes));
  for (int m = 0; m < Rows; ++m)
    for (int v = 0; v < kPanelVecs; ++v) vstore_n(y + m * ldy + v * kLanes, acc[m][v], cols - v * kLanes);
}

template <typename W>
using Microkernel = void (*)(const float*, int64_t, const W*, bool, int64_t, int64_t, int64_t, const float*, float*,
                             int64_t, int64_t);

// microkernels<W>()[r] runs a block of r rows.
template <typename W, int... R>
constexpr std::array<Microkernel<W>, sizeof...(R) + 1> microkernels(std::integer_sequence<int, R...>) {
  return {nullptr, microkernel<R + 1, W>...};
}
template <typename W>
constexpr auto kMicrokernels = microkernels<W>(std::make_integer_sequence<int, kRowBlock>());

// y = x @ w.T over panels of weight type W. A bf16 or int8 slice that several row blocks use is
// widened once into an L1 buffer, so each block runs the fp32 loop; a single block widens as it
// goes. Both sum the same exact fp32 products in the same order, so rows stay independent.
template <typename W>
void panel_gemm(const float* xs, int64_t ldx, int64_t rows, const W* w, int64_t k_dim, int64_t num_panels,
                const float* scale, float* out, int64_t n) {
  const int64_t blocks = (rows + kRowBlock - 1) / kRowBlock;
  const bool widen = !std::is_same_v<W, float> && blocks > 1;
  parallel_split(num_panels, [&](int64_t first, int64_t last) {
    alignas(64) float buffer[kSlice * kPanel];
    for (int64_t p = first; p < last; ++p) {
      const int64_t n0 = p * kPanel;
      const W* panel = w + p * k_dim * kPanel;
      const float* panel_scale = scale != nullptr ? scale + n0 : nullptr;
      for (int64_t k0 = 0; k0 < k_dim; k0 += kSlice) {
        const int64_t k1 = std::min(k_dim, k0 + kSlice);
        if (widen) {
          for (int64_t i = 0; i < (k1 - k0) * kPanel; i += kLanes) vstore(buffer + i, wload(panel + k0 * kPanel + i));
        }
        for (int64_t b = 0; b < blocks; ++b) {
          const int64_t block_rows = std::min(kRowBlock, rows - b * kRowBlock);
          const float* x_block = xs + b * kRowBlock * ldx;
          float* y_block = out + b * kRowBlock * n + n0;
          if (widen) {
            kMicrokernels<float>[block_rows](x_block, ldx, buffer, false, k0, k1, k_dim, panel_scale, y_block, n, n - n0);
          } else {
            kMicrokernels<W>[block_rows](x_block, ldx, panel + k0 * kPanel, true, k0, k1, k_dim, panel_scale, y_block,
                                          n, n - n0);
          }
        }
      }
    }
  });
}

}  // namespace

int64_t panel_width() { return kPanel; }
int64_t panel_row_block() { return kRowBlock; }

namespace {

void check_panels(const torch::Tensor& x, const torch::Tensor& panels, int64_t n, const torch::Tensor* scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.device().is_cpu(), "x must be a 2-D fp32 CPU tensor");
  const auto type = panels.scalar_type();
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.is_contiguous() &&
              (type == torch::kFloat || type == torch::kBFloat16 || type == torch::kChar),
              "panels must be fp32, bf16 or int8, packed into ", kPanel, "-column panels for this build (cpu_kernels.pack)");
  TORCH_CHECK(panels.size(1) == x.size(1), "x has ", x.size(1), " columns, the weight ", panels.size(1));
  TORCH_CHECK(0 < n && n <= panels.size(0) * kPanel, "n out of range");
  TORCH_CHECK((type == torch::kChar) == (scale != nullptr), "int8 panels take one fp32 scale per output column, others none");
  if (scale != nullptr)
    TORCH_CHECK(scale->dim() == 1 && scale->size(0) == n && scale->scalar_type() == torch::kFloat && scale->is_contiguous(),
                "scale must be a contiguous fp32 vector of the n = ", n, " output columns' scales");
}

}  // namespace

void panel_linear_into(const torch::Tensor& x, const torch::Tensor& panels, int64_t n, const torch::Tensor* scale,
                       const torch::Tensor& y) {
  check_panels(x, panels, n, scale);
  const int64_t rows = x.size(0), k_dim = x.size(1), num_panels = panels.size(0);
  check_output("panel_linear", y, {rows, n}, x.options(), x, panels);
  if (rows == 0) return;
  // x is read in place (its rows may be strided): a K slice of a row block is at most 4 KB, which stays in L1
  // beside the panel slice. Copying x into a broadcast-friendly layout first cost about 1 ns an
  // element on one thread, 1.6 ms of a 16-row SmolLM2 decode step.
  const auto xc = with_rows(x);
  const float* xs = xc->data_ptr<float>();
  const int64_t ldx = xc->stride(0);
  float* yp = y.data_ptr<float>();
  const float* scales = scale != nullptr ? scale->data_ptr<float>() : nullptr;
  const auto type = panels.scalar_type();
  if (type == torch::kFloat) {
    panel_gemm(xs, ldx, rows, panels.data_ptr<float>(), k_dim, num_panels, nullptr, yp, n);
  } else if (type == torch::kBFloat16) {
    panel_gemm(xs, ldx, rows, reinterpret_cast<const uint16_t*>(panels.data_ptr()), k_dim, num_panels, nullptr, yp, n);
  } else {
    panel_gemm(xs, ldx, rows, panels.data_ptr<int8_t>(), k_dim, num_panels, scales, yp, n);
  }
}

torch::Tensor panel_linear(const torch::Tensor& x, const torch::Tensor& panels, int64_t n,
                           const c10::optional<torch::Tensor>& scale, const c10::optional<torch::Tensor>& out) {
  const torch::Tensor* scales = scale.has_value() ? &*scale : nullptr;
  check_panels(x, panels, n, scales);
  auto y = given_or_empty(out, {x.size(0), n}, x.options());
  panel_linear_into(x, panels, n, scales, y);
  return y;
}
