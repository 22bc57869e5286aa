// RMSNorm, RoPE and attention as single MLX CPU primitives (see layer_ops.h). All arithmetic is
// float32; each output element is rounded once to the output dtype (RMSNorm rounds x * rsqrt
// before the weight multiply, as MLX does).

#include "layer_ops.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "matvec.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx_view.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define FLASH_LAYER_X86 1
#define FLASH_AVX2 __attribute__((target("avx2,fma,f16c")))
#else
#define FLASH_LAYER_X86 0
#endif

namespace flash_ext {

namespace {

// ----------------------------------------------------------------------------------------------
// Row loads / stores between an MLX buffer (any float dtype, element stride) and float32.

#if FLASH_LAYER_X86
FLASH_AVX2 void load_f16_avx2(const uint16_t* src, int n, float* dst) {
  int i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  for (; i < n; ++i) dst[i] = _cvtsh_ss(src[i]);
}
FLASH_AVX2 void store_f16_avx2(const float* src, int n, uint16_t* dst) {
  int i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) dst[i] = uint16_t(_cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT));
}
#endif

// n elements starting at element `base`, `stride` elements apart -> dst.
void load_row(const uint8_t* ptr, int dt, int64_t base, int64_t stride, int n, float* dst) {
#if FLASH_LAYER_X86
  if (dt == flash::DT_F16 && stride == 1 && flash::simd_active()) {
    load_f16_avx2(reinterpret_cast<const uint16_t*>(ptr) + base, n, dst);
    return;
  }
#endif
  if (dt == flash::DT_F32 && stride == 1) {
    std::copy_n(reinterpret_cast<const float*>(ptr) + base, n, dst);
    return;
  }
  for (int i = 0; i < n; ++i) dst[i] = flash::load_scalar(ptr, dt, base + i * stride);
}

// n contiguous elements of a contiguous output starting at element `base`.
void store_row(uint8_t* ptr, int dt, int64_t base, int n, const float* src) {
#if FLASH_LAYER_X86
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
void round_to(int dt, float* v, int n) {
  if (dt == flash::DT_F32) return;
  uint16_t h;
  for (int i = 0; i < n; ++i) {
    flash::store_scalar(&h, dt, 0, v[i]);
    v[i] = flash::load_scalar(&h, dt, 0);
  }
}

float dot(const float* a, const float* b, int n) {
  float s = 0.f;
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

thread_local std::vector<float> tl_row, tl_aux, tl_scores;

float* scratch(std::vector<float>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

// Offset of row r (all dims but the last) of a view, in elements.
int64_t row_offset(const View& v, int64_t r) { return v.offset(r * v.shape.back()); }

// Shared eval plumbing (after allocate_output): register buffers, run `work` on the stream.
uint8_t* allocate_output(mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  return out.data<uint8_t>();
}

template <typename Fn>
void dispatch(mx::Stream s, const std::vector<mx::array>& inputs, mx::array& out, Fn&& work) {
  auto& enc = mx::cpu::get_command_encoder(s);
  for (auto& a : inputs) enc.set_input_array(a);
  enc.set_output_array(out);
  enc.dispatch(std::forward<Fn>(work));
}

// ----------------------------------------------------------------------------------------------
// RMSNorm (center = false) and LayerNorm (center = true: subtract the mean, then the variance).
// Rounding follows MLX: the normalised x is rounded to the output dtype, then each affine step.
class FlashNorm : public mx::Primitive {
 public:
  FlashNorm(mx::Stream s, bool center, float eps, bool has_weight, bool has_bias)
      : mx::Primitive(s), center_(center), eps_(eps), has_weight_(has_weight), has_bias_(has_bias) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    View x = View::of(inputs[0]), w, b;
    size_t next = 1;
    if (has_weight_) w = View::of(inputs[next++]);
    if (has_bias_) b = View::of(inputs[next++]);
    const int odt = scalar_type(out.dtype());
    uint8_t* optr = allocate_output(out);
    const float eps = eps_;
    const bool center = center_, has_w = has_weight_, has_b = has_bias_;
    dispatch(stream(), inputs, out, [=]() {
      const int D = int(x.shape.back());
      if (D == 0) return;
      const int64_t rows = x.size() / D;
      const int xdt = scalar_type(x.dtype);
      float* row = scratch(tl_row, D);
      float* wb = scratch(tl_aux, 2 * size_t(D));
      if (has_w) load_row(w.ptr, scalar_type(w.dtype), 0, w.strides.back(), D, wb);
      if (has_b) load_row(b.ptr, scalar_type(b.dtype), 0, b.strides.back(), D, wb + D);
      for (int64_t r = 0; r < rows; ++r) {
        load_row(x.ptr, xdt, row_offset(x, r), x.strides.back(), D, row);
        if (center) {
          float mean = 0.f;
          for (int d = 0; d < D; ++d) mean += row[d];
          mean /= float(D);
          for (int d = 0; d < D; ++d) row[d] -= mean;
        }
        const float inv = 1.f / std::sqrt(dot(row, row, D) / float(D) + eps);
        for (int d = 0; d < D; ++d) row[d] *= inv;
        if (has_w) {
          round_to(odt, row, D);
          for (int d = 0; d < D; ++d) row[d] *= wb[d];
        }
        if (has_b) {
          round_to(odt, row, D);
          for (int d = 0; d < D; ++d) row[d] += wb[D + d];
        }
        store_row(optr, odt, r * D, D, row);
      }
    });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mlx_flash._ext kernels run on the CPU stream only");
  }
  const char* name() const override { return center_ ? "FlashLayerNorm" : "FlashRMSNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const FlashNorm&>(other);
    return center_ == o.center_ && eps_ == o.eps_ && has_weight_ == o.has_weight_ && has_bias_ == o.has_bias_;
  }

 private:
  bool center_;
  float eps_;
  bool has_weight_, has_bias_;
};

// ----------------------------------------------------------------------------------------------
class FlashRoPE : public mx::Primitive {
 public:
  FlashRoPE(mx::Stream s, int dims, bool traditional, float base, float scale, int offset, bool has_freqs)
      : mx::Primitive(s), dims_(dims), traditional_(traditional), base_(base), scale_(scale), offset_(offset),
        has_freqs_(has_freqs) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    View x = View::of(inputs[0]), freqs;
    if (has_freqs_) freqs = View::of(inputs[1]);
    const int odt = scalar_type(out.dtype());
    uint8_t* optr = allocate_output(out);
    const int dims = dims_, offset = offset_;
    const bool trad = traditional_, has_f = has_freqs_;
    const float base = base_, scale = scale_;
    dispatch(stream(), inputs, out, [=]() {
      const int D = int(x.shape.back());
      const int L = int(x.shape[x.shape.size() - 2]);
      if (D == 0 || L == 0) return;
      const int64_t rows = x.size() / D;
      const int half = dims / 2;
      // cos/sin for each of the L positions: [L, half] each.
      float* cs = scratch(tl_aux, size_t(2) * L * half + half);
      float* inv = cs + size_t(2) * L * half;
      for (int j = 0; j < half; ++j) {
        if (has_f) inv[j] = 1.f / flash::load_scalar(freqs.ptr, scalar_type(freqs.dtype), freqs.offset(j));
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
      const int xdt = scalar_type(x.dtype);
      float* row = scratch(tl_row, size_t(2) * D);
      float* res = row + D;
      for (int64_t r = 0; r < rows; ++r) {
        const int l = int(r % L);
        load_row(x.ptr, xdt, row_offset(x, r), x.strides.back(), D, row);
        const float* c = cs + size_t(l) * half;
        const float* s = cs + size_t(L + l) * half;
        for (int j = 0; j < half; ++j) {
          const int a = trad ? 2 * j : j, b = trad ? 2 * j + 1 : j + half;
          res[a] = row[a] * c[j] - row[b] * s[j];
          res[b] = row[a] * s[j] + row[b] * c[j];
        }
        for (int d = 2 * half; d < D; ++d) res[d] = row[d];
        store_row(optr, odt, r * D, D, res);
      }
    });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mlx_flash._ext kernels run on the CPU stream only");
  }
  const char* name() const override { return "FlashRoPE"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const FlashRoPE&>(other);
    return dims_ == o.dims_ && traditional_ == o.traditional_ && base_ == o.base_ && scale_ == o.scale_ &&
           offset_ == o.offset_ && has_freqs_ == o.has_freqs_;
  }

 private:
  int dims_;
  bool traditional_;
  float base_, scale_;
  int offset_;
  bool has_freqs_;
};

// ----------------------------------------------------------------------------------------------
// Attention: one chunk per (batch, kv head) handles that head's group of query heads, so each key
// and value row is converted to float32 once.
struct AttnCtx {
  View q, k, v;
  int B, Hq, Hkv, Lq, Lk, D, Dv, odt;
  float scale;
  bool causal;
  uint8_t* out;
};

void attention_chunk(const void* vctx, int chunk) {
  const AttnCtx& c = *static_cast<const AttnCtx*>(vctx);
  const int b = chunk / c.Hkv, hk = chunk % c.Hkv, G = c.Hq / c.Hkv, Q = G * c.Lq;
  const int qdt = scalar_type(c.q.dtype), kdt = scalar_type(c.k.dtype), vdt = scalar_type(c.v.dtype);
  float* qf = scratch(tl_row, size_t(Q) * c.D + c.D + c.Dv + size_t(Q) * c.Dv);
  float* kv = qf + size_t(Q) * c.D;        // one key or value row
  float* acc = kv + std::max(c.D, c.Dv);   // [Q, Dv]
  float* p = scratch(tl_scores, size_t(Q) * c.Lk);
  const auto& qs = c.q.strides;
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < c.Lq; ++i) {
      const int64_t off = b * qs[0] + int64_t(hk * G + g) * qs[1] + int64_t(i) * qs[2];
      float* dst = qf + size_t(g * c.Lq + i) * c.D;
      load_row(c.q.ptr, qdt, off, qs[3], c.D, dst);
      for (int d = 0; d < c.D; ++d) dst[d] *= c.scale;
    }
  // Query i sees keys [0, limit(i)).
  auto limit = [&](int i) { return c.causal ? std::min(c.Lk, c.Lk - c.Lq + i + 1) : c.Lk; };
  const auto& ks = c.k.strides;
  for (int j = 0; j < c.Lk; ++j) {
    load_row(c.k.ptr, kdt, b * ks[0] + int64_t(hk) * ks[1] + int64_t(j) * ks[2], ks[3], c.D, kv);
    for (int t = 0; t < Q; ++t)
      p[size_t(t) * c.Lk + j] = j < limit(t % c.Lq) ? dot(qf + size_t(t) * c.D, kv, c.D)
                                                     : -std::numeric_limits<float>::infinity();
  }
  for (int t = 0; t < Q; ++t) {  // softmax over each row of scores
    float* pr = p + size_t(t) * c.Lk;
    const int n = limit(t % c.Lq);
    float mx_ = -std::numeric_limits<float>::infinity(), sum = 0.f;
    for (int j = 0; j < n; ++j) mx_ = std::max(mx_, pr[j]);
    for (int j = 0; j < n; ++j) sum += (pr[j] = std::exp(pr[j] - mx_));
    const float r = n > 0 ? 1.f / sum : std::numeric_limits<float>::quiet_NaN();
    for (int j = 0; j < n; ++j) pr[j] *= r;
    for (int j = n; j < c.Lk; ++j) pr[j] = 0.f;
  }
  std::fill(acc, acc + size_t(Q) * c.Dv, 0.f);
  const auto& vs = c.v.strides;
  for (int j = 0; j < c.Lk; ++j) {
    load_row(c.v.ptr, vdt, b * vs[0] + int64_t(hk) * vs[1] + int64_t(j) * vs[2], vs[3], c.Dv, kv);
    for (int t = 0; t < Q; ++t) {
      const float w = p[size_t(t) * c.Lk + j];
      if (w == 0.f) continue;
      float* a = acc + size_t(t) * c.Dv;
      for (int d = 0; d < c.Dv; ++d) a[d] += w * kv[d];
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < c.Lq; ++i) {
      const int64_t row = (int64_t(b) * c.Hq + hk * G + g) * c.Lq + i;
      const float* a = acc + size_t(g * c.Lq + i) * c.Dv;
      if (limit(i) <= 0) {
        std::vector<float> nan(c.Dv, std::numeric_limits<float>::quiet_NaN());
        store_row(c.out, c.odt, row * c.Dv, c.Dv, nan.data());
      } else {
        store_row(c.out, c.odt, row * c.Dv, c.Dv, a);
      }
    }
}

class FlashAttention : public mx::Primitive {
 public:
  FlashAttention(mx::Stream s, float scale, bool causal) : mx::Primitive(s), scale_(scale), causal_(causal) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    AttnCtx c;
    c.q = View::of(inputs[0]);
    c.k = View::of(inputs[1]);
    c.v = View::of(inputs[2]);
    c.B = inputs[0].shape(0);
    c.Hq = inputs[0].shape(1);
    c.Lq = inputs[0].shape(2);
    c.D = inputs[0].shape(3);
    c.Hkv = inputs[1].shape(1);
    c.Lk = inputs[1].shape(2);
    c.Dv = inputs[2].shape(3);
    c.odt = scalar_type(out.dtype());
    c.scale = scale_;
    c.causal = causal_;
    c.out = allocate_output(out);
    dispatch(stream(), inputs, out, [c]() {
      const int chunks = c.B * c.Hkv;
      if (chunks == 0 || c.Lq == 0 || c.Dv == 0) return;
      // Below ~64k multiply-adds a second thread costs more than it saves.
      const int64_t work = int64_t(c.Hq) * c.Lq * c.Lk * (c.D + c.Dv);
      if (work < (64 << 10) || chunks == 1) {
        for (int i = 0; i < chunks; ++i) attention_chunk(&c, i);
      } else {
        flash::parallel_for(chunks, attention_chunk, &c);
      }
    });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mlx_flash._ext kernels run on the CPU stream only");
  }
  const char* name() const override { return "FlashAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const FlashAttention&>(other);
    return scale_ == o.scale_ && causal_ == o.causal_;
  }

 private:
  float scale_;
  bool causal_;
};

void check_float(const mx::array& a, const char* what) {
  if (a.dtype() != mx::float32 && a.dtype() != mx::float16 && a.dtype() != mx::bfloat16)
    fail(std::string(what) + " must be float32, float16 or bfloat16");
}

}  // namespace

mx::array norm(const mx::array& x, const std::optional<mx::array>& w, const std::optional<mx::array>& b, float eps,
               bool center) {
  mx::Stream s = cpu_stream();
  check_float(x, "x");
  const char* op = center ? "layer_norm" : "rms_norm";
  if (x.ndim() < 1) fail(std::string(op) + ": x must have at least one dimension");
  std::vector<mx::array> inputs = {x};
  mx::Dtype out_dtype = x.dtype();
  for (const auto* p : {&w, &b}) {
    if (!*p) continue;
    const auto& a = **p;
    const char* what = p == &w ? "weight" : "bias";
    check_float(a, what);
    if (a.ndim() != 1 || a.shape(0) != x.shape(-1))
      fail(std::string(op) + ": " + what + " must have shape (" + std::to_string(x.shape(-1)) + ",), got " +
           shape_str(a));
    out_dtype = mx::promote_types(out_dtype, a.dtype());
    inputs.push_back(a);
  }
  return mx::array(x.shape(), out_dtype, std::make_shared<FlashNorm>(s, center, eps, w.has_value(), b.has_value()),
                   std::move(inputs));
}

mx::array rms_norm(const mx::array& x, const std::optional<mx::array>& w, float eps) {
  return norm(x, w, std::nullopt, eps, false);
}

mx::array layer_norm(const mx::array& x, const std::optional<mx::array>& w, const std::optional<mx::array>& b,
                     float eps) {
  return norm(x, w, b, eps, true);
}

mx::array rope(const mx::array& x, int dims, bool traditional, float base, float scale, int offset,
               const std::optional<mx::array>& freqs) {
  mx::Stream s = cpu_stream();
  check_float(x, "x");
  if (x.ndim() < 2) fail("rope: x must have at least 2 dimensions (..., L, D), got " + shape_str(x));
  if (dims <= 0 || dims % 2 || dims > x.shape(-1))
    fail("rope: dims must be even and in (0, " + std::to_string(x.shape(-1)) + "], got " + std::to_string(dims));
  std::vector<mx::array> inputs = {x};
  if (freqs) {
    if (freqs->ndim() != 1 || freqs->shape(0) != dims / 2)
      fail("rope: freqs must have shape (" + std::to_string(dims / 2) + ",), got " + shape_str(*freqs));
    check_float(*freqs, "freqs");
    inputs.push_back(*freqs);
  }
  return mx::array(x.shape(), x.dtype(),
                   std::make_shared<FlashRoPE>(s, dims, traditional, base, scale, offset, freqs.has_value()),
                   std::move(inputs));
}

mx::array attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale, bool causal) {
  mx::Stream s = cpu_stream();
  check_float(q, "queries");
  check_float(k, "keys");
  check_float(v, "values");
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4)
    fail("attention: queries, keys and values must be 4-D (B, H, L, D)");
  if (k.shape(0) != q.shape(0) || v.shape(0) != q.shape(0) || k.shape(1) != v.shape(1) || k.shape(2) != v.shape(2) ||
      k.shape(3) != q.shape(3))
    fail("attention: shapes do not match: queries " + shape_str(q) + ", keys " + shape_str(k) + ", values " +
         shape_str(v));
  if (k.shape(1) == 0 || q.shape(1) % k.shape(1))
    fail("attention: query heads (" + std::to_string(q.shape(1)) + ") must be a multiple of key/value heads (" +
         std::to_string(k.shape(1)) + ")");
  mx::Shape out_shape = q.shape();
  out_shape[3] = v.shape(3);
  mx::Dtype out_dtype = mx::promote_types(q.dtype(), mx::promote_types(k.dtype(), v.dtype()));
  return mx::array(out_shape, out_dtype, std::make_shared<FlashAttention>(s, scale, causal), {q, k, v});
}

}  // namespace flash_ext
