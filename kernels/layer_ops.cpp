// RMSNorm, RoPE and attention as single MLX CPU primitives (see layer_ops.h). All arithmetic is
// float32; each output element is rounded once to the output dtype (RMSNorm rounds x * rsqrt
// before the weight multiply, as MLX does).

#include "layer_ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "arg_checks.h"
#include "cpu_features.h"
#include "matvec.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx_view.h"
#include "primitive.h"
#include "row_ops.h"
#include "thread_pool.h"

namespace flash_ext {

namespace {

// ----------------------------------------------------------------------------------------------
// RMSNorm (center = false) and LayerNorm (center = true: subtract the mean, then the variance).
// Rounding follows MLX: the normalised x is rounded to the output dtype, then each affine step.
class FlashNorm : public CpuPrimitive {
 public:
  FlashNorm(mx::Stream s, bool center, float eps, bool has_weight, bool has_bias)
      : CpuPrimitive(s), center_(center), eps_(eps), has_weight_(has_weight), has_bias_(has_bias) {}

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
    dispatch(stream(), inputs, {out}, [=]() {
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
        normalize_row(row, D, center, eps, has_w ? wb : nullptr, has_b ? wb + D : nullptr, odt);
        store_row(optr, odt, r * D, D, row);
      }
    });
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
class FlashRoPE : public CpuPrimitive {
 public:
  FlashRoPE(mx::Stream s, int dims, bool traditional, float base, float scale, int offset, bool has_freqs)
      : CpuPrimitive(s), dims_(dims), traditional_(traditional), base_(base), scale_(scale), offset_(offset),
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
    dispatch(stream(), inputs, {out}, [=]() {
      const int D = int(x.shape.back());
      const int L = int(x.shape[x.shape.size() - 2]);
      if (D == 0 || L == 0) return;
      const int64_t rows = x.size() / D;
      float* cs = scratch(tl_aux, size_t(2) * L * (dims / 2));
      rope_tables(dims, base, scale, offset, L, has_f ? &freqs : nullptr, cs);
      const int xdt = scalar_type(x.dtype);
      float* row = scratch(tl_row, size_t(2) * D);
      for (int64_t r = 0; r < rows; ++r) {
        load_row(x.ptr, xdt, row_offset(x, r), x.strides.back(), D, row);
        rope_row(row, row + D, D, dims, trad, cs, L, int(r % L));
        store_row(optr, odt, r * D, D, row + D);
      }
    });
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
// Attention: one chunk per (batch, kv head, block of queries) handles that head's group of query
// heads for those queries, so each key and value row is converted to float32 once per block. Blocks
// of queries (prompts) give the threads many chunks to share: with one chunk per kv head, SmolLM2's
// 3 kv heads left one of 2 threads idle a third of the time.
struct AttnCtx {
  View q, k, v;
  int B, Hq, Hkv, Lq, Lk, D, Dv, odt;
  int q_block, q_blocks;  // queries per chunk, chunks per (batch, kv head)
  float scale;
  bool causal;
  bool heads_last;  // output [B, Lq, Hq * Dv] (what the o_proj reads) instead of [B, Hq, Lq, Dv]
  uint8_t* out;
};

thread_local std::vector<float> tl_kv;  // a chunk's keys and values as float rows (tiles)

void attention_chunk(const void* vctx, int chunk) {
  const AttnCtx& c = *static_cast<const AttnCtx*>(vctx);
  const int bh = chunk / c.q_blocks, b = bh / c.Hkv, hk = bh % c.Hkv, G = c.Hq / c.Hkv;
  const int i0 = (chunk % c.q_blocks) * c.q_block, nq = std::min(c.Lq, i0 + c.q_block) - i0, Q = G * nq;
  const int qdt = scalar_type(c.q.dtype), kdt = scalar_type(c.k.dtype), vdt = scalar_type(c.v.dtype);
  float* qf = scratch(tl_row, size_t(Q) * c.D + c.D + c.Dv + size_t(Q) * c.Dv);
  float* kv = qf + size_t(Q) * c.D;        // one key or value row
  float* acc = kv + std::max(c.D, c.Dv);   // [Q, Dv]
  const auto& qs = c.q.strides;
  // Row t of the chunk: query head hk * G + t / nq, query i0 + t % nq.
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < nq; ++i) {
      const int64_t off = b * qs[0] + int64_t(hk * G + g) * qs[1] + int64_t(i0 + i) * qs[2];
      float* dst = qf + size_t(g * nq + i) * c.D;
      load_row(c.q.ptr, qdt, off, qs[3], c.D, dst);
      for (int d = 0; d < c.D; ++d) dst[d] *= c.scale;
    }
  // Query i sees keys [0, limit(i)); the chunk's last query sees the most.
  auto limit = [&](int i) { return c.causal ? std::min(c.Lk, c.Lk - c.Lq + i + 1) : c.Lk; };
  const int Lk = std::max(0, limit(i0 + nq - 1));
  float* p = scratch(tl_scores, size_t(Q) * Lk);
  const bool simd = flash::simd_active();
  const auto& ks = c.k.strides;
  const auto& vs = c.v.strides;
  // Several query rows (a prompt block) and vector-sized heads: keys and values as float rows once,
  // then register tiles (scores past a query's limit are computed and then dropped by the softmax).
  const bool tiles = FLASH_X86 && simd && Q >= 6 && c.D % 8 == 0 && c.Dv % 16 == 0;
  float* kf = nullptr;
  if (tiles) {
    const int Lk4 = (Lk + 3) / 4 * 4;
    kf = scratch(tl_kv, size_t(Lk4) * c.D + size_t(Lk) * c.Dv);
    for (int j = 0; j < Lk; ++j)
      load_row(c.k.ptr, kdt, b * ks[0] + int64_t(hk) * ks[1] + int64_t(j) * ks[2], ks[3], c.D, kf + size_t(j) * c.D);
    std::fill(kf + size_t(Lk) * c.D, kf + size_t(Lk4) * c.D, 0.f);
    flash::dot_tiles(qf, Q, kf, Lk, c.D, p, Lk);
  } else {
    for (int j = 0; j < Lk; ++j) {
      const float* key = row_f32(c.k.ptr, kdt, b * ks[0] + int64_t(hk) * ks[1] + int64_t(j) * ks[2], ks[3], c.D, kv);
      for (int t = 0; t < Q; ++t)
        p[size_t(t) * Lk + j] = j < limit(i0 + t % nq) ? dot_f32(simd, qf + size_t(t) * c.D, key, c.D)
                                                        : -std::numeric_limits<float>::infinity();
    }
  }
  for (int t = 0; t < Q; ++t) {  // softmax over each row of scores
    float* pr = p + size_t(t) * Lk;
    const int n = limit(i0 + t % nq);
    float mx_ = -std::numeric_limits<float>::infinity();
    for (int j = 0; j < n; ++j) mx_ = std::max(mx_, pr[j]);
    const float sum = exp_shift_sum(simd, pr, n, mx_);
    const float r = n > 0 ? 1.f / sum : std::numeric_limits<float>::quiet_NaN();
    for (int j = 0; j < n; ++j) pr[j] *= r;
    for (int j = std::max(n, 0); j < Lk; ++j) pr[j] = 0.f;
  }
  if (tiles) {
    float* vf = kf + size_t((Lk + 3) / 4 * 4) * c.D;
    for (int j = 0; j < Lk; ++j)
      load_row(c.v.ptr, vdt, b * vs[0] + int64_t(hk) * vs[1] + int64_t(j) * vs[2], vs[3], c.Dv, vf + size_t(j) * c.Dv);
#if FLASH_X86
    flash::avx2::values_tiles(p, Lk, Q, vf, Lk, c.Dv, acc);
#endif
  } else {
    std::fill(acc, acc + size_t(Q) * c.Dv, 0.f);
    for (int j = 0; j < Lk; ++j) {
      const float* val = row_f32(c.v.ptr, vdt, b * vs[0] + int64_t(hk) * vs[1] + int64_t(j) * vs[2], vs[3], c.Dv, kv);
      for (int t = 0; t < Q; ++t) {
        const float w = p[size_t(t) * Lk + j];
        if (w != 0.f) axpy_f32(simd, w, val, acc + size_t(t) * c.Dv, c.Dv);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int ii = 0; ii < nq; ++ii) {
      const int h = hk * G + g, i = i0 + ii;
      const int64_t row = c.heads_last ? (int64_t(b) * c.Lq + i) * c.Hq + h : (int64_t(b) * c.Hq + h) * c.Lq + i;
      const float* a = acc + size_t(g * nq + ii) * c.Dv;
      if (limit(i) <= 0) {
        std::vector<float> nan(c.Dv, std::numeric_limits<float>::quiet_NaN());
        store_row(c.out, c.odt, row * c.Dv, c.Dv, nan.data());
      } else {
        store_row(c.out, c.odt, row * c.Dv, c.Dv, a);
      }
    }
}

}  // namespace

void attention_into(const View& q, const View& k, const View& v, int n_keys, float scale, bool causal,
                    bool heads_last, uint8_t* out, int odt) {
  AttnCtx c;
  c.q = q;
  c.k = k;
  c.v = v;
  c.B = int(q.shape[0]);
  c.Hq = int(q.shape[1]);
  c.Lq = int(q.shape[2]);
  c.D = int(q.shape[3]);
  c.Hkv = int(k.shape[1]);
  c.Lk = n_keys;
  c.Dv = int(v.shape[3]);
  c.odt = odt;
  c.scale = scale;
  c.causal = causal;
  c.heads_last = heads_last;
  c.out = out;
  // Queries per chunk: all of them for decode; prompts in blocks of 16 (at least 4 chunks per thread
  // for SmolLM2's 3 kv heads from 32 queries on; causal blocks differ in cost, claimed as they come).
  c.q_block = std::min(c.Lq, 16);
  c.q_blocks = c.q_block > 0 ? (c.Lq + c.q_block - 1) / c.q_block : 0;
  const int chunks = c.B * c.Hkv * c.q_blocks;
  if (chunks == 0 || c.Lq == 0 || c.Dv == 0) return;
  // Below ~64k multiply-adds a second thread costs more than it saves.
  const int64_t work = int64_t(c.Hq) * c.Lq * c.Lk * (c.D + c.Dv);
  if (work < (64 << 10) || chunks == 1) {
    for (int i = 0; i < chunks; ++i) attention_chunk(&c, i);
  } else {
    flash::parallel_for(chunks, attention_chunk, &c);
  }
}

namespace {

class FlashAttention : public CpuPrimitive {
 public:
  // n_keys < 0: all of k's rows are keys.
  FlashAttention(mx::Stream s, float scale, bool causal, bool heads_last, int n_keys)
      : CpuPrimitive(s), scale_(scale), causal_(causal), heads_last_(heads_last), n_keys_(n_keys) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    const View q = View::of(inputs[0]), k = View::of(inputs[1]), v = View::of(inputs[2]);
    const int n_keys = n_keys_ >= 0 ? n_keys_ : int(k.shape[2]), odt = scalar_type(out.dtype());
    const float scale = scale_;
    const bool causal = causal_, heads_last = heads_last_;
    uint8_t* ptr = allocate_output(out);
    dispatch(stream(), inputs, {out}, [=]() { attention_into(q, k, v, n_keys, scale, causal, heads_last, ptr, odt); });
  }
  const char* name() const override { return "FlashAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const FlashAttention&>(other);
    return scale_ == o.scale_ && causal_ == o.causal_ && heads_last_ == o.heads_last_ && n_keys_ == o.n_keys_;
  }

 private:
  float scale_;
  bool causal_, heads_last_;
  int n_keys_;
};

// ----------------------------------------------------------------------------------------------
// Quantized embedding lookup: rows ids of an MLX affine-quantized table, dequantized as MLX's
// dequantize computes them on the CPU: w = round(round(q * scale) + bias) in the scales' dtype.
class FlashEmbedding : public CpuPrimitive {
 public:
  FlashEmbedding(mx::Stream s, int group_size, int bits) : CpuPrimitive(s), group_size_(group_size), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    const View ids = View::of(inputs[0]), w = View::of(inputs[1]), scales = View::of(inputs[2]),
               biases = View::of(inputs[3]);
    const bool ids_unsigned = inputs[0].dtype() == mx::uint32;
    const int gs = group_size_, bits = bits_, dt = scalar_type(out.dtype());
    uint8_t* ptr = allocate_output(out);
    dispatch(stream(), inputs, {out}, [=]() {
      const int64_t V = w.shape[0], K = int64_t(w.shape[1]) * 32 / bits, per = 32 / bits;
      const uint32_t mask = (1u << bits) - 1;
      std::vector<float> vals(static_cast<size_t>(K));
      for (int64_t i = 0; i < ids.size(); ++i) {
        int64_t r;
        if (ids_unsigned) {
          uint32_t u;
          std::memcpy(&u, ids.ptr + ids.offset(i) * 4, 4);
          r = u;
        } else {
          int32_t v;
          std::memcpy(&v, ids.ptr + ids.offset(i) * 4, 4);
          r = v;
        }
        if (r < 0 || r >= V) {
          std::fill(vals.begin(), vals.end(), std::numeric_limits<float>::quiet_NaN());
        } else {
          for (int64_t k = 0; k < K; ++k) {
            uint32_t word;
            std::memcpy(&word, w.ptr + (r * w.strides[0] + (k / per) * w.strides[1]) * 4, 4);
            const float q = float((word >> ((k % per) * bits)) & mask);
            const int64_t g = k / gs;
            const float sc = flash::load_scalar(scales.ptr, dt, r * scales.strides[0] + g * scales.strides[1]);
            const float bi = flash::load_scalar(biases.ptr, dt, r * biases.strides[0] + g * biases.strides[1]);
            volatile float product = q * sc;  // rounded on its own (never contracted into an FMA)
            float v = product;
            round_to(dt, &v, 1);
            v += bi;
            vals[size_t(k)] = v;
          }
        }
        store_row(ptr, dt, i * K, int(K), vals.data());
      }
    });
  }
  const char* name() const override { return "FlashEmbedding"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const FlashEmbedding&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_;
  }

 private:
  int group_size_, bits_;
};

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

void check_attention(const mx::array& q, const mx::array& k, const mx::array& v, bool heads_last,
                     std::optional<int> n_keys, mx::Shape& out_shape, mx::Dtype& out_dtype) {
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
  if (n_keys && (*n_keys < 0 || *n_keys > k.shape(2)))
    fail("attention: n_keys must be in [0, " + std::to_string(k.shape(2)) + "], got " + std::to_string(*n_keys));
  out_shape = q.shape();
  out_shape[3] = v.shape(3);
  if (heads_last) out_shape = {q.shape(0), q.shape(2), q.shape(1) * v.shape(3)};
  out_dtype = mx::promote_types(q.dtype(), mx::promote_types(k.dtype(), v.dtype()));
}

mx::array attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale, bool causal,
                    bool heads_last, std::optional<int> n_keys) {
  mx::Stream s = cpu_stream();
  mx::Shape out_shape;
  mx::Dtype out_dtype = mx::float32;
  check_attention(q, k, v, heads_last, n_keys, out_shape, out_dtype);
  return mx::array(out_shape, out_dtype, std::make_shared<FlashAttention>(s, scale, causal, heads_last, n_keys.value_or(-1)),
                   {q, k, v});
}

mx::array quantized_embedding(const mx::array& ids, const mx::array& w, const mx::array& scales,
                              const mx::array& biases, int group_size, int bits) {
  mx::Stream s = cpu_stream();
  if (ids.dtype() != mx::int32 && ids.dtype() != mx::uint32) fail("quantized_embedding: ids must be int32 or uint32");
  const int K = weight_k("quantized_embedding", w, bits);
  check_weights("quantized_embedding", w, scales, biases, K, group_size, bits, "the table's row size");
  mx::Shape shape = ids.shape();
  shape.push_back(K);
  return mx::array(shape, scales.dtype(), std::make_shared<FlashEmbedding>(s, group_size, bits),
                   {ids, w, scales, biases});
}

}  // namespace flash_ext
