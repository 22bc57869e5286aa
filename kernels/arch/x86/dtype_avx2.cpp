// AVX2 / F16C bulk conversions between float32 and the half dtypes (the scalar loops: dtype.cpp).

#include "simd_avx2.h"

namespace flash::avx2 {

namespace {

template <bool BF>
FLASH_AVX2 void load_halves(const uint16_t* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load8h<BF>(src + i));
  for (; i < n; ++i) dst[i] = ldh<BF>(src, int(i));
}

}  // namespace

void load_floats(const uint16_t* src, bool bf16, int64_t n, float* dst) {
  return bf16 ? load_halves<true>(src, n, dst) : load_halves<false>(src, n, dst);
}

FLASH_AVX2 void store_f16(const float* src, int64_t n, uint16_t* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) dst[i] = uint16_t(_cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT));
}

// float16: F16C both ways; bfloat16: round to nearest even on the bits, NaN kept quiet (f32_to_bf16).
FLASH_AVX2 int64_t round_floats(int dtype, float* v, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(v + i);
    __m256 y;
    if (dtype == DT_F16) {
      y = _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
    } else {
      const __m256i b = _mm256_castps_si256(x), hi = _mm256_set1_epi32(int(0xffff0000u));
      const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
      const __m256i r = _mm256_and_si256(_mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), hi);
      const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
      const __m256i q = _mm256_and_si256(_mm256_or_si256(b, _mm256_set1_epi32(0x00400000)), hi);
      y = _mm256_castsi256_ps(_mm256_blendv_epi8(r, q, nan));
    }
    _mm256_storeu_ps(v + i, y);
  }
  return i;
}

}  // namespace flash::avx2
