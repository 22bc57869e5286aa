// Conversions between float32 and the float dtypes: the scalar reference loops and the per-call
// choice of ISA (the AVX2 loops: arch/x86/dtype_avx2.cpp).

#include "dtype.h"

#include <algorithm>

#include "cpu_features.h"

namespace flash {

float load_scalar(const void* base, int dtype, int64_t i) {
  switch (dtype) {
    case DT_F16: return f16_to_f32(static_cast<const uint16_t*>(base)[i]);
    case DT_BF16: return bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
    default: return static_cast<const float*>(base)[i];
  }
}

void store_scalar(void* base, int dtype, int64_t i, float v) { store_out(base, dtype, i, v); }

namespace scalar {

void load_floats(const void* base, int dtype, int64_t n, float* dst) {
  if (dtype == DT_F32) {
    std::memcpy(dst, base, size_t(n) * 4);
    return;
  }
  for (int64_t i = 0; i < n; ++i) dst[i] = load_scalar(base, dtype, i);
}

void store_floats(void* base, int dtype, int64_t i0, int64_t n, const float* src) {
  if (dtype == DT_F32) {
    std::copy_n(src, n, static_cast<float*>(base) + i0);
    return;
  }
  for (int64_t i = 0; i < n; ++i) store_scalar(base, dtype, i0 + i, src[i]);
}

void round_floats(int dtype, float* v, int64_t n) {
  if (dtype == DT_F32) return;
  for (int64_t i = 0; i < n; ++i) v[i] = dtype == DT_F16 ? f16_to_f32(f32_to_f16(v[i])) : bf16_to_f32(f32_to_bf16(v[i]));
}

}  // namespace scalar

void load_floats(const void* base, int dtype, int64_t n, float* dst) {
#if FLASH_X86
  if (dtype != DT_F32 && simd_active())
    return avx2::load_floats(static_cast<const uint16_t*>(base), dtype == DT_BF16, n, dst);
#endif
  scalar::load_floats(base, dtype, n, dst);
}

void store_floats(void* base, int dtype, int64_t i0, int64_t n, const float* src) {
#if FLASH_X86
  if (dtype == DT_F16 && simd_active()) return avx2::store_f16(src, n, static_cast<uint16_t*>(base) + i0);
#endif
  scalar::store_floats(base, dtype, i0, n, src);
}

void round_floats(int dtype, float* v, int64_t n) {
  if (dtype == DT_F32) return;
  int64_t i = 0;
#if FLASH_X86
  if (simd_active()) i = avx2::round_floats(dtype, v, n);
#endif
  scalar::round_floats(dtype, v + i, n - i);
}

}  // namespace flash
