// Float32 vector loops of the layer ops (attention, SwiGLU), the scalar reference: one operation at
// a time in index order. arch/x86/vec_avx2.h has the same functions; vec.h picks one per call.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace flash::scalar {

inline float dot(const float* a, const float* b, int n) {
  float s = 0.f;
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y += w * x
inline void axpy(float w, const float* x, float* y, int n) {
  for (int i = 0; i < n; ++i) y[i] += w * x[i];
}

// g[i] = silu(g[i]) * u[i] = g / (1 + exp(-g)) * u
inline void silu_mul(float* g, const float* u, int n) {
  for (int i = 0; i < n; ++i) g[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

// p[j] = exp(p[j] - m) for j < n; returns their sum.
inline float exp_shift_sum(float* p, int n, float m) {
  float sum = 0.f;
  for (int j = 0; j < n; ++j) sum += (p[j] = std::exp(p[j] - m));
  return sum;
}

// MLX's CPU exp (simd::exp: 2^(x log2 e) by a degree-6 polynomial of the fraction), before its
// output is rounded to the array's dtype.
inline float mlx_exp(float x) {
  if (std::isnan(x)) return x;
  if (x > 88.72283905206835f) return std::numeric_limits<float>::infinity();
  if (x < -88.72283905206835f) return 0.f;
  const float t = x * 1.442695f;
  const float ipart = std::floor(t + 0.5f), fpart = t - ipart;
  float y = 1.535336188319500e-4f;
  for (float c : {1.339887440266574e-3f, 9.618437357674640e-3f, 5.550332471162809e-2f, 2.402264791363012e-1f,
                  6.931472028550421e-1f, 1.000000000000000f})
    y = std::fma(y, fpart, c);
  const int32_t bits = int32_t(uint32_t(int32_t(ipart) + 127) << 23);
  float scale;
  std::memcpy(&scale, &bits, 4);
  return scale * y;
}

// e[i] = mlx_exp(|x[i]|) for i < n (silu's exp as MLX computes it)
inline void mlx_exp_abs(const float* x, float* e, int64_t n) {
  for (int64_t i = 0; i < n; ++i) e[i] = mlx_exp(std::fabs(x[i]));
}

}  // namespace flash::scalar
