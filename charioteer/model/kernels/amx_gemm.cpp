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
// int8 weights (amx_linear_int8, weight-only: precision.quantize_int8's, one scale per output column)
// are read from the AVX-512 panel kernel's 32-column panels, so the model keeps one copy, and widened
// to bf16 in tile order (exact: |q| <= 127): with one pass (up to 32 rows) each k-step just before
// its tiles use it, into two slots in L1 taken in turn, so the widening overlaps the stream and the
// tiles; with more, the first pass widens each k-step into a copy of the panel (a pair of column
// blocks) that stays in L2 for the later passes (widening the whole panel before the first pass left
// its tiles idle during the stream: 48-128 rows of a LLaMA-7B layer 1.09-1.15x slower). x is rounded
// to bf16, and the column scales multiply the fp32 sums. So int8 reads a quarter of fp32's weight
// bytes and computes at bf16's rate. (Quantizing x's rows to int8 for AMX's int8 tiles instead ran up
// to 1.8x faster still, but SmolLM2's greedy tokens then agreed with fp32's for 0.45 of the tokens,
// against 0.79.)
//
// Built into both ISA builds (the functions carry AMX's or AVX-512's target attribute); the
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
#include <utility>
#include <vector>

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

}  // namespace

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

namespace {

constexpr int64_t kPassRows = 2 * kTileRows;  // rows of x per pass: C tiles 0-1 hold the first 16, 2-3 the rest
constexpr int64_t kPrefetchTiles = 8;  // B tiles ahead per stream (about what memory returns during their compute)
constexpr int64_t kTileBytes = kTileElems * 2;  // a bf16 tile: 16 rows of 64 bytes
// Cache lines of each of the next pair's blocks prefetched into L2 per k-step of a later pass, which
// leaves memory idle otherwise. A few, not the whole pair: a LLaMA-7B layer at 64 rows 1.05x, 96
// 1.11x, 128 1.08x with 3; 6-10 lines, or lines spread 2-8 apart for the L2 streamer, no gain or
// slower (probably: the prefetches take fill buffers the pass's own tile loads from L2 need; not checked).
constexpr int64_t kNextPairLines = 3;

// Bytes of x's rows and a pair's weight that a K chunk may keep in L2 (2 MB a core here) while
// several passes run it. A LLaMA-7B layer's down projection (K = 11008) at 64 rows needs 2.1 MB, so
// its later passes found the pair's weight gone; in two chunks it ran 1.23x faster (4.47 against
// 5.29 ms), at 128 rows in three 1.31x. A budget of 1 MB also split K = 4096 at 128 rows: slower.
constexpr int64_t kL2Budget = 3 << 19;

// A (tiles 4, 5), B (6, 7) and C (0-3) of a pass over `rows0` + `rows1` rows (rows1 0: one row tile).
void configure(int64_t rows0, int64_t rows1) {
  uint8_t rows[8] = {};
  rows[0] = rows[1] = rows[4] = static_cast<uint8_t>(rows0);
  if (rows1) rows[2] = rows[3] = rows[5] = static_cast<uint8_t>(rows1);
  configure_tiles(rows);
}

// C[RT row tiles x CT column blocks], stored to c (32 floats a row), = A . B over kb k-steps, added
// to the C that c holds with `accumulate` (an earlier K chunk's), else from zero. A's
// second row tile starts a_tile bytes after its first, rows a_stride bytes apart; b_tiles(k) gives
// the two B tiles of k-step k (column blocks 0 and 1, 64-byte rows), fetching or making them.
template <int RT, int CT, typename BTiles>
__attribute__((target("amx-tile,amx-bf16"))) void block(const char* a, int64_t a_tile, int64_t a_stride, int64_t kb,
                                                         const BTiles& b_tiles, float* c, bool accumulate) {
  constexpr int64_t c_stride = kPairCols * sizeof(float);
  if (accumulate) {
    _tile_loadd(0, c, c_stride);
    if (CT > 1) _tile_loadd(1, c + kTileN, c_stride);
    if (RT > 1) _tile_loadd(2, c + kTileRows * kPairCols, c_stride);
    if (RT > 1 && CT > 1) _tile_loadd(3, c + kTileRows * kPairCols + kTileN, c_stride);
  } else {
    _tile_zero(0);
    if (CT > 1) _tile_zero(1);
    if (RT > 1) _tile_zero(2);
    if (RT > 1 && CT > 1) _tile_zero(3);
  }
  for (int64_t k = 0; k < kb; ++k) {
    const auto [b0, b1] = b_tiles(k);
    const char* ak = a + k * 64;
    _tile_loadd(4, ak, a_stride);
    _tile_loadd(6, b0, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (CT > 1) {
      _tile_loadd(7, b1, 64);
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

// y = x . w.T for x's bf16 rows at a (a_stride bytes apart, K padded to kb tiles) and a weight in nb
// column blocks: bf16 tiles packed by amx_pack, or with kInt8Weights int8 32-column panels of k rows
// (cpu_kernels.pack), widened as the first pass goes (into L1 with one pass, L2 with more). Each pair
// of column blocks runs every 32-row pass in turn (K in chunks where x's rows and the pair outgrow
// kL2Budget, every pass over each chunk, C kept between chunks: the same sums in the same order).
// store(r0, rows, j, cols, c) writes a pass's block of C (rows x cols, 32 floats a row) for rows r0..
// and columns from block j on.
template <bool kInt8Weights, typename Store>
void run_tiles(const char* a, int64_t a_stride, int64_t m, const void* packed, int64_t nb, int64_t kb, int64_t k,
               int64_t n, const Store& store) {
  const int64_t passes = (m + kPassRows - 1) / kPassRows, a_tile = kTileRows * a_stride;
  const int64_t block_bytes = kb * kTileBytes;  // one column block's tiles in bf16
  // bf16 weights with several passes: K in chunks whose x rows and pair weight fit the L2 budget, so
  // the later passes find the pair's weight still there (at 64 rows and K = 11008 they did not)
  const int64_t step_bytes = passes * kPassRows * kTileK * 2 + 2 * kTileBytes;
  const int64_t chunks =
      kInt8Weights || passes == 1 ? 1 : std::max<int64_t>(1, (kb * step_bytes + kL2Budget - 1) / kL2Budget);
  const int64_t chunk_steps = (kb + chunks - 1) / chunks;
  parallel_split((nb + 1) / 2, [&](int64_t first, int64_t last) {  // inside DecodeLayers' team: its share
    thread_local std::vector<float> cbuf;  // each pass's block of C
    if (static_cast<int64_t>(cbuf.size()) < passes * kPassRows * kPairCols)
      cbuf.resize(passes * kPassRows * kPairCols);
    alignas(64) uint16_t ring[4 * kTileElems];  // int8 weights in one pass: two k-steps' B tiles in turn
    thread_local std::vector<uint16_t> widened;  // int8 weights: the panel in bf16 tiles (L2-sized)
    if (kInt8Weights && passes > 1 && static_cast<int64_t>(widened.size()) < 2 * kb * kTileElems)
      widened.resize(2 * kb * kTileElems);
    int64_t configured = -1;  // the rows of the pass the tiles are configured for
    for (int64_t pair = first; pair < last; ++pair) {
      const int64_t j = 2 * pair, blocks = std::min<int64_t>(2, nb - j);
      const int8_t* panel = static_cast<const int8_t*>(packed) + pair * k * kPairCols;  // int8 weights
      const char* b0 = nullptr;  // the pair's bf16 tiles, block 1 after block 0, where they are kept
      if constexpr (kInt8Weights) {
        if (passes > 1) b0 = reinterpret_cast<const char*>(widened.data());  // widened by pass 0, for every pass
      } else {
        b0 = static_cast<const char*>(packed) + j * block_bytes;
      }
      const int64_t cols = std::min(kPairCols, n - j * kTileN);
      for (int64_t t0 = 0; t0 < kb; t0 += chunk_steps) {
        const int64_t steps = std::min(chunk_steps, kb - t0);
        const bool last_chunk = t0 + steps == kb;
        for (int64_t pass = 0; pass < passes; ++pass) {
          const int64_t r0 = pass * kPassRows, rows = std::min(kPassRows, m - r0);
          float* c = cbuf.data() + pass * kPassRows * kPairCols;
          if (rows != configured) {
            configure(std::min(rows, kTileRows), std::max<int64_t>(rows - kTileRows, 0));
            configured = rows;
          }
          const char* arows = a + r0 * a_stride + t0 * 64;
          const auto run = [&](const auto& b_tiles) {
            if (rows > kTileRows) {
              if (blocks == 2) block<2, 2>(arows, a_tile, a_stride, steps, b_tiles, c, t0 > 0);
              else block<2, 1>(arows, a_tile, a_stride, steps, b_tiles, c, t0 > 0);
            } else {
              if (blocks == 2) block<1, 2>(arows, a_tile, a_stride, steps, b_tiles, c, t0 > 0);
              else block<1, 1>(arows, a_tile, a_stride, steps, b_tiles, c, t0 > 0);
            }
          };
          const auto stored = [&](int64_t t) {
            return std::pair(b0 + (t0 + t) * kTileBytes, b0 + block_bytes + (t0 + t) * kTileBytes);
          };
          if (kInt8Weights && pass == 0) {  // each k-step widened just before its tiles use it: with one pass
            run([&](int64_t t) {             // into two L1 slots in turn, with more into the panel's L2 copy
              uint16_t* at0 = passes == 1 ? ring + (t % 2) * 2 * kTileElems : widened.data() + (t0 + t) * kTileElems;
              uint16_t* at1 = at0 + (passes == 1 ? kTileElems : kb * kTileElems);
              widen_int8_steps(panel, k, t0 + t, t0 + t + 1, at0, at1);
              return std::pair(reinterpret_cast<const char*>(at0), reinterpret_cast<const char*>(at1));
            });
          } else if (!kInt8Weights && pass == 0) {  // the weight from memory: prefetched ahead
            run([&](int64_t t) {
              const char* ahead0 = b0 + (t0 + t + kPrefetchTiles) * kTileBytes;
              const char* ahead1 = ahead0 + block_bytes;
              for (int line = 0; line < 16; ++line) {
                _mm_prefetch(ahead0 + 64 * line, _MM_HINT_T0);
                if (blocks > 1) _mm_prefetch(ahead1 + 64 * line, _MM_HINT_T0);
              }
              return stored(t);
            });
          } else if (!kInt8Weights && last_chunk && pair + 1 < last) {  // later passes read the pair from L2:
            const char* next0 = static_cast<const char*>(packed) + (j + 2) * block_bytes;  // start the next pair
            const bool next_two = nb - j - 2 > 1;
            run([&](int64_t t) {
              for (int64_t line = 0; line < kNextPairLines; ++line) {
                const int64_t at = (((pass - 1) * steps + t) * kNextPairLines + line) * 64;
                if (at < block_bytes) {
                  _mm_prefetch(next0 + at, _MM_HINT_T1);
                  if (next_two) _mm_prefetch(next0 + block_bytes + at, _MM_HINT_T1);
                }
              }
              return stored(t);
            });
          } else {  // widened weights, a chunk before the last, and the thread's last pair: in L2
            run(stored);
          }
          if (last_chunk) store(r0, rows, j, cols, c);
        }
      }
    }
    release_tiles();
  });
}

}  // namespace

// x as the tiles read it: bf16, K zero padded to kb tiles; read in place where it already is that
// (rows may be strided).
torch::Tensor tile_input(const torch::Tensor& x, int64_t kb) {
  const auto bf16 = x.to(torch::kBFloat16);
  const int64_t k = bf16.size(1);
  if (k % kTileK == 0 && bf16.stride(1) == 1) return bf16;
  return torch::constant_pad_nd(bf16, {0, kb * kTileK - k}).contiguous();
}

std::pair<const uint16_t*, int64_t> tile_rows(const torch::Tensor& x, int64_t kb) {
  const int64_t m = x.size(0), k = x.size(1), width = kb * kTileK;
  if (x.scalar_type() == torch::kBFloat16 && k == width && x.stride(1) == 1)
    return {reinterpret_cast<const uint16_t*>(x.data_ptr()), x.stride(0)};
  thread_local std::vector<uint16_t> rows;
  rows.assign(m * width, 0);
  for (int64_t r = 0; r < m; ++r) {
    uint16_t* dst = rows.data() + r * width;
    if (x.scalar_type() == torch::kBFloat16) {
      const auto* src = reinterpret_cast<const uint16_t*>(x.data_ptr()) + r * x.stride(0);
      for (int64_t c = 0; c < k; ++c) dst[c] = src[c * x.stride(1)];
      continue;
    }
    const float* src = x.data_ptr<float>() + r * x.stride(0);
    for (int64_t c = 0; c < k; ++c) dst[c] = c10::BFloat16(src[c * x.stride(1)]).x;
  }
  return {rows.data(), width};
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

bool amx_ready() {
  static const bool ready = [] {
    constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ready;
}

void check_tile_gemm(const char* name, const torch::Tensor& x, const torch::Tensor& packed, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && fp32_or_bf16(x), name, " takes fp32 or bf16 x [M, K]");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == torch::kBFloat16 && packed.size(2) == kTileRows &&
              packed.size(3) == kTileK && packed.is_contiguous(), name, " takes a weight packed by amx_pack");
  TORCH_CHECK((x.size(1) + kTileK - 1) / kTileK == packed.size(1) && (n + kTileN - 1) / kTileN == packed.size(0),
              "x's K or n does not match the packed weight");
}

torch::Tensor tile_gemm_output(const char* name, const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                               bool bf16_output, const c10::optional<torch::Tensor>& out) {
  check_tile_gemm(name, x, packed, n);
  return output_or_new(name, out, {x.size(0), n}, x.options().dtype(bf16_output ? torch::kBFloat16 : torch::kFloat), x);
}

void amx_linear_into(const torch::Tensor& x, const torch::Tensor& packed, int64_t n, bool bf16_output,
                     const torch::Tensor& result) {
  TORCH_CHECK(amx_ready(), "AMX tile state was refused to this process (arch_prctl)");
  check_tile_gemm("amx_linear", x, packed, n);
  check_output("amx_linear", result, {x.size(0), n}, x.options().dtype(bf16_output ? torch::kBFloat16 : torch::kFloat),
               x);
  const int64_t m = x.size(0), k = x.size(1), nb = packed.size(0), kb = packed.size(1);
  if (m == 0) return;
  const auto [a, lda] = tile_rows(x, kb);
  float* out_fp32 = bf16_output ? nullptr : result.data_ptr<float>();
  at::BFloat16* out_bf16 = bf16_output ? static_cast<at::BFloat16*>(result.data_ptr()) : nullptr;
  run_tiles<false>(reinterpret_cast<const char*>(a), lda * 2, m, packed.data_ptr(), nb, kb, k, n,
                   [&](int64_t r0, int64_t rows, int64_t j, int64_t cols, const float* c) {
                     for (int64_t r = 0; r < rows; ++r) {
                       const float* src = c + r * kPairCols;
                       const int64_t offset = (r0 + r) * n + j * kTileN;
                       if (out_bf16 != nullptr) {  // to nearest even, as torch rounds
                         for (int64_t q = 0; q < cols; ++q) out_bf16[offset + q] = at::BFloat16(src[q]);
                       } else {
                         std::memcpy(out_fp32 + offset, src, cols * sizeof(float));
                       }
                     }
                   });
}

torch::Tensor amx_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n, bool bf16_output) {
  auto out = tile_gemm_output("amx_linear", x, packed, n, bf16_output);
  amx_linear_into(x, packed, n, bf16_output, out);
  return out;
}

void check_int8_panels(const char* name, const torch::Tensor& x, const torch::Tensor& panels, int64_t n,
                       const torch::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, name, " takes fp32 x [M, K]");
  TORCH_CHECK(panel_width() == kPairCols && panels.dim() == 3 && panels.scalar_type() == torch::kChar &&
                  panels.size(2) == kPairCols && panels.is_contiguous(),
              name, " takes int8 weights packed into 32-column panels (cpu_kernels.pack, AVX-512 build)");
  TORCH_CHECK(panels.size(1) == x.size(1), "x has ", x.size(1), " columns, the weight ", panels.size(1));
  TORCH_CHECK(0 < n && n <= panels.size(0) * kPairCols, "n out of range");
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == n && scale.scalar_type() == torch::kFloat,
              name, " takes one fp32 scale per output column");
}

Int8Gemm int8_gemm(const char* name, const torch::Tensor& x, const torch::Tensor& panels, int64_t n,
                   const torch::Tensor& scale) {
  check_int8_panels(name, x, panels, n, scale);
  const int64_t m = x.size(0), k = x.size(1), kb = (k + kTileK - 1) / kTileK;
  return {tile_input(x, kb), scale.contiguous(), torch::empty({m, n}, x.options()), m, k, kb, (n + kTileN - 1) / kTileN};
}

torch::Tensor amx_linear_int8(const torch::Tensor& x, const torch::Tensor& panels, int64_t n,
                              const torch::Tensor& scale) {
  TORCH_CHECK(amx_ready(), "AMX tile state was refused to this process (arch_prctl)");
  const auto g = int8_gemm("amx_linear_int8", x, panels, n, scale);
  if (g.m == 0) return g.out;
  const float* sw = g.scales.data_ptr<float>();
  float* y = g.out.data_ptr<float>();
  run_tiles<true>(static_cast<const char*>(g.a.data_ptr()), g.a.stride(0) * 2, g.m, panels.data_ptr(), g.nb, g.kb,
                  g.k, n,
                  [&](int64_t r0, int64_t rows, int64_t j, int64_t cols, const float* c) {
                    for (int64_t r = 0; r < rows; ++r) {
                      const float* src = c + r * kPairCols;
                      float* dst = y + (r0 + r) * n + j * kTileN;
                      for (int64_t q = 0; q < cols; ++q) dst[q] = src[q] * sw[j * kTileN + q];
                    }
                  });
  return g.out;
}
