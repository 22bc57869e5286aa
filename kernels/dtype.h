// Float dtypes of MLX arrays as the kernels see them, and their conversions to and from float32:
// scalar routines (inline, round to nearest even, NaN kept quiet) and bulk loops per ISA.
#pragma once

#include <cstdint>
#include <cstring>

namespace flash {

enum ScalarType : int { DT_F32 = 0, DT_F16 = 1, DT_BF16 = 2 };

inline float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      exp = 127 - 15 + 1;
      while (!(man & 0x400)) { man <<= 1; --exp; }
      bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_f16(float f) {  // round to nearest even
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000;
  uint32_t ax = x & 0x7fffffff;
  if (ax >= 0x7f800000) return uint16_t(sign | 0x7c00 | (ax > 0x7f800000 ? 0x200 : 0));
  if (ax >= 0x477ff000) return uint16_t(sign | 0x7c00);  // overflow -> inf
  if (ax < 0x38800000) {                                    // subnormal or zero
    if (ax < 0x33000000) return uint16_t(sign);
    uint32_t e = ax >> 23, m = (ax & 0x7fffff) | 0x800000;
    int shift = 126 - int(e);  // value = m * 2^(e-150) = r * 2^-24
    uint32_t r = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1))) ++r;
    return uint16_t(sign | r);
  }
  uint32_t r = ((ax >> 13) - (112u << 10));
  uint32_t rem = ax & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (r & 1))) ++r;
  return uint16_t(sign | r);
}

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffff) > 0x7f800000) return uint16_t((x >> 16) | 0x40);  // quiet NaN
  x += 0x7fff + ((x >> 16) & 1);
  return uint16_t(x >> 16);
}

template <int ST>
inline float ld(const void* base, int64_t i) {
  if constexpr (ST == DT_F16) return f16_to_f32(static_cast<const uint16_t*>(base)[i]);
  else if constexpr (ST == DT_BF16) return bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
  else return static_cast<const float*>(base)[i];
}

// Inlined into the kernels, which store one output per row (an out-of-line call showed in profiles).
__attribute__((always_inline)) inline void store_out(void* base, int dtype, int64_t i, float v) {
  switch (dtype) {
    case DT_F16: static_cast<uint16_t*>(base)[i] = f32_to_f16(v); break;
    case DT_BF16: static_cast<uint16_t*>(base)[i] = f32_to_bf16(v); break;
    default: static_cast<float*>(base)[i] = v;
  }
}

// Element i of an array of dtype at base, as float32 / stored from float32.
float load_scalar(const void* base, int dtype, int64_t i);
void store_scalar(void* base, int dtype, int64_t i, float v);
// n contiguous values of dtype at base -> float32.
void load_floats(const void* base, int dtype, int64_t n, float* dst);
// float32 src -> n contiguous values of dtype at elements i0 .. i0 + n - 1 of base.
void store_floats(void* base, int dtype, int64_t i0, int64_t n, const float* src);
// v[i] rounded to dtype and back (what storing and reloading gives), in place.
void round_floats(int dtype, float* v, int64_t n);

// The same loops per ISA (same names; cpu_features.h picks one).
namespace scalar {
void load_floats(const void* base, int dtype, int64_t n, float* dst);
void store_floats(void* base, int dtype, int64_t i0, int64_t n, const float* src);
void round_floats(int dtype, float* v, int64_t n);
}  // namespace scalar
namespace avx2 {
// Half dtypes only (float32 is a copy); round_floats rounds whole blocks of 8 and returns how many
// values it did (the scalar loop does the rest).
void load_floats(const uint16_t* src, bool bf16, int64_t n, float* dst);
void store_f16(const float* src, int64_t n, uint16_t* dst);
int64_t round_floats(int dtype, float* v, int64_t n);
}  // namespace avx2

}  // namespace flash
