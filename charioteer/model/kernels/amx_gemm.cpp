// bf16 GEMMs of up to a few hundred rows on AMX tiles (tdpbf16ps), for CPUs that have them (Sapphire
// Rapids and later).
//
// A batch of up to a few dozen rows is bound by streaming the weight, and oneDNN's bf16 GEMM pays a
// per-call cost that shows at these sizes. Here the weight is packed once in the order the tiles
// read it, so each 16-column block is one contiguous stream, prefetched ahead; x is read in place
// (when K is a multiple of 32). The 8 tile registers hold a 32 x 32 block of C (4 tiles), two A
// tiles of 16 rows and two B tiles of 16 columns: one tile load per tdpbf16ps, where one row tile of
// C per B tile took 1.25 loads at 64 rows. A pair of column blocks runs every 32-row pass of x in
// turn, so the weight streams from memory once and later passes read it from L2. On a LLaMA-7B
// layer, 2 threads, Xeon with AMX, that took 64 rows from 27.8 to 22.5 ms (oneDNN 29.1) and 128 from
// 58 to 33 (oneDNN 40.6); see llama.AMX_MAX_ROWS. Every row is computed from its own row of x alone,
// in the same k order whatever the batch, so its result does not depend on the other rows.
//
// Built into both ISA builds (the functions carry AMX's target attribute, nothing else does); the
// caller checks the CPU (cpu_kernels.amx_available) before calling, and amx_ready asks Linux for
// the tile state, which a process must request once.
#include "kernels.h"
#include "amx_tiles.h"

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

namespace {

constexpr int64_t kPassRows = 2 * kTileRows;  // rows of x per pass: C tiles 0-1 hold the first 16, 2-3 the rest
constexpr int64_t kPairCols = 2 * kTileN;     // columns per pass: C tiles 0 and 2 the first 16, 1 and 3 the rest
constexpr int64_t kPrefetchTiles = 8;  // B tiles ahead per stream (about what memory returns during their compute)

// A (tiles 4, 5), B (6, 7) and C (0-3) of a pass over `rows0` + `rows1` rows (rows1 0: one row tile).
void configure(int64_t rows0, int64_t rows1) {
  uint8_t rows[8] = {};
  rows[0] = rows[1] = rows[4] = static_cast<uint8_t>(rows0);
  if (rows1) rows[2] = rows[3] = rows[5] = static_cast<uint8_t>(rows1);
  configure_tiles(rows);
}

// C[RT row tiles x CT column blocks], stored to c (32 floats a row), = A . B over kb k-steps. A's
// second row tile starts a_tile elements after its first, rows a_stride bytes apart; B's column
// blocks b0, b1 are contiguous streams of tiles, prefetched ahead when they come from memory.
template <int RT, int CT>
__attribute__((target("amx-tile,amx-bf16"))) void block(const uint16_t* a, int64_t a_tile, int64_t a_stride,
                                                         const uint16_t* b0, const uint16_t* b1, int64_t kb,
                                                         bool prefetch, float* c) {
  _tile_zero(0);
  if (CT > 1) _tile_zero(1);
  if (RT > 1) _tile_zero(2);
  if (RT > 1 && CT > 1) _tile_zero(3);
  for (int64_t k = 0; k < kb; ++k) {
    if (prefetch) {
      const char* ahead0 = reinterpret_cast<const char*>(b0 + (k + kPrefetchTiles) * kTileElems);
      const char* ahead1 = reinterpret_cast<const char*>(b1 + (k + kPrefetchTiles) * kTileElems);
      for (int line = 0; line < 16; ++line) {
        _mm_prefetch(ahead0 + 64 * line, _MM_HINT_T0);
        if (CT > 1) _mm_prefetch(ahead1 + 64 * line, _MM_HINT_T0);
      }
    }
    const uint16_t* ak = a + k * kTileK;
    _tile_loadd(4, ak, a_stride);
    _tile_loadd(6, b0 + k * kTileElems, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (CT > 1) {
      _tile_loadd(7, b1 + k * kTileElems, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (RT > 1) {
      _tile_loadd(5, ak + a_tile, a_stride);
      _tile_dpbf16ps(2, 5, 6);
      if (CT > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  constexpr int64_t stride = kPairCols * sizeof(float);
  _tile_stored(0, c, stride);
  if (CT > 1) _tile_stored(1, c + kTileN, stride);
  if (RT > 1) _tile_stored(2, c + kTileRows * kPairCols, stride);
  if (RT > 1 && CT > 1) _tile_stored(3, c + kTileRows * kPairCols + kTileN, stride);
}

}  // namespace

bool amx_ready() {
  static const bool ready = [] {
    constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ready;
}

torch::Tensor amx_pack(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kBFloat16, "amx_pack takes a bf16 [N, K] weight");
  const auto w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), nb = (n + kTileN - 1) / kTileN, kb = (k + kTileK - 1) / kTileK;
  auto packed = torch::zeros({nb, kb, kTileRows, kTileK}, w.options());
  const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, nb, 1, [&](int64_t first, int64_t last) {
    for (int64_t j = first; j < last; ++j)
      for (int64_t col = 0; col < kTileN && j * kTileN + col < n; ++col)
        for (int64_t kk = 0; kk < k; ++kk)  // B tile row r holds k = 2r and 2r + 1 of each column, side by side
          dst[((j * kb + kk / kTileK) * kTileRows + (kk % kTileK) / 2) * kTileK + col * 2 + kk % 2] =
              src[(j * kTileN + col) * k + kk];
  });
  return packed;
}

torch::Tensor amx_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n, bool bf16_output) {
  TORCH_CHECK(amx_ready(), "AMX tile state was refused to this process (arch_prctl)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "amx_linear takes bf16 x [M, K]");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == torch::kBFloat16 && packed.size(2) == kTileRows &&
              packed.size(3) == kTileK && packed.is_contiguous(), "amx_linear takes a weight packed by amx_pack");
  const int64_t m = x.size(0), k = x.size(1), nb = packed.size(0), kb = packed.size(1);
  TORCH_CHECK((k + kTileK - 1) / kTileK == kb && (n + kTileN - 1) / kTileN == nb,
              "x's K or n does not match the packed weight");
  auto out = torch::empty({m, n}, x.options().dtype(bf16_output ? torch::kBFloat16 : torch::kFloat));
  if (m == 0) return out;
  // x is read in place where its K tiles exactly (rows may be strided), else copied zero padded
  const torch::Tensor a = k % kTileK == 0 && x.stride(1) == 1
                              ? x
                              : torch::constant_pad_nd(x, {0, kb * kTileK - k}).contiguous();
  const int64_t a_tile = kTileRows * a.stride(0), a_stride = a.stride(0) * 2;
  const auto* ap = reinterpret_cast<const uint16_t*>(a.data_ptr<at::BFloat16>());
  const auto* bp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  float* out_fp32 = bf16_output ? nullptr : out.data_ptr<float>();
  at::BFloat16* out_bf16 = bf16_output ? out.data_ptr<at::BFloat16>() : nullptr;
  const int64_t passes = (m + kPassRows - 1) / kPassRows;
  at::parallel_for(0, (nb + 1) / 2, 1, [&](int64_t first, int64_t last) {
    alignas(64) float c[kPassRows * kPairCols];
    int64_t configured = -1;  // the rows of the pass the tiles are configured for
    for (int64_t pair = first; pair < last; ++pair) {
      const int64_t j = 2 * pair, blocks = std::min<int64_t>(2, nb - j);
      const uint16_t* b0 = bp + j * kb * kTileElems;
      const uint16_t* b1 = b0 + kb * kTileElems;
      const int64_t cols = std::min(kPairCols, n - j * kTileN);
      for (int64_t pass = 0; pass < passes; ++pass) {
        const int64_t r0 = pass * kPassRows, rows = std::min(kPassRows, m - r0);
        if (rows != configured) {
          configure(std::min(rows, kTileRows), std::max<int64_t>(rows - kTileRows, 0));
          configured = rows;
        }
        const uint16_t* arows = ap + r0 * a.stride(0);
        const bool prefetch = pass == 0;  // later passes find the weight in L2
        if (rows > kTileRows) {
          if (blocks == 2) block<2, 2>(arows, a_tile, a_stride, b0, b1, kb, prefetch, c);
          else block<2, 1>(arows, a_tile, a_stride, b0, b1, kb, prefetch, c);
        } else {
          if (blocks == 2) block<1, 2>(arows, a_tile, a_stride, b0, b1, kb, prefetch, c);
          else block<1, 1>(arows, a_tile, a_stride, b0, b1, kb, prefetch, c);
        }
        for (int64_t r = 0; r < rows; ++r) {
          const float* src = c + r * kPairCols;
          const int64_t offset = (r0 + r) * n + j * kTileN;
          if (out_bf16 != nullptr) {
            for (int64_t q = 0; q < cols; ++q) out_bf16[offset + q] = at::BFloat16(src[q]);  // to nearest even, as torch rounds
          } else {
            std::memcpy(out_fp32 + offset, src, cols * sizeof(float));
          }
        }
      }
    }
    release_tiles();
  });
  return out;
}
