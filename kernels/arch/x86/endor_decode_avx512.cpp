// ENDOR row kernels for AVX-512 with VBMI2 (the scalar reference: endor_decode.cpp; AVX2:
// endor_decode_avx2.cpp). vpexpandw / vpexpandd spread the next popcount(mask) stored values over
// the mask's set lanes and zero the rest in one instruction, so a 16-bit row expands 32 elements
// (4 bitmap bytes) per step with no shuffle table.

#include <immintrin.h>

#include <cstring>

#include "../../endor_decode.h"

// Every function here is only called when cpu_features found all of these (Isa::avx512).
#define ENDOR_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi2,popcnt,avx2,fma,f16c")))

namespace flash::avx512 {

namespace {

// Bits [j, j + 32) of the bitmap (bit j = lowest), reading no byte at or past byte nb.
inline uint32_t mask32(const uint8_t* bitmap, int64_t j, int64_t nb) {
  uint32_t m = 0;
  const int64_t b = j >> 3, have = nb - b;
  std::memcpy(&m, bitmap + b, have >= 4 ? 4 : static_cast<size_t>(have));
  return m;
}

}  // namespace

ENDOR_AVX512 int64_t endor_expand16(const uint8_t* bitmap, const uint16_t* values, int64_t /*nnz*/,
                                    uint16_t* dst, int64_t n) {
  const int64_t nb = (n + 7) / 8;
  int64_t k = 0, j = 0;
  // 64 elements per step: two expanding loads (masked: they read only the values they use, so
  // never past the payload) whose addresses differ by the first mask's popcount.
  for (; j + 64 <= n; j += 64) {
    uint64_t w;
    std::memcpy(&w, bitmap + (j >> 3), 8);
    const __mmask32 lo = static_cast<__mmask32>(w), hi = static_cast<__mmask32>(w >> 32);
    const int64_t k1 = k + _mm_popcnt_u32(lo);
    _mm512_storeu_si512(dst + j, _mm512_maskz_expandloadu_epi16(lo, values + k));
    _mm512_storeu_si512(dst + j + 32, _mm512_maskz_expandloadu_epi16(hi, values + k1));
    k = k1 + _mm_popcnt_u32(hi);
  }
  for (; j < n; j += 32) {
    const int64_t left = n - j;
    const __mmask32 lanes = left >= 32 ? ~__mmask32(0) : (__mmask32(1) << left) - 1;
    const __mmask32 m = mask32(bitmap, j, nb) & lanes;
    _mm512_mask_storeu_epi16(dst + j, lanes, _mm512_maskz_expandloadu_epi16(m, values + k));
    k += _mm_popcnt_u32(m);
  }
  return k;
}

ENDOR_AVX512 int64_t endor_expand32(const uint8_t* bitmap, const uint32_t* values, int64_t /*nnz*/,
                                    uint32_t* dst, int64_t n) {
  const int64_t nb = (n + 7) / 8;
  int64_t k = 0, j = 0;
  for (; j < n; j += 16) {
    const int64_t left = n - j;
    const __mmask16 lanes = left >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << left) - 1);
    const __mmask16 m = static_cast<__mmask16>(mask32(bitmap, j, nb)) & lanes;
    _mm512_mask_storeu_epi32(dst + j, lanes, _mm512_maskz_expandloadu_epi32(m, values + k));
    k += _mm_popcnt_u32(m);
  }
  return k;
}

namespace {

// 32 16-bit values -> two float32 vectors (elements 0-15, 16-31).
ENDOR_AVX512 inline void to_floats(__m512i v, bool bf16, __m512& lo, __m512& hi) {
  const __m256i a = _mm512_castsi512_si256(v), b = _mm512_extracti64x4_epi64(v, 1);
  if (bf16) {
    lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(a), 16));
    hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
  } else {
    lo = _mm512_cvtph_ps(a);
    hi = _mm512_cvtph_ps(b);
  }
}

}  // namespace

// Calls step(j, lanes, lo, hi) for each 32 elements j .. j + 31 of a 16-bit block (lanes: those
// below n), with the expanded values as float32 (zero where the bitmap bit is clear).
template <class Step>
ENDOR_AVX512 inline void each_32(const uint8_t* bitmap, const uint16_t* values, bool bf16, int64_t n, Step step) {
  const int64_t nb = (n + 7) / 8;
  int64_t k = 0, j = 0;
  __m512 lo, hi;
  for (; j + 64 <= n; j += 64) {  // two expanding loads per 8 bitmap bytes
    uint64_t w;
    std::memcpy(&w, bitmap + (j >> 3), 8);
    const __mmask32 m0 = static_cast<__mmask32>(w), m1 = static_cast<__mmask32>(w >> 32);
    const int64_t k1 = k + _mm_popcnt_u32(m0);
    to_floats(_mm512_maskz_expandloadu_epi16(m0, values + k), bf16, lo, hi);
    step(j, ~__mmask32(0), lo, hi);
    to_floats(_mm512_maskz_expandloadu_epi16(m1, values + k1), bf16, lo, hi);
    step(j + 32, ~__mmask32(0), lo, hi);
    k = k1 + _mm_popcnt_u32(m1);
  }
  for (; j < n; j += 32) {
    const int64_t left = n - j;
    const __mmask32 lanes = left >= 32 ? ~__mmask32(0) : (__mmask32(1) << left) - 1;
    const __mmask32 m = mask32(bitmap, j, nb) & lanes;
    to_floats(_mm512_maskz_expandloadu_epi16(m, values + k), bf16, lo, hi);
    step(j, lanes, lo, hi);
    k += _mm_popcnt_u32(m);
  }
}

ENDOR_AVX512 float endor_dot16(const uint8_t* bitmap, const uint16_t* values, bool bf16, const float* x, int64_t n) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  each_32(bitmap, values, bf16, n, [&](int64_t j, __mmask32 lanes, __m512 lo, __m512 hi) ENDOR_AVX512 {
    acc0 = _mm512_fmadd_ps(lo, _mm512_maskz_loadu_ps(static_cast<__mmask16>(lanes), x + j), acc0);
    acc1 = _mm512_fmadd_ps(hi, _mm512_maskz_loadu_ps(static_cast<__mmask16>(lanes >> 16), x + j + 16), acc1);
  });
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

ENDOR_AVX512 void endor_axpy16(const uint8_t* bitmap, const uint16_t* values, bool bf16, float a, float* y,
                               int64_t n) {
  const __m512 w = _mm512_set1_ps(a);
  each_32(bitmap, values, bf16, n, [&](int64_t j, __mmask32 lanes, __m512 lo, __m512 hi) ENDOR_AVX512 {
    const __mmask16 l0 = static_cast<__mmask16>(lanes), l1 = static_cast<__mmask16>(lanes >> 16);
    _mm512_mask_storeu_ps(y + j, l0, _mm512_fmadd_ps(w, lo, _mm512_maskz_loadu_ps(l0, y + j)));
    _mm512_mask_storeu_ps(y + j + 16, l1, _mm512_fmadd_ps(w, hi, _mm512_maskz_loadu_ps(l1, y + j + 16)));
  });
}

// group_size must be a multiple of 16 (16 consecutive values share one scale and bias); other
// group sizes take the AVX2 kernel. The last, partial step loads and stores under a mask.
ENDOR_AVX512 void endor_dequant(const uint8_t* codes, int bits, const uint16_t* scales,
                                const uint16_t* biases, int group_size, int64_t nnz, uint16_t* out) {
  if (group_size % 16 != 0) return avx2::endor_dequant(codes, bits, scales, biases, group_size, nnz, out);
  for (int64_t i = 0; i < nnz; i += 16) {
    const int left = nnz - i >= 16 ? 16 : static_cast<int>(nnz - i);
    const __mmask16 lanes = static_cast<__mmask16>((1u << left) - 1);
    __m128i q8;
    if (bits == 8) {
      q8 = _mm_maskz_loadu_epi8(lanes, codes + i);
    } else {
      const __m128i raw = _mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << ((left + 1) / 2)) - 1), codes + i / 2);
      const __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(15));
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(15));
      q8 = _mm_unpacklo_epi8(lo, hi);  // lo0 hi0 lo1 hi1 ...: codes in stored order
    }
    const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q8));
    const int64_t g = i / group_size;
    const __m512 s = _mm512_set1_ps(_cvtsh_ss(scales[g]));
    const __m512 b = _mm512_set1_ps(_cvtsh_ss(biases[g]));
    // The product is exact in float32, so mul then add rounds like the scalar reference.
    const __m512 v = _mm512_add_ps(_mm512_mul_ps(s, q), b);
    _mm256_mask_storeu_epi16(out + i, lanes, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
}

}  // namespace flash::avx512

namespace flash::avx512 {

// crc32 by carry-less multiplication as in the AVX2 file, on 512-bit registers (VPCLMULQDQ): four
// registers fold 256 bytes per step (constants x^(2048±32) mod P, bit-reflected), then fold into
// one register (x^(512±32)) and its four 128-bit lanes into one (x^(128±32)); the AVX2 kernel
// finishes the remaining bytes from that 16-byte state.
#define ENDOR_VPCLMUL __attribute__((target("avx512f,avx512bw,avx512vl,vpclmulqdq,pclmul,sse4.1,avx2")))

namespace {

ENDOR_VPCLMUL inline __m512i fold512(__m512i x, __m512i k, __m512i next) {
  return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00), _mm512_clmulepi64_epi128(x, k, 0x11), next,
                                   0x96);  // a ^ b ^ c
}

ENDOR_VPCLMUL inline __m128i fold128(__m128i x, __m128i k, __m128i next) {
  return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11)), next);
}

}  // namespace

ENDOR_VPCLMUL uint32_t endor_crc32_raw(uint32_t state, const uint8_t* p, int64_t n) {
  if (n < 512) return avx2::endor_crc32_raw(state, p, n);
  const __m512i k16 = _mm512_broadcast_i32x4(_mm_set_epi64x(0x1322d1430, 0x11542778a));
  const __m512i k4 = _mm512_broadcast_i32x4(_mm_set_epi64x(0x1c6e41596, 0x154442bd4));
  const __m128i k1 = _mm_set_epi64x(0x0ccaa009e, 0x1751997d0);
  __m512i x0 = _mm512_xor_si512(_mm512_loadu_si512(p), _mm512_castsi128_si512(_mm_cvtsi32_si128(static_cast<int>(state))));
  __m512i x1 = _mm512_loadu_si512(p + 64), x2 = _mm512_loadu_si512(p + 128), x3 = _mm512_loadu_si512(p + 192);
  for (p += 256, n -= 256; n >= 256; p += 256, n -= 256) {
    x0 = fold512(x0, k16, _mm512_loadu_si512(p));
    x1 = fold512(x1, k16, _mm512_loadu_si512(p + 64));
    x2 = fold512(x2, k16, _mm512_loadu_si512(p + 128));
    x3 = fold512(x3, k16, _mm512_loadu_si512(p + 192));
  }
  x1 = fold512(x0, k4, x1);
  x2 = fold512(x1, k4, x2);
  x3 = fold512(x2, k4, x3);
  for (; n >= 64; p += 64, n -= 64) x3 = fold512(x3, k4, _mm512_loadu_si512(p));
  __m128i x = _mm512_extracti32x4_epi32(x3, 0);
  x = fold128(x, k1, _mm512_extracti32x4_epi32(x3, 1));
  x = fold128(x, k1, _mm512_extracti32x4_epi32(x3, 2));
  x = fold128(x, k1, _mm512_extracti32x4_epi32(x3, 3));
  for (; n >= 16; p += 16, n -= 16) x = fold128(x, k1, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  alignas(16) uint8_t folded[16];
  _mm_store_si128(reinterpret_cast<__m128i*>(folded), x);
  return scalar::endor_crc32_raw(scalar::endor_crc32_raw(0, folded, 16), p, n);
}

}  // namespace flash::avx512
