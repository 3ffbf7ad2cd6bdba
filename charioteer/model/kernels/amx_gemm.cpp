// bf16 GEMMs of few rows on AMX tiles (tdpbf16ps), for CPUs that have them (Sapphire Rapids and later).
//
// A batch of up to a few dozen rows is bound by streaming the weight, and oneDNN's bf16 GEMM pays a
// per-call cost that shows at these sizes. Here the weight is packed once in the order the tiles
// read it, so each 16-column block is one contiguous stream, prefetched ahead; x is read in place
// (up to 64 rows whose K is a multiple of 32), each 16-row tile of it against each block. Every row
// is computed from its own row of x alone, in the same k order whatever the batch, so its result
// does not depend on the other rows.
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

constexpr int64_t kMaxRowTiles = 4;  // C tiles 0-3; tile 4 is a full A tile, 6 the last (maybe partial) one, 5 B
constexpr int64_t kDirectMaxRows = kMaxRowTiles * kTileRows;
constexpr int64_t kPrefetchTiles = 8;  // B tiles ahead (8 KB: about what memory returns during 8 tiles' compute)

// Tiles 0..row_tiles-1 hold C, the last of them (and A tile 6) `last_rows` rows.
void configure(int64_t row_tiles, int64_t last_rows) {
  uint8_t rows[8] = {};
  rows[row_tiles - 1] = rows[6] = static_cast<uint8_t>(last_rows);
  configure_tiles(rows);
}

// C[MT row tiles x 16 columns] = A . B over kb k-steps. A's row tile t, k-step k starts at
// a + t * a_tile + k * a_step, its rows a_stride bytes apart; B's tiles are contiguous.
template <int MT>
__attribute__((target("amx-tile,amx-bf16"))) void block(const uint16_t* a, int64_t a_tile, int64_t a_step,
                                                         int64_t a_stride, const uint16_t* b, int64_t kb, float* c) {
  if (MT > 0) _tile_zero(0);
  if (MT > 1) _tile_zero(1);
  if (MT > 2) _tile_zero(2);
  if (MT > 3) _tile_zero(3);
  for (int64_t k = 0; k < kb; ++k) {
    const char* ahead = reinterpret_cast<const char*>(b + (k + kPrefetchTiles) * kTileElems);
    for (int line = 0; line < 16; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
    _tile_loadd(5, b + k * kTileElems, 64);
    const uint16_t* ak = a + k * a_step;
    // every row tile but the last in tile 4; the last (maybe partial) in tile 6
    if (MT == 1) { _tile_loadd(6, ak, a_stride); _tile_dpbf16ps(0, 6, 5); }
    if (MT > 1) { _tile_loadd(4, ak, a_stride); _tile_dpbf16ps(0, 4, 5); }
    if (MT == 2) { _tile_loadd(6, ak + a_tile, a_stride); _tile_dpbf16ps(1, 6, 5); }
    if (MT > 2) { _tile_loadd(4, ak + a_tile, a_stride); _tile_dpbf16ps(1, 4, 5); }
    if (MT == 3) { _tile_loadd(6, ak + 2 * a_tile, a_stride); _tile_dpbf16ps(2, 6, 5); }
    if (MT > 3) { _tile_loadd(4, ak + 2 * a_tile, a_stride); _tile_dpbf16ps(2, 4, 5); }
    if (MT == 4) { _tile_loadd(6, ak + 3 * a_tile, a_stride); _tile_dpbf16ps(3, 6, 5); }
  }
  if (MT > 0) _tile_stored(0, c, 64);
  if (MT > 1) _tile_stored(1, c + 1 * kTileRows * kTileN, 64);
  if (MT > 2) _tile_stored(2, c + 2 * kTileRows * kTileN, 64);
  if (MT > 3) _tile_stored(3, c + 3 * kTileRows * kTileN, 64);
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
  const int64_t row_tiles = (m + kTileRows - 1) / kTileRows;
  // Up to 64 rows of a K that tiles exactly are read in place, 16 to a tile (the last tile partial);
  // otherwise x is copied, zero padded, into tile blocks [row tile][k-step][16][32].
  const bool direct = m <= kDirectMaxRows && k % kTileK == 0 && x.stride(1) == 1;
  torch::Tensor a = x;
  int64_t a_tile, a_step, a_stride;
  if (direct) {
    a_tile = kTileRows * x.stride(0), a_step = kTileK, a_stride = x.stride(0) * 2;
  } else {
    auto padded = torch::zeros({row_tiles * kTileRows, kb * kTileK}, x.options());
    padded.narrow(0, 0, m).narrow(1, 0, k).copy_(x);
    a = padded.view({row_tiles, kTileRows, kb, kTileK}).permute({0, 2, 1, 3}).contiguous();
    a_tile = kb * kTileElems, a_step = kTileElems, a_stride = 64;
  }
  const auto* ap = reinterpret_cast<const uint16_t*>(a.data_ptr<at::BFloat16>());
  const auto* bp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  float* out_fp32 = bf16_output ? nullptr : out.data_ptr<float>();
  at::BFloat16* out_bf16 = bf16_output ? out.data_ptr<at::BFloat16>() : nullptr;
  at::parallel_for(0, nb, 1, [&](int64_t first, int64_t last) {
    alignas(64) float c[kMaxRowTiles * kTileRows * kTileN];
    for (int64_t t0 = 0; t0 < row_tiles; t0 += kMaxRowTiles) {
      const int64_t tiles = std::min(kMaxRowTiles, row_tiles - t0);
      const int64_t rows = std::min(m - t0 * kTileRows, tiles * kTileRows);
      configure(tiles, direct ? rows - (tiles - 1) * kTileRows : kTileRows);
      const uint16_t* arows = ap + t0 * a_tile;
      for (int64_t j = first; j < last; ++j) {
        const uint16_t* b = bp + j * kb * kTileElems;
        switch (tiles) {
          case 1: block<1>(arows, a_tile, a_step, a_stride, b, kb, c); break;
          case 2: block<2>(arows, a_tile, a_step, a_stride, b, kb, c); break;
          case 3: block<3>(arows, a_tile, a_step, a_stride, b, kb, c); break;
          default: block<4>(arows, a_tile, a_step, a_stride, b, kb, c); break;
        }
        const int64_t cols = std::min(kTileN, n - j * kTileN);
        for (int64_t r = 0; r < rows; ++r) {
          const float* src = c + r * kTileN;
          const int64_t offset = (t0 * kTileRows + r) * n + j * kTileN;
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
