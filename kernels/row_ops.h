// Row helpers shared by the extension's layer primitives (layer_ops.cpp, fused_ops.cpp): loading and
// storing rows of any float dtype as float32, MLX's rounding, and the norm / RoPE arithmetic, so the
// fused ops compute exactly what the single ones do.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "matvec.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "mlx_view.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define FLASH_ROW_X86 1
#define FLASH_ROW_AVX2 __attribute__((target("avx2,fma,f16c")))
#else
#define FLASH_ROW_X86 0
#endif

namespace flash_ext {

// ----------------------------------------------------------------------------------------------
// Row loads / stores between an MLX buffer (any float dtype, element stride) and float32.

#if FLASH_ROW_X86
FLASH_ROW_AVX2 inline void store_f16_avx2(const float* src, int n, uint16_t* dst) {
  int i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) dst[i] = uint16_t(_cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT));
}
#endif

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
#if FLASH_ROW_X86
  if (dt == flash::DT_F16 && flash::simd_active()) {
    store_f16_avx2(src, n, reinterpret_cast<uint16_t*>(ptr) + base);
    return;
  }
#endif
  if (dt == flash::DT_F32) {
    std::copy_n(src, n, reinterpret_cast<float*>(ptr) + base);
    return;
  }
  for (int i = 0; i < n; ++i) flash::store_scalar(ptr, dt, base + i, src[i]);
}

// Round float32 values to dtype dt in place (what storing and reloading would give).
inline void round_to(int dt, float* v, int n) { flash::round_floats(dt, v, n); }

inline float dot(const float* a, const float* b, int n) {
  float s = 0.f;
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline thread_local std::vector<float> tl_row, tl_aux, tl_scores;

inline float* scratch(std::vector<float>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

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

// Shared eval plumbing (after allocate_output): register buffers, run `work` on the stream.
inline uint8_t* allocate_output(mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  return out.data<uint8_t>();
}

// Base of the extension's primitives: they run on the CPU stream only.
class CpuPrimitive : public mx::Primitive {
 public:
  using mx::Primitive::Primitive;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mlx_flash._ext kernels run on the CPU stream only");
  }
};

template <typename Fn>
void dispatch(mx::Stream s, const std::vector<mx::array>& inputs, std::vector<mx::array> outs, Fn&& work) {
  auto& enc = mx::cpu::get_command_encoder(s);
  for (auto& a : inputs) enc.set_input_array(a);
  for (auto& o : outs) enc.set_output_array(o);
  enc.dispatch(std::forward<Fn>(work));
}


// ----------------------------------------------------------------------------------------------
// Vector loops for attention (simd: the caller checked flash::simd_active() once).
#if FLASH_ROW_X86
FLASH_ROW_AVX2 inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
FLASH_ROW_AVX2 inline float dot_avx2(const float* a, const float* b, int n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
  }
  for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
  float s = hsum8(_mm256_add_ps(s0, s1));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}
FLASH_ROW_AVX2 inline void axpy_avx2(float w, const float* x, float* y, int n) {
  const __m256 wv = _mm256_set1_ps(w);
  int i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += w * x[i];
}
// Attention tiles for blocks of queries (prompts); the scores are flash::dot_tiles.
// Weighted values: acc[t * Dv + d] = sum_j p[t * ld + j] * v[j * Dv + d] over j < nk, for 4 queries
// x 16 columns per register tile (Dv a multiple of 16). j ascending, one FMA each: the same sums
// as axpy_avx2 over j.
FLASH_ROW_AVX2 inline void values_tiles_avx2(const float* p, int ld, int nq, const float* v, int nk, int Dv, float* acc) {
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
// exp(x) for 8 floats (Cephes' expf: x = n ln2 + r, |r| <= ln2/2, degree-5 polynomial; ~1 ulp).
// Below ln(FLT_MIN) the result is 0 (2^n would need an exponent field < 1: n = -128 gave -inf).
FLASH_ROW_AVX2 inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3365447505531f);  // ln(FLT_MIN)
  const __m256 normal = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), normal);
}
// g[i] = silu(g[i]) * u[i] = g / (1 + exp(-g)) * u for i < n (the scalar form for the tail).
FLASH_ROW_AVX2 inline void silu_mul_avx2(float* g, const float* u, int n) {
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
FLASH_ROW_AVX2 inline float exp_shift_sum_avx2(float* p, int n, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256 s = _mm256_setzero_ps();
  int j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + j), mv));
    _mm256_storeu_ps(p + j, e);
    s = _mm256_add_ps(s, e);
  }
  float sum = hsum8(s);
  for (; j < n; ++j) sum += (p[j] = std::exp(p[j] - m));
  return sum;
}
#endif

inline float dot_f32(bool simd, const float* a, const float* b, int n) {
#if FLASH_ROW_X86
  if (simd) return dot_avx2(a, b, n);
#endif
  return dot(a, b, n);
}
inline void axpy_f32(bool simd, float w, const float* x, float* y, int n) {
#if FLASH_ROW_X86
  if (simd) return axpy_avx2(w, x, y, n);
#endif
  for (int i = 0; i < n; ++i) y[i] += w * x[i];
}
inline void silu_mul(bool simd, float* g, const float* u, int n) {
#if FLASH_ROW_X86
  if (simd) return silu_mul_avx2(g, u, n);
#endif
  for (int i = 0; i < n; ++i) g[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}
inline float exp_shift_sum(bool simd, float* p, int n, float m) {
#if FLASH_ROW_X86
  if (simd) return exp_shift_sum_avx2(p, n, m);
#endif
  float sum = 0.f;
  for (int j = 0; j < n; ++j) sum += (p[j] = std::exp(p[j] - m));
  return sum;
}

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
  const float inv = 1.f / std::sqrt(dot(row, row, D) / float(D) + eps);
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
