// Inline AVX2 / FMA / F16C helpers shared by the AVX2 kernels: 8 lanes of a float dtype as float32,
// single half values with F16C, horizontal sums, a row's bias term. Only called from FLASH_AVX2
// functions and (the int8-activation kernel, for the avx2 one's float sums) from the AVX-512 ones.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "../../cpu_features.h"
#include "../../dtype.h"
#include "../../matvec.h"

namespace flash::avx2 {

FLASH_AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Element i of a scale-like array of dtype ST (F16C's conversion for float16).
template <int ST>
FLASH_AVX2 inline float ldv(const void* base, int64_t i) {
  if constexpr (ST == DT_F16) return _cvtsh_ss(static_cast<const uint16_t*>(base)[i]);
  else return ld<ST>(base, i);
}

// store_out with F16C's conversion for float16 outputs (one instruction, round to nearest even as
// f32_to_f16; the software routine per output element would weigh on small matvecs).
FLASH_AVX2 inline void store_out_simd(void* base, int dtype, int64_t i, float v) {
  if (dtype == DT_F16) static_cast<uint16_t*>(base)[i] = uint16_t(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT));
  else store_out(base, dtype, i, v);
}

// 8 scale-like values of dtype ST starting at element i, as float32.
template <int ST>
FLASH_AVX2 inline __m256 load8s(const void* base, int64_t i) {
  if constexpr (ST == DT_F16) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i)));
  else if constexpr (ST == DT_BF16)
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i))), 16));
  else return _mm256_loadu_ps(static_cast<const float*>(base) + i);
}

// 8 half values (bfloat16 when BF, else float16) as float32.
template <bool BF>
FLASH_AVX2 inline __m256 load8h(const uint16_t* w) {
  __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  if constexpr (BF) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
  else return _mm256_cvtph_ps(v);
}

// a * b + c rounded once (std::fma is a libm call in a function built for another target).
FLASH_AVX2 inline float fma1(float a, float b, float c) {
  return _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(a), _mm_set_ss(b), _mm_set_ss(c)));
}

// sum_g (b_g [+ 128 s_g for the int8-activation 8-bit path: Q4 = false]) * xsum_g over a row's G groups.
// The tail's fused multiply-adds are explicit: left to contraction, the compiler fused them in one
// caller and vectorized the products apart in another (the AVX-512 int8 kernel, which must match).
template <int ST, bool Q4>
FLASH_AVX2 inline float row_bias_dot(const Problem& p, int64_t sb, const float* xsum, int G) {
  __m256 acc = _mm256_setzero_ps();
  int g = 0;
  for (; g + 8 <= G; g += 8) {
    __m256 b = load8s<ST>(p.biases, sb + g);
    if constexpr (!Q4) b = _mm256_fmadd_ps(_mm256_set1_ps(128.f), load8s<ST>(p.scales, sb + g), b);
    acc = _mm256_fmadd_ps(b, _mm256_loadu_ps(xsum + g), acc);
  }
  float t = hsum(acc);
  for (; g < G; ++g) {
    float b = ldv<ST>(p.biases, sb + g);
    if constexpr (!Q4) b = fma1(128.f, ldv<ST>(p.scales, sb + g), b);
    t = fma1(b, xsum[g], t);
  }
  return t;
}

template <bool BF>
FLASH_AVX2 inline float ldh(const uint16_t* w, int k) {
  if constexpr (BF) return bf16_to_f32(w[k]);
  else return _cvtsh_ss(w[k]);
}

}  // namespace flash::avx2
