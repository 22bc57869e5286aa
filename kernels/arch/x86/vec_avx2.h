// The AVX2 / FMA versions of vec_scalar.h's loops (same names), plus the attention value tiles.
// Inline: the layer ops call them per row.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "../../vec_scalar.h"
#include "simd_avx2.h"

namespace flash::avx2 {

FLASH_AVX2 inline float dot(const float* a, const float* b, int n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
  }
  for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
  float s = hsum(_mm256_add_ps(s0, s1));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}
FLASH_AVX2 inline void axpy(float w, const float* x, float* y, int n) {
  const __m256 wv = _mm256_set1_ps(w);
  int i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += w * x[i];
}
// Attention tiles for blocks of queries (prompts); the scores are flash::dot_tiles.
// Weighted values: acc[t * Dv + d] = sum_j p[t * ld + j] * v[j * Dv + d] over j < nk, for 4 queries
// x 16 columns per register tile (Dv a multiple of 16). j ascending, one FMA each: the same sums
// as axpy over j.
FLASH_AVX2 inline void values_tiles(const float* p, int ld, int nq, const float* v, int nk, int Dv, float* acc) {
  for (int t0 = 0; t0 < nq; t0 += 4) {
    const float* pr[4];
    for (int a = 0; a < 4; ++a) pr[a] = p + int64_t(std::min(t0 + a, nq - 1)) * ld;
    for (int d0 = 0; d0 < Dv; d0 += 16) {
      __m256 a0[4], a1[4];
      for (int a = 0; a < 4; ++a) { a0[a] = _mm256_setzero_ps(); a1[a] = _mm256_setzero_ps(); }
      for (int j = 0; j < nk; ++j) {
        const __m256 v0 = _mm256_loadu_ps(v + int64_t(j) * Dv + d0), v1 = _mm256_loadu_ps(v + int64_t(j) * Dv + d0 + 8);
        for (int a = 0; a < 4; ++a) {
          const __m256 w = _mm256_broadcast_ss(pr[a] + j);
          a0[a] = _mm256_fmadd_ps(w, v0, a0[a]);
          a1[a] = _mm256_fmadd_ps(w, v1, a1[a]);
        }
      }
      for (int a = 0; a < 4 && t0 + a < nq; ++a) {
        _mm256_storeu_ps(acc + int64_t(t0 + a) * Dv + d0, a0[a]);
        _mm256_storeu_ps(acc + int64_t(t0 + a) * Dv + d0 + 8, a1[a]);
      }
    }
  }
}
// c[0] x^(N-1) + ... + c[N-1] for 8 floats by Horner's rule, one fused multiply-add a step.
template <int N>
FLASH_AVX2 inline __m256 horner8(__m256 x, const float (&c)[N]) {
  __m256 y = _mm256_set1_ps(c[0]);
  for (int i = 1; i < N; ++i) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(c[i]));
  return y;
}
// exp(x) for 8 floats (Cephes' expf: x = n ln2 + r, |r| <= ln2/2, degree-5 polynomial; ~1 ulp).
// Below ln(FLT_MIN) the result is 0 (2^n would need an exponent field < 1: n = -128 gave -inf).
FLASH_AVX2 inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3365447505531f);  // ln(FLT_MIN)
  const __m256 normal = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = horner8(x, {1.9875691500E-4f, 1.3981999507E-3f, 8.3334519073E-3f, 4.1665795894E-2f,
                         1.6666665459E-1f, 5.0000001201E-1f});
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), normal);
}
// scalar::mlx_exp for 8 floats, bit for bit: the same operations in the same order (std::fma is
// one rounding, as _mm256_fmadd_ps), then its NaN / overflow / underflow cases.
FLASH_AVX2 inline __m256 mlx_exp8(__m256 x) {
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.442695f));
  const __m256 ipart = _mm256_floor_ps(_mm256_add_ps(t, _mm256_set1_ps(0.5f)));
  const __m256 fpart = _mm256_sub_ps(t, ipart);
  const __m256 y = horner8(fpart, {1.535336188319500e-4f, 1.339887440266574e-3f, 9.618437357674640e-3f,
                                   5.550332471162809e-2f, 2.402264791363012e-1f, 6.931472028550421e-1f,
                                   1.000000000000000f});
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(ipart), _mm256_set1_epi32(127)), 23);
  __m256 r = _mm256_mul_ps(_mm256_castsi256_ps(bits), y);
  const __m256 lim = _mm256_set1_ps(88.72283905206835f);
  r = _mm256_blendv_ps(r, _mm256_set1_ps(std::numeric_limits<float>::infinity()), _mm256_cmp_ps(x, lim, _CMP_GT_OQ));
  r = _mm256_blendv_ps(r, _mm256_setzero_ps(), _mm256_cmp_ps(x, _mm256_sub_ps(_mm256_setzero_ps(), lim), _CMP_LT_OQ));
  return _mm256_blendv_ps(r, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}
// e[i] = scalar::mlx_exp(|x[i]|) for i < n
FLASH_AVX2 inline void mlx_exp_abs(const float* x, float* e, int64_t n) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(e + i, mlx_exp8(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i))));
  for (; i < n; ++i) e[i] = scalar::mlx_exp(std::fabs(x[i]));
}
// g[i] = silu(g[i]) * u[i] = g / (1 + exp(-g)) * u for i < n (the scalar form for the tail).
FLASH_AVX2 inline void silu_mul(float* g, const float* u, int n) {
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(g + i);
    const __m256 d = _mm256_add_ps(one, exp8(_mm256_xor_ps(v, sign)));
    _mm256_storeu_ps(g + i, _mm256_mul_ps(_mm256_div_ps(v, d), _mm256_loadu_ps(u + i)));
  }
  for (; i < n; ++i) g[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}
// p[j] = exp(p[j] - m) for j < n; returns their sum.
FLASH_AVX2 inline float exp_shift_sum(float* p, int n, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256 s = _mm256_setzero_ps();
  int j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + j), mv));
    _mm256_storeu_ps(p + j, e);
    s = _mm256_add_ps(s, e);
  }
  float sum = hsum(s);
  for (; j < n; ++j) sum += (p[j] = std::exp(p[j] - m));
  return sum;
}

}  // namespace flash::avx2
