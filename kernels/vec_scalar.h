// Float32 vector loops of the layer ops (attention, SwiGLU), the scalar reference: one operation at
// a time in index order. arch/x86/vec_avx2.h has the same functions; vec.h picks one per call.
#pragma once

#include <cmath>

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

}  // namespace flash::scalar
