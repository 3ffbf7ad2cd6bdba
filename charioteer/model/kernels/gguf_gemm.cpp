// GEMMs on a GGUF file's own quantized blocks, as llama.cpp runs them: no fp32 copy of the weight.
//
// GGUF stores each weight row in blocks: Q4_1 as two fp16 (d, m) and 32 4-bit q (w = d q + m, 20 bytes:
// 0.625 bytes a weight), Q8_0 as one fp16 d and 32 int8 q (w = d q, 34 bytes), Q5_0 as one fp16 d and 32
// 5-bit q (w = d (q - 16), 22 bytes), and others that gguf_blocks.py turns into these forms exactly (Q4_0 and
// Q4_K's sub-blocks into 4-bit q with fp32 d and m; Q5_1 and Q5_K's into 5-bit q with fp32 d and m; IQ4_NL
// into int8 q with an fp16 d; Q6_K, Q3_K and IQ4_XS into int8 q with an fp32 d per 16 values).
// BlockWeight.pack regroups them by 32 output columns into records of one block of 32 k each,
// [N/32][K/32][record], of seven forms:
//   Q4_1 (640 bytes): d[32] and m[32] fp16, then 8 k quads x 2 column halves x 32 bytes, byte 2c + e of
//        quad u, half h holding q[4u + e] | q[4u + 2 + e] << 4 of column 16h + c;
//   Q4_1 with fp32 scales (768 bytes): d[32] and m[32] fp32, then the nibbles as Q4_1's;
//   Q5_0 (704 bytes): d[32] fp16, the fifth bits, then q's low 4 bits as Q4_1's nibbles: per quad u, half h
//        and nibble s a 32-bit word, its bit 2c + e q's fifth bit for k = 4u + 2s + e of column 16h + c;
//        q - 16 is what is summed;
//   Q5_1 with fp32 scales (896 bytes): d[32] and m[32] fp32, then the fifth bits and nibbles as Q5_0's; q is
//        summed (0 to 31);
//   Q8_0 (1088 bytes): d[32] fp16, then 16 k pairs x 2 halves x 32 bytes, byte 2c + e holding q[2u + e];
//   Q8_0 with two fp32 d a block (1280 bytes, for Q6_K's 16-value sub-blocks): d[32] of k 0-15, d[32] of
//        k 16-31, then the int8 values as Q8_0's, summed in int32 per 16 k;
//   mixed (1536 bytes): the two d as the last form's, then m[32] fp32 of k 0-15 and of k 16-31, then the int8
//        values: any kind's values (Q2_K's d and m per 16 values; a fused weight whose parts share no other
//        form, as a Q4_K Q and K beside a Q6_K V).
// So one 32-byte load (16 bytes on AVX2) widened to int16 (and, for the 4- and 5-bit forms, split into
// nibbles) is 16 (8) columns' (k, k+1) int16 pairs, the operand of vpmaddwd. x is quantized to int16 per
// block of 32 (quantize_rows: off by at most half a step of its block's largest / 32767). Per block and
// column the int32 sum is exact; then y += d * (x scale) * sum (+ m * the block's sum of quantized x where
// there is an m, quantize_rows' sums; in the mixed form each m times its 16 k's), in fp32, block after block in
// k order.
// With int8 activations (BlockWeight.pack's int8_activations, as llama.cpp quantizes x to Q8 for its 4-bit
// kinds), the two 4-bit forms come as [N/32][K/32][record / 128][128]: their d and m, then 4 k octets x 32
// columns x 4 bytes, byte e of column c in octet u holding q[8u + e] | q[8u + 4 + e] << 4. x is quantized to
// int8 per block of 32 (off by at most half a step of its block's largest / 127), and one 64-byte load (32 on
// AVX2) split into its low and high nibbles is 16 (8) columns' four k each as unsigned bytes: vpmaddubsw +
// vpmaddwd (AVX512-VNNI: vpdpbusd) sum a column's four products into an int32. At one row 128 weights take a
// load, three instructions for the nibbles and two vpdpbusd, where int16 products take ten (Zen 4, one thread,
// Q4_1 in L2: 72 against 35 GB/s of records).
// A row's result depends on its own row of x alone, and is the same in both builds (AVX-512: 16 columns a
// vector; AVX2: 8) and with `vnni` (AVX512-VNNI's vpdpwssd for vpmaddwd + vpaddd, vpdpbusd for vpmaddubsw +
// vpmaddwd + vpaddd: the same int32 sums, as no pair of products can overflow them with |x| <= 32767 and
// |q| <= 128, nor vpmaddubsw's int16 with |x| <= 127 and q <= 15).
#include "kernels.h"
#include "vec_math.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <type_traits>
#include <utility>

namespace {

constexpr int64_t kBlock = 32;  // values per GGUF block, and per x scale
constexpr int64_t kCols = 32;   // output columns per panel
constexpr int64_t kQ41Record = 4 * kCols + kBlock * kCols / 2;  // d, m (fp16) and the nibbles
constexpr int64_t kQ80Record = 2 * kCols + kBlock * kCols;      // d (fp16) and the int8 values
constexpr int64_t kQ41F32Record = 8 * kCols + kBlock * kCols / 2;  // d, m (fp32) and the nibbles
constexpr int64_t kQ80HalvesRecord = 8 * kCols + kBlock * kCols;   // d of k 0-15, of k 16-31 (fp32), int8 values
constexpr int64_t kFifthBits = kBlock * kCols / 8;                     // bytes of a 5-bit record's fifth bits
constexpr int64_t kQ50Record = 2 * kCols + kFifthBits + kBlock * kCols / 2;  // d, fifth bits, nibbles
constexpr int64_t kQ51F32Record = 8 * kCols + kFifthBits + kBlock * kCols / 2;  // d, m (fp32), fifth bits, nibbles
constexpr int64_t kMixedRecord = 16 * kCols + kBlock * kCols;                    // two d, two m (fp32), int8 values

// A record's form: its q as nibbles (with a fifth bit or not) or int8, with an offset m or not, its scales in
// fp16 or fp32, one set of d per block of 32 k or (int8 q) one per 16.
// kQ41Q8 and kQ41F32Q8: Q4_1's records as [5 or 6][128] bytes (BlockWeight.pack's int8_activations), for int8 x.
enum class Form { kQ41, kQ80, kQ41F32, kQ80Halves, kQ50, kQ51F32, kMixed, kQ41Q8, kQ41F32Q8 };
template <Form F>
constexpr bool kFifth = F == Form::kQ50 || F == Form::kQ51F32;  // nibbles and a fifth bit
template <Form F>
constexpr bool kQuads = F == Form::kQ41Q8 || F == Form::kQ41F32Q8;  // u8 q times int8 x, four k a lane
template <Form F>
constexpr bool kNibbles = F == Form::kQ41 || F == Form::kQ41F32 || kFifth<F>;
template <Form F>
constexpr bool kOffset = F == Form::kQ41 || F == Form::kQ41F32 || kQuads<F> || F == Form::kQ51F32 || F == Form::kMixed;
template <Form F>
constexpr int kOffsets = !kOffset<F> ? 0 : F == Form::kMixed ? 2 : 1;  // sets of m a block: one per set of d, or one
template <Form F>
constexpr int64_t kScaleBytes = F == Form::kQ41 || F == Form::kQ41Q8 || F == Form::kQ80 || F == Form::kQ50 ? 2 : 4;
template <Form F>
constexpr int kParts = F == Form::kQ80Halves || F == Form::kMixed ? 2 : 1;  // sets of d a block, each its share of k
template <Form F>
constexpr int64_t kRecord = F == Form::kQ41 || F == Form::kQ41Q8 ? kQ41Record
                          : F == Form::kQ41F32 || F == Form::kQ41F32Q8 ? kQ41F32Record
                          : F == Form::kQ80 ? kQ80Record : F == Form::kQ80Halves ? kQ80HalvesRecord
                          : F == Form::kQ50 ? kQ50Record : F == Form::kQ51F32 ? kQ51F32Record : kMixedRecord;

// int16 pairs in vectors of the build's width: kPairLanes columns' (k, k + 1) pairs a vector.
#if defined(__AVX512F__)
using IVec = __m512i;
using Bytes = __m256i;  // what one IVec widens from
constexpr int kPairLanes = 16;
constexpr int kMaxRows = 8;  // rows per pass over a record: 8 x 2 int32 sums in registers
constexpr bool kPrefetch = true;  // prefetch_ahead as the weight streams (kernels.h)
inline Bytes load_bytes(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const Bytes*>(p)); }
inline IVec widen_u8(const uint8_t* p) { return _mm512_cvtepu8_epi16(load_bytes(p)); }
inline IVec widen_s8(const uint8_t* p) { return _mm512_cvtepi8_epi16(load_bytes(p)); }
inline IVec low_nibbles(IVec w) { return _mm512_and_si512(w, _mm512_set1_epi16(0x0F)); }
inline IVec high_nibbles(IVec w) { return _mm512_srli_epi16(w, 4); }
struct MaddSums {  // vpmaddwd, then vpaddd
  static IVec add(IVec sum, IVec w, int32_t x) {
    return _mm512_add_epi32(sum, _mm512_madd_epi16(w, _mm512_set1_epi32(x)));
  }
};
inline IVec izero() { return _mm512_setzero_si512(); }
inline Vec to_float(IVec v) { return _mm512_cvtepi32_ps(v); }
inline Vec load_fp16(const uint8_t* p) { return _mm512_cvtph_ps(load_bytes(p)); }
// 5-bit q - 16 from q's low nibbles: minus 16 where the fifth bit (bit i of `bits` for lane i) is clear.
inline IVec fifth_bits(IVec low, uint32_t bits) {
  return _mm512_mask_sub_epi16(low, _cvtu32_mask32(~bits), low, _mm512_set1_epi16(16));
}
// 5-bit q (0 to 31): plus 16 where the fifth bit is set.
inline IVec fifth_bits_unsigned(IVec low, uint32_t bits) {
  return _mm512_mask_add_epi16(low, _cvtu32_mask32(bits), low, _mm512_set1_epi16(16));
}
#define CHARIOTEER_VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vnni")))
struct DotSums {  // vpdpwssd: the multiply and the add in one instruction
  CHARIOTEER_VNNI_TARGET static IVec add(IVec sum, IVec w, int32_t x) {
    return _mm512_dpwssd_epi32(sum, w, _mm512_set1_epi32(x));
  }
};
inline IVec load_ivec(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline IVec byte_nibbles(IVec w) { return _mm512_and_si512(w, _mm512_set1_epi8(0x0F)); }
inline IVec byte_high_nibbles(IVec w) { return byte_nibbles(_mm512_srli_epi16(w, 4)); }
struct ByteSums {  // u8 q times int8 x: vpmaddubsw's int16 pair sums (at most 2 * 15 * 127: none saturates), vpmaddwd
  static IVec add(IVec sum, IVec w, int32_t x) {
    const IVec pairs = _mm512_maddubs_epi16(w, _mm512_set1_epi32(x));
    return _mm512_add_epi32(sum, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
  }
};
struct ByteDotSums {  // vpdpbusd: the four products and the add in one instruction, the same sums
  CHARIOTEER_VNNI_TARGET static IVec add(IVec sum, IVec w, int32_t x) {
    return _mm512_dpbusd_epi32(sum, w, _mm512_set1_epi32(x));
  }
};
#else
using IVec = __m256i;
using Bytes = __m128i;
constexpr int kPairLanes = 8;
constexpr int kMaxRows = 4;  // 4 x 4 int32 sums: AVX2 has half the registers
constexpr bool kPrefetch = false;  // at half the width the kernel is bound by its arithmetic: 0.94-0.98x with it
inline Bytes load_bytes(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const Bytes*>(p)); }
inline IVec widen_u8(const uint8_t* p) { return _mm256_cvtepu8_epi16(load_bytes(p)); }
inline IVec widen_s8(const uint8_t* p) { return _mm256_cvtepi8_epi16(load_bytes(p)); }
inline IVec low_nibbles(IVec w) { return _mm256_and_si256(w, _mm256_set1_epi16(0x0F)); }
inline IVec high_nibbles(IVec w) { return _mm256_srli_epi16(w, 4); }
struct MaddSums {  // as the AVX-512 one
  static IVec add(IVec sum, IVec w, int32_t x) {
    return _mm256_add_epi32(sum, _mm256_madd_epi16(w, _mm256_set1_epi32(x)));
  }
};
inline IVec izero() { return _mm256_setzero_si256(); }
inline Vec to_float(IVec v) { return _mm256_cvtepi32_ps(v); }
inline Vec load_fp16(const uint8_t* p) { return _mm256_cvtph_ps(load_bytes(p)); }
inline IVec fifth_bits_unsigned(IVec low, uint32_t bits) {  // as the AVX-512 ones, each lane testing its own bit
  const IVec lane = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, -32768);
  const IVec set = _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16(static_cast<int16_t>(bits)), lane), lane);
  return _mm256_add_epi16(low, _mm256_and_si256(set, _mm256_set1_epi16(16)));
}
inline IVec fifth_bits(IVec low, uint32_t bits) {
  return _mm256_sub_epi16(fifth_bits_unsigned(low, bits), _mm256_set1_epi16(16));
}
inline IVec load_ivec(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const IVec*>(p)); }
inline IVec byte_nibbles(IVec w) { return _mm256_and_si256(w, _mm256_set1_epi8(0x0F)); }
inline IVec byte_high_nibbles(IVec w) { return byte_nibbles(_mm256_srli_epi16(w, 4)); }
struct ByteSums {  // as the AVX-512 one
  static IVec add(IVec sum, IVec w, int32_t x) {
    const IVec pairs = _mm256_maddubs_epi16(w, _mm256_set1_epi32(x));
    return _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
};
#endif
constexpr int kVecs = kCols / kPairLanes;       // vectors a panel's columns take
template <Form F>
inline Vec load_scales(const uint8_t* p) {  // kPairLanes columns' d or m
  if constexpr (kScaleBytes<F> == 4) return vload(reinterpret_cast<const float*>(p));
  else return load_fp16(p);
}
constexpr int64_t kStep = 2 * kCols / kVecs;    // bytes of one vector's columns in a k quad (Q4_1) or pair (Q8_0)

// Rows [0, R) of x (int16 pairs, kp apart; scales `blocks` apart, sums `blocks` * kOffsets apart) times one
// panel's `blocks` records, into y's first `cols` columns, the int16 pairs' products summed by Sums::add.
// `stream`: the panel comes from memory (the first row block), to prefetch ahead; later ones find it in L2.
template <int R, Form F, typename Sums>
__attribute__((always_inline)) inline void panel_body(const int32_t* pairs, int64_t kp, const float* xscale,
                                                      const float* xsum, int64_t blocks, const uint8_t* panel,
                                                      bool stream, float* y, int64_t ldy, int64_t cols) {
  constexpr int64_t record = kRecord<F>, scales = kScaleBytes<F> * kCols;  // bytes of one set of d (or m)
  Vec total[R][kVecs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVecs; ++v) total[r][v] = vzero();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* rec = panel + b * record;
    if (stream)
      for (int64_t line = 0; line < record; line += 64) prefetch_ahead(rec + line);
    const int32_t* xp = pairs + b * kBlock / (kQuads<F> ? 4 : 2);  // x's int8 quads or int16 pairs
    for (int part = 0; part < kParts<F>; ++part) {  // the k (pairs or quads) its d scales
      IVec sum[R][kVecs];
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < kVecs; ++v) sum[r][v] = izero();
      if constexpr (kQuads<F>) {  // k octet u: one byte a column and k 8u + e (low nibble), 8u + 4 + e (high)
        const uint8_t* q = rec + (kParts<F> + kOffsets<F>) * scales;
        for (int64_t u = 0; u < kBlock / 8; ++u)
          for (int v = 0; v < kVecs; ++v) {
            const IVec w = load_ivec(q + 4 * kCols * u + 4 * kPairLanes * v);
            const IVec low = byte_nibbles(w), high = byte_high_nibbles(w);
            for (int r = 0; r < R; ++r)
              sum[r][v] = Sums::add(Sums::add(sum[r][v], low, xp[r * kp + 2 * u]), high, xp[r * kp + 2 * u + 1]);
          }
      } else if constexpr (kNibbles<F>) {
        const uint8_t* bits = rec + (kParts<F> + kOffsets<F>) * scales;  // the fifth bits, after d (and m)
        const uint8_t* q = bits + (kFifth<F> ? kFifthBits : 0);
        for (int64_t u = 0; u < kBlock / 4; ++u)
          for (int v = 0; v < kVecs; ++v) {
            const IVec w = widen_u8(q + 2 * kCols * u + kStep * v);
            IVec a = low_nibbles(w), c = high_nibbles(w);
            if constexpr (kFifth<F>) {  // the word of the vector's half; AVX2's 8 columns: 16 of its bits
              const int64_t half = kPairLanes * v / 16, shift = kPairLanes * v % 16 * 2;
              uint32_t low_bits, high_bits;
              std::memcpy(&low_bits, bits + 4 * (4 * u + 2 * half), 4);
              std::memcpy(&high_bits, bits + 4 * (4 * u + 2 * half + 1), 4);
              if constexpr (kOffset<F>) {
                a = fifth_bits_unsigned(a, low_bits >> shift);
                c = fifth_bits_unsigned(c, high_bits >> shift);
              } else {
                a = fifth_bits(a, low_bits >> shift);
                c = fifth_bits(c, high_bits >> shift);
              }
            }
            for (int r = 0; r < R; ++r)
              sum[r][v] = Sums::add(Sums::add(sum[r][v], a, xp[r * kp + 2 * u]), c, xp[r * kp + 2 * u + 1]);
          }
      } else {
        const uint8_t* q = rec + (kParts<F> + kOffsets<F>) * scales;
        constexpr int64_t share = kBlock / 2 / kParts<F>;
        for (int64_t u = part * share; u < (part + 1) * share; ++u)
          for (int v = 0; v < kVecs; ++v) {
            const IVec w = widen_s8(q + 2 * kCols * u + kStep * v);
            for (int r = 0; r < R; ++r) sum[r][v] = Sums::add(sum[r][v], w, xp[r * kp + u]);
          }
      }
      for (int v = 0; v < kVecs; ++v) {
        const Vec d = load_scales<F>(rec + part * scales + kScaleBytes<F> * kPairLanes * v);
        for (int r = 0; r < R; ++r)
          total[r][v] = vfma(to_float(sum[r][v]), vmul(d, vset1(xscale[r * blocks + b])), total[r][v]);
        if constexpr (kOffsets<F> == 2) {  // each set of d's own m, times its k's sum of quantized x
          const Vec m = load_scales<F>(rec + (kParts<F> + part) * scales + kScaleBytes<F> * kPairLanes * v);
          for (int r = 0; r < R; ++r) total[r][v] = vfma(m, vset1(xsum[(r * blocks + b) * 2 + part]), total[r][v]);
        } else if constexpr (kOffsets<F> == 1) {
          if (part + 1 == kParts<F>) {  // m after every set of d
            const Vec m = load_scales<F>(rec + kParts<F> * scales + kScaleBytes<F> * kPairLanes * v);
            for (int r = 0; r < R; ++r) total[r][v] = vfma(m, vset1(xsum[r * blocks + b]), total[r][v]);
          }
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVecs; ++v) vstore_n(y + r * ldy + kPairLanes * v, total[r][v], cols - kPairLanes * v);
}

template <int R, Form F>
void panel_rows(const int32_t* pairs, int64_t kp, const float* xscale, const float* xsum, int64_t blocks,
                const uint8_t* panel, bool stream, float* y, int64_t ldy, int64_t cols) {
  panel_body<R, F, std::conditional_t<kQuads<F>, ByteSums, MaddSums>>(pairs, kp, xscale, xsum, blocks, panel, stream,
                                                                      y, ldy, cols);
}

using PanelRows = void (*)(const int32_t*, int64_t, const float*, const float*, int64_t, const uint8_t*, bool,
                           float*, int64_t, int64_t);
using RowKernels = std::array<PanelRows, kMaxRows + 1>;  // by row count, 1 to kMaxRows

template <Form F, int... R>
constexpr RowKernels by_rows(std::integer_sequence<int, R...>) {
  return {nullptr, panel_rows<R + 1, F>...};
}
template <Form F>
constexpr RowKernels kRows = by_rows<F>(std::make_integer_sequence<int, kMaxRows>());

#if defined(__AVX512F__)
template <int R, Form F>
CHARIOTEER_VNNI_TARGET void panel_rows_vnni(const int32_t* pairs, int64_t kp, const float* xscale, const float* xsum,
                                            int64_t blocks, const uint8_t* panel, bool stream, float* y, int64_t ldy,
                                            int64_t cols) {
  panel_body<R, F, std::conditional_t<kQuads<F>, ByteDotSums, DotSums>>(pairs, kp, xscale, xsum, blocks, panel,
                                                                         stream, y, ldy, cols);
}

template <Form F, int... R>
constexpr RowKernels by_rows_vnni(std::integer_sequence<int, R...>) {
  return {nullptr, panel_rows_vnni<R + 1, F>...};
}
template <Form F>
constexpr RowKernels kRowsVnni = by_rows_vnni<F>(std::make_integer_sequence<int, kMaxRows>());
#endif

// What gguf_linear needs of a form, found by its record's size: its sets of m a block (x's sums over each
// set's k are needed) and its row kernels (the AVX-512 build's also with vpdpwssd).
struct FormKernels {
  int64_t record;
  int offsets;
  bool quads;  // x as int8 quads (the 4-bit forms' int8-activation records), else as int16 pairs
  const RowKernels* rows;
  const RowKernels* rows_vnni;  // nullptr in the AVX2 build
};
template <Form F>
constexpr FormKernels form_kernels() {
#if defined(__AVX512F__)
  return {kRecord<F>, kOffsets<F>, kQuads<F>, &kRows<F>, &kRowsVnni<F>};
#else
  return {kRecord<F>, kOffsets<F>, kQuads<F>, &kRows<F>, nullptr};
#endif
}
constexpr std::array<FormKernels, 9> kForms = {
    form_kernels<Form::kQ41>(),  form_kernels<Form::kQ80>(),    form_kernels<Form::kQ41F32>(),
    form_kernels<Form::kQ80Halves>(), form_kernels<Form::kQ50>(), form_kernels<Form::kQ51F32>(),
    form_kernels<Form::kMixed>(), form_kernels<Form::kQ41Q8>(), form_kernels<Form::kQ41F32Q8>()};

// A packed weight's form: [N/32, K/32, record] for int16 x, [N/32, K/32, record / 128, 128] for int8 x (a 4-bit
// form's records, repacked for it), else nullptr.
const FormKernels* form_of(const torch::Tensor& packed) {
  const bool quads = packed.dim() == 4;
  if (!(packed.dim() == 3 || (quads && packed.size(3) == 128))) return nullptr;
  const int64_t record = quads ? packed.size(2) * 128 : packed.size(2);
  for (const FormKernels& form : kForms)
    if (form.record == record && form.quads == quads) return &form;
  return nullptr;
}

}  // namespace

void gguf_linear_into(const torch::Tensor& x, const torch::Tensor& packed, int64_t n, bool vnni,
                      const torch::Tensor& y) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.stride(1) == 1,
              "gguf_linear: x must be fp32 [M, K] with contiguous rows");
  const FormKernels* form = form_of(packed);
  TORCH_CHECK(form != nullptr && packed.scalar_type() == torch::kByte && packed.is_contiguous(),
              "gguf_linear: the weight must come from BlockWeight.pack ([N/32, K/32, record] uint8, or a 4-bit "
              "form's [N/32, K/32, record / 128, 128])");
  const int64_t m = x.size(0), k = x.size(1), blocks = packed.size(1);
  TORCH_CHECK(k == blocks * kBlock, "gguf_linear: x has ", k, " columns, the weight ", blocks * kBlock);
  TORCH_CHECK(0 < n && n <= packed.size(0) * kCols && n > (packed.size(0) - 1) * kCols,
              "gguf_linear: n = ", n, " does not match the weight's ", packed.size(0), " panels");
#if !defined(__AVX512F__)
  TORCH_CHECK(!vnni, "gguf_linear: vnni is in the avx512 build only (cpu_kernels.vnni_unavailable_reason)");
#endif
  check_output("gguf_linear", y, {m, n}, x.options(), x, packed);
  if (m == 0) return;
  const int64_t offsets = form->offsets;  // sets of m a block: x's sums over their k are needed
  const int64_t kp = form->quads ? k / 4 : k / 2;  // int32 a row of x: int8 quads or int16 pairs
  const QuantizedRows quantized = quantized_rows_buffers(m, kp, blocks, blocks * offsets);
  float* sums = quantized.sums;  // quantized x's sums for the m terms: per block, or per 16 values (mixed form)
  quantize_rows(x.data_ptr<float>(), x.stride(0), m, k, kBlock, quantized.pairs, quantized.scales, sums,
                std::max<int64_t>(offsets, 1), form->quads);
  const int32_t* pp = quantized.pairs;
  const float* xs = quantized.scales;
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const int64_t panel_bytes = blocks * form->record;
  const RowKernels& kernel = vnni ? *form->rows_vnni : *form->rows;  // vnni: the avx512 build, checked above
  float* yp = y.data_ptr<float>();
  parallel_split(packed.size(0), [&](int64_t first, int64_t last) {
    for (int64_t j = first; j < last; ++j) {
      const int64_t cols = std::min(n - j * kCols, kCols);
      for (int64_t r0 = 0; r0 < m; r0 += kMaxRows) {
        const int64_t rows = std::min<int64_t>(kMaxRows, m - r0);
        const float* row_sums = sums ? sums + r0 * blocks * offsets : nullptr;
        kernel[rows](pp + r0 * kp, kp, xs + r0 * blocks, row_sums, blocks, w + j * panel_bytes, kPrefetch && r0 == 0,
                     yp + r0 * n + j * kCols, n, cols);
      }
    }
  });
}

torch::Tensor gguf_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n, bool vnni,
                          const c10::optional<torch::Tensor>& out) {
  TORCH_CHECK(x.dim() == 2, "gguf_linear: x must be fp32 [M, K] with contiguous rows");
  auto y = given_or_empty(out, {x.size(0), std::max<int64_t>(n, 0)}, x.options());  // n checked next
  gguf_linear_into(x, packed, n, vnni, y);
  return y;
}
