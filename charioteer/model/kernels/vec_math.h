// Vector math shared by the kernels, so each kernel is written once for two instruction sets.
// The build's -m flags pick one: AVX-512 (16 lanes, tails through mask registers) or AVX2 + FMA
// (8 lanes; tails through maskload/maskstore, which are slow on AMD, so full vectors skip them).
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#if defined(__AVX512F__)

#define CHARIOTEER_ISA "avx512"
using Vec = __m512;
constexpr int64_t kLanes = 16;

// The first n of 16 lanes (none for n <= 0, all for n >= 16): the mask of a row's last vector.
inline __mmask16 lanes(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}

inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vset1(float f) { return _mm512_set1_ps(f); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
// The first n lanes from p (all for n >= kLanes), the others zero (or `fill`); nothing past them is read.
inline Vec vload_n(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(lanes(n), p); }
inline Vec vload_n_or(const float* p, int64_t n, Vec fill) { return _mm512_mask_loadu_ps(fill, lanes(n), p); }
inline void vstore_n(float* p, Vec v, int64_t n) { _mm512_mask_storeu_ps(p, lanes(n), v); }
inline Vec vkeep_n(Vec v, int64_t n) { return _mm512_maskz_mov_ps(lanes(n), v); }  // lanes past n zeroed
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vdiv(Vec a, Vec b) { return _mm512_div_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec vmin(Vec a, Vec b) { return _mm512_min_ps(a, b); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }    // a * b + c, one rounding
inline Vec vfnma(Vec a, Vec b, Vec c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b, one rounding
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
inline float vmax_of(Vec v) { return _mm512_reduce_max_ps(v); }
// Bit i set where lane i is NaN; where a == b among the first n lanes.
inline uint32_t nan_bits(Vec v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q); }
inline uint32_t equal_bits(Vec a, Vec b, int64_t n) { return _mm512_mask_cmp_ps_mask(lanes(n), a, b, _CMP_EQ_OQ); }
inline Vec vround(Vec x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec vpow2_times(Vec p, Vec n) { return _mm512_scalef_ps(p, n); }  // p * 2^n, n integral in [-126, 127]
// kLanes weights widened to fp32, exactly: bf16 (the top half of an fp32's bits) and int8.
inline Vec vload_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline Vec vload_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// kLanes values rounded to bf16 as torch's vectorized .to(bfloat16) does (to nearest even, NaN to 0xFFFF)
// and stored.
inline void vstore_bf16(uint16_t* p, Vec v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i top = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  top = _mm512_mask_mov_epi32(top, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0xFFFF));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(top));
}

#elif defined(__AVX2__) && defined(__FMA__)

#define CHARIOTEER_ISA "avx2"
using Vec = __m256;
constexpr int64_t kLanes = 8;

// The first n of 8 lanes as an all-ones/zero integer mask (none for n <= 0, all for n >= 8).
inline __m256i lanes(int64_t n) {
  const int32_t k = n >= 8 ? 8 : n <= 0 ? 0 : static_cast<int32_t>(n);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset1(float f) { return _mm256_set1_ps(f); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vload_n(const float* p, int64_t n) { return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lanes(n)); }
inline Vec vload_n_or(const float* p, int64_t n, Vec fill) {
  if (n >= 8) return _mm256_loadu_ps(p);
  const __m256i m = lanes(n);
  return _mm256_blendv_ps(fill, _mm256_maskload_ps(p, m), _mm256_castsi256_ps(m));
}
inline void vstore_n(float* p, Vec v, int64_t n) {
  if (n >= 8) _mm256_storeu_ps(p, v);
  else _mm256_maskstore_ps(p, lanes(n), v);
}
inline Vec vkeep_n(Vec v, int64_t n) { return n >= 8 ? v : _mm256_and_ps(v, _mm256_castsi256_ps(lanes(n))); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vdiv(Vec a, Vec b) { return _mm256_div_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec vmin(Vec a, Vec b) { return _mm256_min_ps(a, b); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vfnma(Vec a, Vec b, Vec c) { return _mm256_fnmadd_ps(a, b, c); }
inline float vsum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float vmax_of(Vec v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
inline uint32_t nan_bits(Vec v) { return _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)); }
inline uint32_t equal_bits(Vec a, Vec b, int64_t n) {
  const uint32_t first_n = n >= 8 ? 0xFFu : n <= 0 ? 0u : (1u << n) - 1;
  return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ)) & first_n;
}
inline Vec vround(Vec x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec vpow2_times(Vec p, Vec n) {  // 2^n built in the exponent field, so n must be in [-126, 127]
  const __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(biased, 23)));
}
inline Vec vload_bf16(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline Vec vload_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline void vstore_bf16(uint16_t* p, Vec v) {  // as the AVX-512 one
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i top = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  top = _mm256_blendv_epi8(top, _mm256_set1_epi32(0xFFFF), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1)));
}

#else
#error "build the kernels with -mavx512f -mavx512vl -mavx512bw -mavx512dq -mfma, or with -mavx2 -mfma"
#endif

// kLanes values of a row in fp32 or bf16 (bf16 widened exactly), and n <= kLanes of them (rounded as
// vstore_bf16 on store).
inline Vec vload_row(const float* p) { return vload(p); }
inline Vec vload_row(const uint16_t* p) { return vload_bf16(p); }
inline Vec vload_bf16_n(const uint16_t* p, int64_t n) {
  if (n >= kLanes) return vload_bf16(p);
  alignas(64) uint32_t wide[kLanes] = {};
  for (int64_t i = 0; i < n; ++i) wide[i] = static_cast<uint32_t>(p[i]) << 16;
  return vload(reinterpret_cast<const float*>(wide));
}
inline void vstore_bf16_n(uint16_t* p, Vec v, int64_t n) {
  if (n >= kLanes) return vstore_bf16(p, v);
  uint16_t narrow[kLanes];
  vstore_bf16(narrow, v);
  for (int64_t i = 0; i < n; ++i) p[i] = narrow[i];
}
inline Vec vload_row_n(const float* p, int64_t n) { return vload_n(p, n); }
inline Vec vload_row_n(const uint16_t* p, int64_t n) { return vload_bf16_n(p, n); }
inline void vstore_row_n(float* p, Vec v, int64_t n) { vstore_n(p, v, n); }
inline void vstore_row_n(uint16_t* p, Vec v, int64_t n) { vstore_bf16_n(p, v, n); }

// An online softmax's new running maximum: the larger of `running` and the largest of s[0, valid)
// times `scale` (> 0, so the largest score scales to the largest scaled one).
inline float running_max(const float* s, int64_t valid, float running, float scale) {
  const Vec lowest = vset1(-std::numeric_limits<float>::infinity());
  Vec top = lowest;
  for (int64_t c = 0; c < valid; c += kLanes) top = vmax(top, vload_n_or(s + c, valid - c, lowest));
  return std::max(running, vmax_of(top) * scale);
}

// e^x: Cephes' expf range reduction and polynomial (about 1 ulp). x is clamped to
// [-87.3, 88.37] so that 2^n stays a normal float; very negative scores give a tiny positive
// number rather than 0.
inline Vec exp_ps(Vec x) {
  x = vmin(vmax(x, vset1(-87.33654f)), vset1(88.3762626647949f));
  const Vec n = vround(vmul(x, vset1(1.44269504088896341f)));
  Vec r = vfnma(n, vset1(0.693359375f), x);
  r = vfnma(n, vset1(-2.12194440e-4f), r);
  Vec p = vset1(1.9875691500e-4f);
  p = vfma(p, r, vset1(1.3981999507e-3f));
  p = vfma(p, r, vset1(8.3334519073e-3f));
  p = vfma(p, r, vset1(4.1665795894e-2f));
  p = vfma(p, r, vset1(1.6666665459e-1f));
  p = vfma(p, r, vset1(5.0000001201e-1f));
  p = vfma(vmul(p, r), r, vadd(r, vset1(1.f)));
  return vpow2_times(p, n);
}

// 2^x to within 7.5e-5 relative (a degree-3 fit on [-0.5, 0.5]): for weights that are rounded to bf16
// next (2^-9 relative), at a third of exp_ps's instructions. x is clamped to [-126, 0].
inline Vec exp2_for_bf16(Vec x) {
  x = vmin(vmax(x, vset1(-126.f)), vzero());
  const Vec n = vround(x), f = vsub(x, n);
  Vec p = vfma(vset1(0.05516534f), f, vset1(0.24261065f));
  p = vfma(p, f, vset1(0.69326216f));
  p = vfma(p, f, vset1(0.9999281f));
  return vpow2_times(p, n);
}
