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
// run on the int8 tiles (tdpbssd), read from the AVX-512 panel kernel's 32-column panels, so the model
// keeps one copy: each k-step's four panel rows become a B tile row with two byte permutes
// (int8_tile_step), where widening them to bf16 took 9 vector instructions per 32 weights and bound the
// kernel at 8-32 rows. x is quantized per row to int16 (its largest magnitude to kInt16Top) and each
// value split into two signed bytes, v = 256 hi + lo: two tdpbssd per k-step, at bf16's tile rate, and
// sums exact in int32, so a product is off from fp32's only by x's int16 rounding (1/65278 of its row's
// largest value: 1e-5 of a random product's size, against 1e-3 with x rounded to bf16). (x as one
// int8 byte per value ran up to 1.8x faster still, but SmolLM2's greedy tokens then agreed with fp32's
// for 0.45 of the tokens, against 0.79.) A pass is 16 rows (C: their high and low sums); from 17 rows the
// first pass lays the pair's B tiles out into a copy that stays in L2 for the later ones (run_int8_tiles).
// On a LLaMA-7B layer, 2 threads, Xeon with AMX, against widening to bf16: 1.25x faster at 8-16 rows,
// 0.97-1.13x at 32-512 (BENCHMARKS.md). Every row is computed from its own row of x alone.
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
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// A value v of x as int8 tiles take it: v = 256 hi + lo, both signed bytes. A row is scaled so its largest
// magnitude becomes kInt16Top, whose high byte (round(v / 256)) still fits an int8.
constexpr int32_t kInt16Top = 127 * 256 + 127;

// Byte i = 4c + j of a B tile row (column c, k offset j) from two loads of four panel rows (j 0-1 in the
// first, 2-3 in the second; 32 columns a row): vpermt2b's indexes, for column block `block`.
struct TileRowIndex {
  alignas(64) uint8_t at[2][64];
  constexpr TileRowIndex() : at() {
    for (int block = 0; block < 2; ++block)
      for (int i = 0; i < 64; ++i) at[block][i] = (i % 4 / 2) * 64 + (i % 2) * 32 + block * 16 + i / 4;
  }
};
constexpr TileRowIndex kTileRowIndex;

// k-step t (64 k) of one 32-column int8 panel ([k][32], k rows) as its two column blocks' int8 B tiles, 1 KB
// each: tile row r holds k = 64t + 4r to 64t + 4r + 3 of each column side by side, zeros past k.
__attribute__((target("avx512f,avx512bw,avx512vbmi"))) void int8_tile_step(const int8_t* panel, int64_t k, int64_t t,
                                                                           int8_t* block0, int8_t* block1) {
  constexpr int64_t kAhead = 4096;  // bytes of the panel prefetched ahead (from memory, one stream)
  const __m512i index0 = _mm512_load_si512(kTileRowIndex.at[0]), index1 = _mm512_load_si512(kTileRowIndex.at[1]);
  for (int64_t r = 0; r < kTileRows; ++r) {
    const int64_t kk = t * 2 * kTileK + 4 * r;
    const int8_t* at = panel + kk * kPairCols;
    __m512i first, second;  // panel rows kk, kk + 1 and kk + 2, kk + 3
    if (kk + 4 <= k) {
      _mm_prefetch(reinterpret_cast<const char*>(at) + kAhead, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(at) + kAhead + 64, _MM_HINT_T0);
      first = _mm512_loadu_si512(at);
      second = _mm512_loadu_si512(at + 2 * kPairCols);
    } else {
      const auto bytes = [&](int64_t from) {  // a mask of the bytes of rows from .. from + 1 that lie within k
        const int64_t n = std::clamp<int64_t>((k - from) * kPairCols, 0, 64);
        return n == 64 ? ~__mmask64{0} : (__mmask64{1} << n) - 1;
      };
      first = _mm512_maskz_loadu_epi8(bytes(kk), at);
      second = _mm512_maskz_loadu_epi8(bytes(kk + 2), at + 2 * kPairCols);
    }
    _mm512_storeu_si512(block0 + 64 * r, _mm512_permutex2var_epi8(first, index0, second));
    _mm512_storeu_si512(block1 + 64 * r, _mm512_permutex2var_epi8(first, index1, second));
  }
}

// The first n of 16 lanes (all 16 from n = 16 on).
inline __mmask16 first_lanes(int64_t n) { return n >= 16 ? __mmask16{0xffff} : static_cast<__mmask16>((1u << n) - 1); }

// One row of x (k fp32) as int8 tiles take it: its high bytes at hi, low at lo, zero from k to `width`; its
// scale (largest magnitude / kInt16Top) at *scale: NaN where the row holds one, so its products are NaN.
__attribute__((target("avx512f,avx512bw"))) void split_row(const float* x, int64_t k, int64_t width, int8_t* hi,
                                                           int8_t* lo, float* scale) {
  __m512 top = _mm512_setzero_ps();
  __mmask16 nan = 0;  // vmaxps drops a NaN met before the last step
  for (int64_t i = 0; i < k; i += 16) {
    const __m512 v = _mm512_maskz_loadu_ps(first_lanes(k - i), x + i);
    top = _mm512_max_ps(top, _mm512_abs_ps(v));
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  }
  const float largest = nan ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(top);
  *scale = largest / kInt16Top;
  const __m512 inverse = _mm512_set1_ps(largest > 0 ? kInt16Top / largest : 0.f);
  const __m512i limit = _mm512_set1_epi32(kInt16Top), half = _mm512_set1_epi32(128);
  for (int64_t i = 0; i < k; i += 16) {
    const __mmask16 mask = first_lanes(k - i);
    __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(mask, x + i), inverse));  // to nearest even
    v = _mm512_max_epi32(_mm512_min_epi32(v, limit), _mm512_sub_epi32(_mm512_setzero_si512(), limit));
    const __m512i high = _mm512_srai_epi32(_mm512_add_epi32(v, half), 8);  // round(v / 256), halves up
    _mm512_mask_cvtepi32_storeu_epi8(hi + i, mask, high);
    _mm512_mask_cvtepi32_storeu_epi8(lo + i, mask, _mm512_sub_epi32(v, _mm512_slli_epi32(high, 8)));
  }
  std::memset(hi + k, 0, width - k);
  std::memset(lo + k, 0, width - k);
}

constexpr int64_t kPassRows = 2 * kTileRows;  // rows of x per pass: C tiles 0-1 hold the first 16, 2-3 the rest
constexpr int64_t kInt8StepBytes = 2 * kTileElems * 2;  // a k-step's int8 B tiles, both column blocks (64 k)
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

// Tile c += tile a . tile b: int8 products summed in int32 (tdpbssd), else bf16 pairs in fp32 (tdpbf16ps).
// A macro: the intrinsics name their tiles by literal numbers.
#define TILE_DOT(c, a, b)                     \
  do {                                        \
    if constexpr (kInt8) _tile_dpbssd(c, a, b); \
    else _tile_dpbf16ps(c, a, b);             \
  } while (0)

// C[RT row tiles x CT column blocks], stored to c (32 sums a row), = A . B over kb k-steps, added
// to the C that c holds with `accumulate` (an earlier K chunk's), else from zero. A's
// second row tile starts a_tile bytes after its first, rows a_stride bytes apart; b_tiles(k) gives
// the two B tiles of k-step k (column blocks 0 and 1, 64-byte rows), fetching or making them.
template <int RT, int CT, bool kInt8, typename BTiles>
__attribute__((target("amx-tile,amx-bf16,amx-int8"))) void block(const char* a, int64_t a_tile, int64_t a_stride,
                                                                  int64_t kb, const BTiles& b_tiles,
                                                                  std::conditional_t<kInt8, int32_t, float>* c,
                                                                  bool accumulate) {
  constexpr int64_t c_stride = kPairCols * sizeof(*c);
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
    TILE_DOT(0, 4, 6);
    if (CT > 1) {
      _tile_loadd(7, b1, 64);
      TILE_DOT(1, 4, 7);
    }
    if (RT > 1) {
      _tile_loadd(5, ak + a_tile, a_stride);
      TILE_DOT(2, 5, 6);
      if (CT > 1) TILE_DOT(3, 5, 7);
    }
  }
  constexpr int64_t stride = kPairCols * sizeof(*c);
  _tile_stored(0, c, stride);
  if (CT > 1) _tile_stored(1, c + kTileN, stride);
  if (RT > 1) _tile_stored(2, c + kTileRows * kPairCols, stride);
  if (RT > 1 && CT > 1) _tile_stored(3, c + kTileRows * kPairCols + kTileN, stride);
}
#undef TILE_DOT

// y = x . w.T for x's bf16 rows at a (a_stride bytes apart, K padded to kb tiles) and a weight in nb
// column blocks of bf16 tiles packed by amx_pack. Each pair of column blocks runs every 32-row pass in
// turn (K in chunks where x's rows and the pair outgrow kL2Budget, every pass over each chunk, C kept
// between chunks: the same sums in the same order). store(r0, rows, j, cols, c) writes a pass's block
// of C (rows x cols, 32 floats a row) for rows r0.. and columns from block j on.
template <typename Store>
void run_tiles(const char* a, int64_t a_stride, int64_t m, const void* packed, int64_t nb, int64_t kb, int64_t n,
               const Store& store) {
  const int64_t passes = (m + kPassRows - 1) / kPassRows, a_tile = kTileRows * a_stride;
  const int64_t block_bytes = kb * kTileBytes;  // one column block's tiles in bf16
  // with several passes, K in chunks whose x rows and pair weight fit the L2 budget, so the later
  // passes find the pair's weight still there (at 64 rows and K = 11008 they did not)
  const int64_t step_bytes = passes * kPassRows * kTileK * 2 + 2 * kTileBytes;
  const int64_t chunks = passes == 1 ? 1 : std::max<int64_t>(1, (kb * step_bytes + kL2Budget - 1) / kL2Budget);
  const int64_t chunk_steps = (kb + chunks - 1) / chunks;
  parallel_split((nb + 1) / 2, [&](int64_t first, int64_t last) {  // inside DecodeLayers' team: its share
    thread_local std::vector<float> cbuf;  // each pass's block of C
    if (static_cast<int64_t>(cbuf.size()) < passes * kPassRows * kPairCols)
      cbuf.resize(passes * kPassRows * kPairCols);
    int64_t configured = -1;  // the rows of the pass the tiles are configured for
    for (int64_t pair = first; pair < last; ++pair) {
      const int64_t j = 2 * pair, blocks = std::min<int64_t>(2, nb - j);
      const char* b0 = static_cast<const char*>(packed) + j * block_bytes;  // the pair's tiles, block 1 after 0
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
              if (blocks == 2) block<2, 2, false>(arows, a_tile, a_stride, steps, b_tiles, c, t0 > 0);
              else block<2, 1, false>(arows, a_tile, a_stride, steps, b_tiles, c, t0 > 0);
            } else {
              if (blocks == 2) block<1, 2, false>(arows, a_tile, a_stride, steps, b_tiles, c, t0 > 0);
              else block<1, 1, false>(arows, a_tile, a_stride, steps, b_tiles, c, t0 > 0);
            }
          };
          const auto stored = [&](int64_t t) {
            return std::pair(b0 + (t0 + t) * kTileBytes, b0 + block_bytes + (t0 + t) * kTileBytes);
          };
          if (pass == 0) {  // the weight from memory: prefetched ahead
            run([&](int64_t t) {
              const char* ahead0 = b0 + (t0 + t + kPrefetchTiles) * kTileBytes;
              const char* ahead1 = ahead0 + block_bytes;
              for (int line = 0; line < 16; ++line) {
                _mm_prefetch(ahead0 + 64 * line, _MM_HINT_T0);
                if (blocks > 1) _mm_prefetch(ahead1 + 64 * line, _MM_HINT_T0);
              }
              return stored(t);
            });
          } else if (last_chunk && pair + 1 < last) {  // later passes read the pair from L2:
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
          } else {  // a chunk before the last, and the thread's last pair: in L2
            run(stored);
          }
          if (last_chunk) store(r0, rows, j, cols, c);
        }
      }
    }
    release_tiles();
  });
}

// y = x . (q * scale).T on int8 tiles for x split by split_row at a (a_stride bytes a row; group g of 16 rows
// at a + 32 g rows: their high bytes, then their low) and q in nb column blocks of 32-column int8 panels. A
// pass is 16 rows (C tiles 0-1 their high sums, 2-3 their low), and each pair of column blocks runs every pass
// in turn: the first turns each k-step's panel rows into B tiles just before its tiles use them
// (int8_tile_step), into two L1 slots in turn with one pass, else into a copy of the pair that stays in L2 for
// the later passes, which prefetch the next pair's panel into L2 meanwhile. store(r0, rows, j, cols, c) gets
// a pass's sums for rows r0.. and columns from block j on: c's rows 0-15 the high sums, 16-31 the low, 32
// int32 a row.
template <typename Store>
void run_int8_tiles(const char* a, int64_t a_stride, int64_t m, const int8_t* panels, int64_t nb, int64_t kb,
                    int64_t k, int64_t n, const Store& store) {
  const int64_t passes = (m + kTileRows - 1) / kTileRows, a_tile = kTileRows * a_stride, panel_bytes = k * kPairCols;
  const int64_t slots = passes == 1 ? 2 : kb;
  // lines of the next pair's panel prefetched per k-step of a later pass: all of it over those passes
  const int64_t lines = passes == 1 ? 0 : (panel_bytes / 64 + (passes - 1) * kb - 1) / ((passes - 1) * kb);
  parallel_split((nb + 1) / 2, [&](int64_t first, int64_t last) {
    thread_local std::vector<char> sums_buffer, tiles_buffer;
    int32_t* cbuf = aligned_buffer<int32_t>(sums_buffer, passes * kPassRows * kPairCols);  // each pass's block of C
    int8_t* tiles = aligned_buffer<int8_t>(tiles_buffer, slots * kInt8StepBytes);  // the pair's B tiles
    int64_t configured = -1;  // the rows of the pass the tiles are configured for
    for (int64_t pair = first; pair < last; ++pair) {
      const int64_t j = 2 * pair, blocks = std::min<int64_t>(2, nb - j), cols = std::min(kPairCols, n - j * kTileN);
      const int8_t* panel = panels + pair * panel_bytes;
      const char* next = pair + 1 < last ? reinterpret_cast<const char*>(panel + panel_bytes) : nullptr;
      for (int64_t pass = 0; pass < passes; ++pass) {
        const int64_t r0 = pass * kTileRows, rows = std::min(kTileRows, m - r0);
        int32_t* c = cbuf + pass * kPassRows * kPairCols;
        if (rows != configured) {
          configure(rows, rows);
          configured = rows;
        }
        const auto b_tiles = [&](int64_t t) {
          int8_t* at = tiles + (t % slots) * kInt8StepBytes;
          if (pass == 0) {
            int8_tile_step(panel, k, t, at, at + kInt8StepBytes / 2);
          } else if (next != nullptr) {
            for (int64_t line = 0; line < lines; ++line) {
              const int64_t offset = (((pass - 1) * kb + t) * lines + line) * 64;
              if (offset < panel_bytes) _mm_prefetch(next + offset, _MM_HINT_T1);
            }
          }
          return std::pair(reinterpret_cast<const char*>(at), reinterpret_cast<const char*>(at + kInt8StepBytes / 2));
        };
        const char* arows = a + 2 * r0 * a_stride;
        if (blocks == 2) block<2, 2, true>(arows, a_tile, a_stride, kb, b_tiles, c, false);
        else block<2, 1, true>(arows, a_tile, a_stride, kb, b_tiles, c, false);
        store(r0, rows, j, cols, c);
      }
    }
    release_tiles();
  });
}

// A pass's sums (run_int8_tiles' c: rows x cols) as y = (256 high + low) * row_scale * column_scale, rows ldy apart.
__attribute__((target("avx512f"))) void store_split_sums(const int32_t* c, int64_t rows, int64_t cols,
                                                         const float* row_scale, const float* column_scale, float* y,
                                                         int64_t ldy) {
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t* high = c + r * kPairCols;
    const int32_t* low = high + kTileRows * kPairCols;
    const __m512 scale = _mm512_set1_ps(row_scale[r]);
    for (int64_t q = 0; q < cols; q += kTileN) {
      const __mmask16 mask = first_lanes(cols - q);
      // 256 high is exact, so the FMA rounds as the sum alone would
      const __m512 sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(high + q)), _mm512_set1_ps(256.f),
                                         _mm512_cvtepi32_ps(_mm512_loadu_si512(low + q)));
      const __m512 out = _mm512_mul_ps(_mm512_mul_ps(sum, scale), _mm512_maskz_loadu_ps(mask, column_scale + q));
      _mm512_mask_storeu_ps(y + r * ldy + q, mask, out);
    }
  }
}

}  // namespace

torch::Tensor amx_linear_int8(const torch::Tensor& x, const torch::Tensor& panels, int64_t n,
                              const torch::Tensor& scale) {
  TORCH_CHECK(amx_ready(), "AMX tile state was refused to this process (arch_prctl)");
  check_int8_panels("amx_linear_int8", x, panels, n, scale);
  const int64_t m = x.size(0), k = x.size(1), kb = (k + 2 * kTileK - 1) / (2 * kTileK), nb = (n + kTileN - 1) / kTileN;
  auto out = torch::empty({m, n}, x.options());
  if (m == 0) return out;
  const int64_t width = kb * 2 * kTileK, groups = (m + kTileRows - 1) / kTileRows;
  const auto rows = with_rows(x);
  const auto scales = scale.contiguous();
  thread_local std::vector<char> split_buffer, scale_buffer;
  // x split (each group's rows: every byte written, padding too), and each row's scale
  int8_t* split = aligned_buffer<int8_t>(split_buffer, groups * 2 * kTileRows * width);
  float* step = aligned_buffer<float>(scale_buffer, m);
  at::parallel_for(0, m, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      int8_t* hi = split + ((r / kTileRows) * 2 * kTileRows + r % kTileRows) * width;
      split_row(rows->data_ptr<float>() + r * rows->stride(0), k, width, hi, hi + kTileRows * width, step + r);
    }
  });
  const float* sw = scales.data_ptr<float>();
  float* y = out.data_ptr<float>();
  run_int8_tiles(reinterpret_cast<const char*>(split), width, m, panels.data_ptr<int8_t>(), nb, kb, k, n,
                 [&](int64_t r0, int64_t rows, int64_t j, int64_t cols, const int32_t* c) {
                   store_split_sums(c, rows, cols, step + r0, sw + j * kTileN, y + r0 * n + j * kTileN, n);
                 });
  return out;
}

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
  run_tiles(reinterpret_cast<const char*>(a), lda * 2, m, packed.data_ptr(), nb, kb, n,
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
