// Row helpers shared by the extension's layer primitives (layer_ops.cpp, fused_ops.cpp): loading and
// storing rows of any float dtype as float32, MLX's rounding, and the norm / RoPE arithmetic, so the
// fused ops compute exactly what the single ones do.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "dtype.h"
#include "mlx_view.h"
#include "scratch.h"
#include "vec.h"

namespace flash_ext {

// ----------------------------------------------------------------------------------------------
// Row loads / stores between an MLX buffer (any float dtype, element stride) and float32.

// n elements starting at element `base`, `stride` elements apart -> dst.
inline void load_row(const uint8_t* ptr, int dt, int64_t base, int64_t stride, int n, float* dst) {
  if (stride == 1) {
    flash::load_floats(ptr + base * (dt == flash::DT_F32 ? 4 : 2), dt, n, dst);
    return;
  }
  for (int i = 0; i < n; ++i) dst[i] = flash::load_scalar(ptr, dt, base + i * stride);
}

// n contiguous elements of a contiguous output starting at element `base`.
inline void store_row(uint8_t* ptr, int dt, int64_t base, int n, const float* src) {
  flash::store_floats(ptr, dt, base, n, src);
}

// Round float32 values to dtype dt in place (what storing and reloading would give).
inline void round_to(int dt, float* v, int n) { flash::round_floats(dt, v, n); }

using flash::scratch;
using flash::dot_f32, flash::axpy_f32, flash::silu_mul, flash::exp_shift_sum;

inline thread_local std::vector<float> tl_row, tl_aux, tl_scores;

// out = round(y, ydt) + add for n contiguous values: a residual add as the unfused `x + layer(h)`
// computes it (the product stored in its dtype first). y is overwritten; r: room for n floats.
inline void store_residual(float* y, const View& add, int64_t n, int ydt, uint8_t* out, int odt, float* r) {
  to_float(add, r);
  round_to(ydt, y, int(n));
  for (int64_t i = 0; i < n; ++i) y[i] += r[i];
  store_row(out, odt, 0, int(n), y);
}

// Offset of row r (all dims but the last) of a view, in elements.
inline int64_t row_offset(const View& v, int64_t r) { return v.offset(r * v.shape.back()); }

// A row of n elements as float32: the buffer itself when it is float32 and contiguous, else
// converted into buf.
inline const float* row_f32(const uint8_t* ptr, int dt, int64_t base, int64_t stride, int n, float* buf) {
  if (dt == flash::DT_F32 && stride == 1) return reinterpret_cast<const float*>(ptr) + base;
  load_row(ptr, dt, base, stride, n, buf);
  return buf;
}

// One row of mx.fast.rms_norm (center = false) or layer_norm (center = true) in place, with MLX's
// rounding: the normalised x is rounded to the output dtype odt, then each affine step.
inline void normalize_row(float* row, int D, bool center, float eps, const float* w, const float* b, int odt) {
  if (center) {
    float mean = 0.f;
    for (int d = 0; d < D; ++d) mean += row[d];
    mean /= float(D);
    for (int d = 0; d < D; ++d) row[d] -= mean;
  }
  const float inv = 1.f / std::sqrt(flash::scalar::dot(row, row, D) / float(D) + eps);
  for (int d = 0; d < D; ++d) row[d] *= inv;
  if (w) {
    round_to(odt, row, D);
    for (int d = 0; d < D; ++d) row[d] *= w[d];
  }
  if (b) {
    round_to(odt, row, D);
    for (int d = 0; d < D; ++d) row[d] += b[d];
  }
}

// mx.fast.rope's rotation tables for positions offset .. offset + L - 1: cos then sin, [L, dims/2]
// each, in cs (2 * L * dims/2 floats). inv_freq[j] = 1 / freqs[j] (freqs given) or base^(-2j/dims).
inline void rope_tables(int dims, float base, float scale, int offset, int L, const View* freqs, float* cs) {
  const int half = dims / 2;
  std::vector<float> inv(half);
  for (int j = 0; j < half; ++j) {
    if (freqs) inv[j] = 1.f / flash::load_scalar(freqs->ptr, scalar_type(freqs->dtype), freqs->offset(j));
    else inv[j] = std::exp2(-(float(j) / float(half)) * std::log2(base));
  }
  for (int l = 0; l < L; ++l) {
    const float pos = scale * float(offset + l);
    for (int j = 0; j < half; ++j) {
      const float theta = pos * inv[j];
      cs[size_t(l) * half + j] = std::cos(theta);
      cs[size_t(L + l) * half + j] = std::sin(theta);
    }
  }
}

// Rotates the first dims features of one row (position l of the tables) from in to out (D features).
inline void rope_row(const float* in, float* out, int D, int dims, bool traditional, const float* cs, int L, int l) {
  const int half = dims / 2;
  const float* c = cs + size_t(l) * half;
  const float* s = cs + size_t(L + l) * half;
  for (int j = 0; j < half; ++j) {
    const int a = traditional ? 2 * j : j, b = traditional ? 2 * j + 1 : j + half;
    out[a] = in[a] * c[j] - in[b] * s[j];
    out[b] = in[a] * s[j] + in[b] * c[j];
  }
  for (int d = 2 * half; d < D; ++d) out[d] = in[d];
}

}  // namespace flash_ext
