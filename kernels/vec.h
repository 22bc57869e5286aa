// The layer ops' float32 vector loops with the ISA chosen by the caller (simd: the caller read
// flash::simd_active() once for the whole call).
#pragma once

#include "cpu_features.h"
#include "vec_scalar.h"
#if FLASH_X86
#include "arch/x86/vec_avx2.h"
#endif

namespace flash {

inline float dot_f32(bool simd, const float* a, const float* b, int n) {
#if FLASH_X86
  if (simd) return avx2::dot(a, b, n);
#endif
  return scalar::dot(a, b, n);
}
inline void axpy_f32(bool simd, float w, const float* x, float* y, int n) {
#if FLASH_X86
  if (simd) return avx2::axpy(w, x, y, n);
#endif
  scalar::axpy(w, x, y, n);
}
inline void silu_mul(bool simd, float* g, const float* u, int n) {
#if FLASH_X86
  if (simd) return avx2::silu_mul(g, u, n);
#endif
  scalar::silu_mul(g, u, n);
}
inline void mlx_exp_abs(bool simd, const float* x, float* e, int64_t n) {
#if FLASH_X86
  if (simd) return avx2::mlx_exp_abs(x, e, n);
#endif
  scalar::mlx_exp_abs(x, e, n);
}
inline float exp_shift_sum(bool simd, float* p, int n, float m) {
#if FLASH_X86
  if (simd) return avx2::exp_shift_sum(p, n, m);
#endif
  return scalar::exp_shift_sum(p, n, m);
}

}  // namespace flash
