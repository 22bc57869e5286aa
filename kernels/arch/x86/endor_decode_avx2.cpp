// ENDOR row kernels for AVX2 (the scalar reference: endor_decode.cpp). 16-bit rows expand through
// a 256-entry pshufb table: each bitmap byte selects the shuffle that spreads the next
// popcount(byte) stored values over its 8 positions and zeroes the rest.

#include <immintrin.h>

#include <cstring>

#include "../../dtype.h"
#include "../../endor_decode.h"

// FLASH_AVX2 plus popcnt (every AVX2 CPU has it).
#define ENDOR_AVX2 __attribute__((target("avx2,fma,f16c,popcnt")))

namespace flash::avx2 {

namespace {

struct Shuffles {
  alignas(16) uint8_t lut[256][16];
  Shuffles() {
    for (int m = 0; m < 256; ++m) {
      int k = 0;
      for (int j = 0; j < 8; ++j) {
        if (m >> j & 1) {
          lut[m][2 * j] = static_cast<uint8_t>(2 * k);
          lut[m][2 * j + 1] = static_cast<uint8_t>(2 * k + 1);
          ++k;
        } else {
          lut[m][2 * j] = lut[m][2 * j + 1] = 0x80;  // pshufb writes 0
        }
      }
    }
  }
};
const Shuffles kShuffles;

ENDOR_AVX2 inline void expand_byte(unsigned m, const uint16_t* values, uint16_t* dst) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(values));
  const __m128i s = _mm_load_si128(reinterpret_cast<const __m128i*>(kShuffles.lut[m]));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm_shuffle_epi8(v, s));
}

}  // namespace

ENDOR_AVX2 int64_t endor_expand16(const uint8_t* bitmap, const uint16_t* values, int64_t nnz,
                                  uint16_t* dst, int64_t n) {
  const int64_t full = n / 8;
  int64_t k = 0, b = 0;
  // 8 bitmap bytes at a time: each byte's first value comes from a prefix sum of per-byte
  // popcounts (SWAR), so the 8 shuffles do not wait on each other.
  for (; b + 8 <= full; b += 8) {
    uint64_t w;
    std::memcpy(&w, bitmap + b, 8);
    const int64_t total = _mm_popcnt_u64(w);
    if (nnz - k < total + 8) break;  // the last 16-byte load must stay inside the payload
    uint64_t c = w - ((w >> 1) & 0x5555555555555555ULL);
    c = (c & 0x3333333333333333ULL) + ((c >> 2) & 0x3333333333333333ULL);
    c = (c + (c >> 4)) & 0x0f0f0f0f0f0f0f0fULL;
    const uint64_t before = (c * 0x0101010101010101ULL) << 8;  // byte i: values before byte i
    for (int i = 0; i < 8; ++i)
      expand_byte((w >> (8 * i)) & 0xff, values + k + ((before >> (8 * i)) & 0xff), dst + 8 * (b + i));
    k += total;
  }
  // Then byte by byte while at least 8 stored values remain (never reads past the payload).
  for (; b < full && nnz - k >= 8; ++b) {
    expand_byte(bitmap[b], values + k, dst + 8 * b);
    k += _mm_popcnt_u32(bitmap[b]);
  }
  for (int64_t j = 8 * b; j < n; ++j) dst[j] = (bitmap[j >> 3] >> (j & 7)) & 1 ? values[k++] : uint16_t(0);
  return k;
}

// group_size must be a multiple of 8 (8 consecutive values share one scale and bias).
ENDOR_AVX2 void endor_dequant(const uint8_t* codes, int bits, const uint16_t* scales,
                              const uint16_t* biases, int group_size, int64_t nnz, uint16_t* out) {
  int64_t i = 0;
  for (; i + 8 <= nnz; i += 8) {
    __m128i q8;
    if (bits == 8) {
      q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i));
    } else {
      uint32_t w;
      std::memcpy(&w, codes + i / 2, 4);
      const __m128i raw = _mm_cvtsi32_si128(static_cast<int>(w));
      const __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(15));
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(15));
      q8 = _mm_unpacklo_epi8(lo, hi);  // lo0 hi0 lo1 hi1 ...: codes in stored order
    }
    const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q8));
    const int64_t g = i / group_size;
    const __m256 s = _mm256_set1_ps(_cvtsh_ss(scales[g]));
    const __m256 b = _mm256_set1_ps(_cvtsh_ss(biases[g]));
    const __m256 v = _mm256_add_ps(_mm256_mul_ps(s, q), b);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < nnz; ++i) {
    const int q = bits == 8 ? codes[i] : (codes[i >> 1] >> ((i & 1) * 4)) & 15;
    const float prod = _cvtsh_ss(scales[i / group_size]) * static_cast<float>(q);
    out[i] = _cvtss_sh(prod + _cvtsh_ss(biases[i / group_size]), _MM_FROUND_TO_NEAREST_INT);
  }
}

}  // namespace flash::avx2

namespace flash::avx2 {

// crc32 by carry-less multiplication (Intel's "Fast CRC Computation for Generic Polynomials Using
// PCLMULQDQ"): four 128-bit lanes fold 64 bytes per step, then one lane 16 bytes per step; the
// folded 16 bytes are congruent to the data read so far, so the scalar table finishes on them and
// the tail. Constants: x^(512±32) and x^(128±32) mod P, bit-reflected (every AVX2 CPU has PCLMUL).
#define ENDOR_CLMUL __attribute__((target("avx2,pclmul,sse4.1")))

namespace {

ENDOR_CLMUL inline __m128i fold(__m128i x, __m128i k, __m128i next) {
  return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11)), next);
}

ENDOR_CLMUL inline __m128i load(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

}  // namespace

ENDOR_CLMUL uint32_t endor_crc32_raw(uint32_t state, const uint8_t* p, int64_t n) {
  if (n < 64) return scalar::endor_crc32_raw(state, p, n);
  const __m128i k4 = _mm_set_epi64x(0x1c6e41596, 0x154442bd4), k1 = _mm_set_epi64x(0x0ccaa009e, 0x1751997d0);
  __m128i x0 = _mm_xor_si128(load(p), _mm_cvtsi32_si128(static_cast<int>(state)));
  __m128i x1 = load(p + 16), x2 = load(p + 32), x3 = load(p + 48);
  for (p += 64, n -= 64; n >= 64; p += 64, n -= 64) {
    x0 = fold(x0, k4, load(p));
    x1 = fold(x1, k4, load(p + 16));
    x2 = fold(x2, k4, load(p + 32));
    x3 = fold(x3, k4, load(p + 48));
  }
  x1 = fold(x0, k1, x1);
  x2 = fold(x1, k1, x2);
  x3 = fold(x2, k1, x3);
  for (; n >= 16; p += 16, n -= 16) x3 = fold(x3, k1, load(p));
  alignas(16) uint8_t folded[16];
  _mm_store_si128(reinterpret_cast<__m128i*>(folded), x3);
  return scalar::endor_crc32_raw(scalar::endor_crc32_raw(0, folded, 16), p, n);
}

}  // namespace flash::avx2
