// Fused decoder-layer primitives (see fused_ops.h).

#include "fused_ops.h"
#include "layer_ops.h"

#include <cmath>
#include <cstring>
#include <string>

#include "arg_checks.h"
#include "cpu_features.h"
#include "matvec.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx_view.h"
#include "primitive.h"
#include "row_ops.h"

namespace flash_ext {

namespace {

thread_local std::vector<float> tl_x, tl_y, tl_tmp, tl_mid;
thread_local std::vector<uint8_t> tl_bytes;

// What eval needs of one projection: its weights and optional bias.
struct ProjView {
  View w, scales, biases, bias;
  bool has_bias = false;
};

// Inputs are laid out as x, [norm weight], then per projection w, [scales, biases], [bias].
struct FusedLayout {
  bool has_norm = false, quant = false;
  int n_proj = 0;
  std::vector<bool> has_bias;
};

std::vector<mx::array> fused_inputs(const mx::array& x, const std::optional<mx::array>& norm_weight,
                                    const std::vector<Linear>& projs, FusedLayout& layout) {
  std::vector<mx::array> inputs = {x};
  layout.has_norm = norm_weight.has_value();
  if (norm_weight) inputs.push_back(*norm_weight);
  layout.n_proj = int(projs.size());
  for (const auto& p : projs) {
    inputs.push_back(p.w);
    if (p.scales) {
      inputs.push_back(*p.scales);
      inputs.push_back(*p.biases);
    }
    layout.has_bias.push_back(p.bias.has_value());
    if (p.bias) inputs.push_back(*p.bias);
  }
  return inputs;
}

// x as float32 rows [M, D] in tl_x, normalised as mx.fast.rms_norm would (then rounded to its dtype hdt).
float* normed_input(const View& x, const View* norm_w, float eps, int hdt) {
  const int D = int(x.shape.back());
  const int64_t M = x.size() / std::max(D, 1);
  float* xin = scratch(tl_x, size_t(M) * D + D);
  to_float(x, xin);
  if (norm_w) {
    float* w = xin + size_t(M) * D;
    load_row(norm_w->ptr, scalar_type(norm_w->dtype), 0, norm_w->strides.back(), D, w);
    for (int64_t r = 0; r < M; ++r) {
      float* row = xin + size_t(r) * D;
      normalize_row(row, D, false, eps, w, nullptr, hdt);
      round_to(hdt, row, D);
    }
  }
  return xin;
}

// Problem for projection j over input rows xin [M, K] into float32 out [M, N].
void set_problem(flash::Problem& p, const ProjView& v, int fmt, int gs, WeightCopies& copies, const float* xin,
                 int M, float* out, bool q8x) {
  const bool quant = fmt == flash::FMT_Q4 || fmt == flash::FMT_Q8;
  set_weights(p, fmt, gs, v.w, quant ? &v.scales : nullptr, quant ? &v.biases : nullptr, copies);
  p.n = p.N;
  p.M = M;
  p.in = xin;
  p.out = out;
  p.out_dtype = flash::DT_F32;
  p.q8_activations = q8x && quant;
}

// The second stage of a fused op: out = round(xin @ W.T, ydt) + add (the residual), with xin float32
// rows [M, K] and add / out [M, N] contiguous in their dtypes, as FlashMatvec computes it with `add`.
void residual_matvec(const ProjView& v, int fmt, int gs, const float* xin, int M, const View& add, int ydt,
                     uint8_t* out, int odt, bool q8x) {
  const int N = int(v.w.shape[0]);
  float* y = scratch(tl_mid, size_t(2) * M * N);
  flash::Problem p;
  WeightCopies copies;
  set_problem(p, v, fmt, gs, copies, xin, M, y, q8x);
  flash::matvec(p);
  store_residual(y, add, int64_t(M) * N, ydt, out, odt, y + size_t(M) * N);
}

// Views of a stage projection's inputs from inputs[next] on (w, then scales / biases when quantized),
// as check_stage_projection appended them; advances next past them.
ProjView stage_projection_view(const std::vector<mx::array>& inputs, size_t& next, int fmt) {
  ProjView v;
  v.w = View::of(inputs[next++]);
  if (fmt == flash::FMT_Q4 || fmt == flash::FMT_Q8) {
    v.scales = View::of(inputs[next++]);
    v.biases = View::of(inputs[next++]);
  }
  return v;
}

// Room for n values of any float dtype between two stages of a fused op (this thread's).
uint8_t* stage_buffer(size_t n) {
  if (tl_bytes.size() < n * 4) tl_bytes.resize(n * 4);
  return tl_bytes.data();
}

// A stage's input: values of dtype dt rounded as an MLX array of that dtype would hold them, as float32.
float* rounded_rows(const uint8_t* bytes, int dt, int64_t n) {
  float* x = scratch(tl_x, size_t(n));
  flash::load_floats(bytes, dt, n, x);
  return x;
}

// Views of x, the norm weight and the projections (inputs in fused_inputs' order); next: the index of
// the first input after them.
struct FusedViews {
  View x, norm_w;
  std::vector<ProjView> projs;
  size_t next = 0;
};

FusedViews fused_views(const std::vector<mx::array>& inputs, const FusedLayout& layout) {
  FusedViews v;
  v.x = View::of(inputs[0]);
  v.next = 1;
  if (layout.has_norm) v.norm_w = View::of(inputs[v.next++]);
  v.projs.resize(layout.n_proj);
  for (int j = 0; j < layout.n_proj; ++j) {
    ProjView& p = v.projs[j];
    p.w = View::of(inputs[v.next++]);
    if (layout.quant) {
      p.scales = View::of(inputs[v.next++]);
      p.biases = View::of(inputs[v.next++]);
    }
    p.has_bias = layout.has_bias[j];
    if (p.has_bias) p.bias = View::of(inputs[v.next++]);
  }
  return v;
}

// Whether the two cache buffers inputs[first], inputs[first + 1] can be written in place (donated
// to the outputs, as MLX's slice_update does when nothing else refers to its input). Two things
// besides a real reader keep MLX's is_donatable() false during decoding, and both are let go here:
// - every output of a multi-output primitive holds its own copy of the inputs until MLX detaches
//   them right after eval_cpu; the copies of the outputs not being evaluated are dropped now;
// - the previous token's tasks, still queued on the stream when mlx-lm's pipelined generation
//   evaluates the next token's graph, keep the buffer's data alive; if that is all that holds it,
//   waiting for the stream makes it donatable. The wait ends when the previous token is computed,
//   which generation waits for anyway before it reads that token; it happens in the first layer,
//   later layers find their caches free.
// Only queued tasks (or other views of the buffer) hold the data beyond its own array; someone else
// holding the array itself (a saved prompt cache) shares its descriptor instead, which no wait
// changes, so then there is no wait: the buffer is copied.
bool donatable_caches(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs, size_t first,
                      mx::Stream s) {
  if (outputs[0].is_tracer()) return false;  // under a transformation MLX keeps the inputs alive
  for (auto& o : outputs)
    if (&o.inputs() != &inputs) o.inputs().clear();
  const mx::array &k = inputs[first], &v = inputs[first + 1];
  auto free = [&]() {
    return k.is_donatable() && v.is_donatable() && k.flags().row_contiguous && v.flags().row_contiguous;
  };
  if (free()) return true;
  if (k.data_shared_ptr().use_count() == 1 && v.data_shared_ptr().use_count() == 1) return false;
  mx::synchronize(s);
  return free();
}

// ----------------------------------------------------------------------------------------------
class FlashQKV : public CpuPrimitive {
 public:
  struct Params {
    FusedLayout layout;
    int fmt, group_size, hdt, ydt;  // hdt: normed x dtype; ydt: the matvec outputs' dtype
    float eps;
    int n_heads, n_kv_heads, head_dim, rope_dims, offset;
    bool traditional, has_freqs, q8x;
    bool has_cache;  // k and v go into cache buffers [B, Hkv, S, hd] at positions offset.. (see header)
    float base, scale;
  };
  FlashQKV(mx::Stream s, Params p) : CpuPrimitive(s), p_(std::move(p)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const Params P = p_;
    const FusedViews in = fused_views(inputs, P.layout);
    const View &x = in.x, &norm_w = in.norm_w;
    const std::vector<ProjView>& views = in.projs;
    View freqs;
    if (P.has_freqs) freqs = View::of(inputs[in.next]);
    uint8_t* out[3];
    int odt[3];
    int64_t rows_out[3];  // rows (of head_dim) per (batch, head) in each output: L, or the cache's S
    View old[3];          // a cache buffer that could not be donated: copied into its output first
    const bool donate = P.has_cache && donatable_caches(inputs, outputs, in.next + P.has_freqs, stream());
    for (int j = 0; j < 3; ++j) {
      const size_t c = in.next + P.has_freqs + j - 1;  // k -> k cache, v -> v cache
      rows_out[j] = outputs[j].shape(2);
      if (j > 0 && donate) {
        outputs[j].copy_shared_buffer(inputs[c]);  // written in place, as MLX's slice_update does
        out[j] = outputs[j].data<uint8_t>();
      } else {
        out[j] = allocate_output(outputs[j]);
        if (j > 0 && P.has_cache) old[j] = View::of(inputs[c]);
      }
      odt[j] = scalar_type(outputs[j].dtype());
    }
    dispatch(stream(), inputs, outputs, [=]() {
      const int B = int(x.shape[0]), L = int(x.shape[1]), M = B * L, hd = P.head_dim;
      for (int j = 1; j < 3; ++j) {
        if (!old[j].ptr) continue;
        const size_t item = mx::size_of(old[j].dtype);
        if (old[j].contiguous) {
          std::memcpy(out[j], old[j].ptr, size_t(old[j].size()) * item);
        } else {
          for (int64_t i = 0; i < old[j].size(); ++i)
            std::memcpy(out[j] + i * item, old[j].ptr + old[j].offset(i) * item, item);
        }
      }
      if (M == 0) return;
      const float* xin = normed_input(x, P.layout.has_norm ? &norm_w : nullptr, P.eps, P.hdt);
      const int heads[3] = {P.n_heads, P.n_kv_heads, P.n_kv_heads};
      int64_t total = 0;
      for (int j = 0; j < 3; ++j) total += int64_t(heads[j]) * hd;
      float* y = scratch(tl_y, size_t(M) * total);
      flash::Problem ps[3];
      WeightCopies copies[3];
      float* yj[3];
      for (int j = 0, off = 0; j < 3; off += M * heads[j] * hd, ++j) {
        yj[j] = y + off;
        set_problem(ps[j], views[j], P.fmt, P.group_size, copies[j], xin, M, yj[j], P.q8x);
      }
      flash::matvec_many(ps, 3);
      const int half = P.rope_dims / 2;
      float* cs = scratch(tl_tmp, size_t(2) * L * half + hd + 2 * size_t(hd) * heads[0]);
      rope_tables(P.rope_dims, P.base, P.scale, P.offset, L, P.has_freqs ? &freqs : nullptr, cs);
      float* rot = cs + size_t(2) * L * half;
      float* bias = rot + hd;
      for (int j = 0; j < 3; ++j) {
        const int N = heads[j] * hd;
        if (views[j].has_bias) load_row(views[j].bias.ptr, scalar_type(views[j].bias.dtype), 0,
                                        views[j].bias.strides.back(), N, bias);
        for (int m = 0; m < M; ++m) {
          float* row = yj[j] + size_t(m) * N;
          round_to(P.ydt, row, N);  // the projection's output, as stored
          if (views[j].has_bias) {
            for (int i = 0; i < N; ++i) row[i] += bias[i];
            round_to(odt[j], row, N);
          }
          const int b = m / L, l = m % L;
          const int64_t pos = j > 0 && P.has_cache ? P.offset + l : l;
          for (int h = 0; h < heads[j]; ++h) {
            const float* src = row + size_t(h) * hd;
            const int64_t dst = ((int64_t(b) * heads[j] + h) * rows_out[j] + pos) * hd;
            if (j < 2) {
              rope_row(src, rot, hd, P.rope_dims, P.traditional, cs, L, l);
              store_row(out[j], odt[j], dst, hd, rot);
            } else {
              store_row(out[j], odt[j], dst, hd, src);
            }
          }
        }
      }
    });
  }
  const char* name() const override { return "FlashQKV"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const Params& o = static_cast<const FlashQKV&>(other).p_;
    return p_.layout.has_norm == o.layout.has_norm && p_.layout.has_bias == o.layout.has_bias &&
           p_.fmt == o.fmt && p_.group_size == o.group_size && p_.hdt == o.hdt && p_.ydt == o.ydt &&
           p_.eps == o.eps && p_.n_heads == o.n_heads && p_.n_kv_heads == o.n_kv_heads &&
           p_.head_dim == o.head_dim && p_.rope_dims == o.rope_dims && p_.offset == o.offset &&
           p_.traditional == o.traditional && p_.has_freqs == o.has_freqs && p_.q8x == o.q8x &&
           p_.has_cache == o.has_cache && p_.base == o.base && p_.scale == o.scale;
  }

 private:
  Params p_;
};

// ----------------------------------------------------------------------------------------------
class FlashSwiGLU : public CpuPrimitive {
 public:
  struct Params {
    FusedLayout layout;
    int fmt, group_size, hdt, ydt;
    float eps;
    bool q8x;
    // With a down projection (inputs after gate / up): out = x + round(down(g)), g the SwiGLU output
    // rounded to ydt; down has its own format and output dtype down_ydt.
    bool has_down = false;
    int down_fmt = 0, down_group_size = 0, down_ydt = 0;
  };
  FlashSwiGLU(mx::Stream s, Params p) : CpuPrimitive(s), p_(std::move(p)) {}

  struct Epilogue {
    const float *g, *u;
    int M, n, ydt, odt;
    uint8_t* out;
  };
  // silu(g) * u for rows [i0, i1) of every x row, each factor first rounded to the projections' dtype
  // (silu's exp 8 lanes at a time on the SIMD path: a scalar exp per element shows in a prompt's time).
  static void epilogue(const void* vctx, int i0, int i1) {
    const Epilogue& e = *static_cast<const Epilogue*>(vctx);
    const bool simd = flash::simd_active();
    float v[256];
    for (int m = 0; m < e.M; ++m)
      for (int i = i0; i < i1; i += 256) {
        const int len = std::min(256, i1 - i);
        const float* g = e.g + size_t(m) * e.n + i;
        const float* u = e.u + size_t(m) * e.n + i;
        for (int t = 0; t < len; ++t) v[t] = g[t];
        round_to(e.ydt, v, len);
        float uu[256];
        for (int t = 0; t < len; ++t) uu[t] = u[t];
        round_to(e.ydt, uu, len);
        silu_mul(simd, v, uu, len);
        store_row(e.out, e.odt, int64_t(m) * e.n + i, len, v);
      }
  }

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const Params P = p_;
    const FusedViews in = fused_views(inputs, P.layout);
    const View &x = in.x, &norm_w = in.norm_w;
    const std::vector<ProjView>& views = in.projs;
    size_t next = in.next;
    const ProjView down = P.has_down ? stage_projection_view(inputs, next, P.down_fmt) : ProjView{};
    uint8_t* out = allocate_output(outputs[0]);
    const int odt = scalar_type(outputs[0].dtype());
    dispatch(stream(), inputs, outputs, [=]() {
      const int D = int(x.shape.back());
      const int M = D == 0 ? 0 : int(x.size() / D);
      if (M == 0) return;
      const float* xin = normed_input(x, P.layout.has_norm ? &norm_w : nullptr, P.eps, P.hdt);
      const int n = int(views[0].w.shape[0]);
      float* y = scratch(tl_y, size_t(2) * M * n);
      flash::Problem ps[2];
      WeightCopies copies[2];
      for (int j = 0; j < 2; ++j) set_problem(ps[j], views[j], P.fmt, P.group_size, copies[j], xin, M, y + size_t(j) * M * n, P.q8x);
      uint8_t* g = out;  // the SwiGLU output: the result, or the down projection's input
      if (P.has_down) g = stage_buffer(size_t(M) * n);
      Epilogue e{y, y + size_t(M) * n, M, n, P.ydt, P.has_down ? P.ydt : odt, g};
      flash::matvec_many(ps, 2, &FlashSwiGLU::epilogue, &e);
      if (P.has_down)
        residual_matvec(down, P.down_fmt, P.down_group_size, rounded_rows(g, P.ydt, int64_t(M) * n), M, x,
                        P.down_ydt, out, odt, P.q8x);
    });
  }
  const char* name() const override { return "FlashSwiGLU"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const Params& o = static_cast<const FlashSwiGLU&>(other).p_;
    return p_.layout.has_norm == o.layout.has_norm && p_.fmt == o.fmt && p_.group_size == o.group_size &&
           p_.hdt == o.hdt && p_.ydt == o.ydt && p_.eps == o.eps && p_.q8x == o.q8x && p_.has_down == o.has_down &&
           p_.down_fmt == o.down_fmt && p_.down_group_size == o.down_group_size && p_.down_ydt == o.down_ydt;
  }

 private:
  Params p_;
};

// ----------------------------------------------------------------------------------------------
// Attention over a KV cache (FlashAttention's arithmetic, output [B, Lq, Hq * Dv] rounded to its
// dtype attn_dt) followed by o_proj and the residual: out = add + round(attn @ Wo.T, ydt).
class FlashAttnOut : public CpuPrimitive {
 public:
  struct Params {
    float scale;
    bool causal, q8x;
    int n_keys;  // < 0: all rows of k / v
    int fmt, group_size, attn_dt, ydt;
  };
  FlashAttnOut(mx::Stream s, Params p) : CpuPrimitive(s), p_(p) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const Params P = p_;
    const View q = View::of(inputs[0]), k = View::of(inputs[1]), v = View::of(inputs[2]);
    size_t next = 3;
    const ProjView o = stage_projection_view(inputs, next, P.fmt);
    const View add = View::of(inputs[next]);
    uint8_t* out = allocate_output(outputs[0]);
    const int odt = scalar_type(outputs[0].dtype());
    dispatch(stream(), inputs, outputs, [=]() {
      const int M = int(q.shape[0] * q.shape[2]), width = int(q.shape[1] * v.shape[3]);
      if (M == 0) return;
      uint8_t* attn = stage_buffer(size_t(M) * width);
      attention_into(q, k, v, P.n_keys >= 0 ? P.n_keys : int(k.shape[2]), P.scale, P.causal, true, attn, P.attn_dt);
      residual_matvec(o, P.fmt, P.group_size, rounded_rows(attn, P.attn_dt, int64_t(M) * width), M, add, P.ydt, out,
                      odt, P.q8x);
    });
  }
  const char* name() const override { return "FlashAttnOut"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const Params& o = static_cast<const FlashAttnOut&>(other).p_;
    return p_.scale == o.scale && p_.causal == o.causal && p_.q8x == o.q8x && p_.n_keys == o.n_keys &&
           p_.fmt == o.fmt && p_.group_size == o.group_size && p_.attn_dt == o.attn_dt && p_.ydt == o.ydt;
  }

 private:
  Params p_;
};

// A projection that follows a fused stage (input size K, no bias): checked, its arrays appended to
// inputs; returns its format.
int check_stage_projection(const char* op, const Linear& p, int K, int group_size, std::optional<int> bits,
                           std::vector<mx::array>& inputs) {
  const int fmt = check_weights(op, p.w, p.scales, p.biases, K, group_size, bits, "the stage's output size");
  if (p.bias) fail(std::string(op) + ": an output projection with a bias is not supported");
  inputs.push_back(p.w);
  if (bits) {
    inputs.push_back(*p.scales);
    inputs.push_back(*p.biases);
  }
  return fmt;
}

// Checks shared by both ops; returns the format and sets the dtypes of the normed input and outputs.
int check_fused(const char* op, const mx::array& x, const std::optional<mx::array>& norm_weight,
                const std::vector<Linear>& projs, int group_size, std::optional<int> bits, mx::Dtype& hdt,
                mx::Dtype& ydt) {
  check_float(x, std::string(op) + ": x");
  const int D = x.shape(-1);
  hdt = x.dtype();
  if (norm_weight) {
    if (norm_weight->ndim() != 1 || norm_weight->shape(0) != D)
      fail(std::string(op) + ": norm weight must have shape (" + std::to_string(D) + ",), got " + shape_str(*norm_weight));
    check_float(*norm_weight, std::string(op) + ": norm weight");
    hdt = mx::promote_types(hdt, norm_weight->dtype());
  }
  const int fmt = weight_format(projs[0].w, bits);
  for (const auto& p : projs) {
    if (check_weights(op, p.w, p.scales, p.biases, D, group_size, bits, "x last dimension") != fmt)
      fail(std::string(op) + ": projections must share one weight format");
    if (p.bias && (p.bias->ndim() != 1 || p.bias->shape(0) != p.w.shape(0)))
      fail(std::string(op) + ": bias must have shape (" + std::to_string(p.w.shape(0)) + ",)");
    if (p.bias) check_float(*p.bias, std::string(op) + ": bias");
  }
  const mx::Dtype wdt = bits ? projs[0].scales->dtype() : projs[0].w.dtype();
  ydt = mx::promote_types(hdt, wdt);
  return fmt;
}

}  // namespace

std::vector<mx::array> norm_qkv_rope(const mx::array& x, const std::optional<mx::array>& norm_weight, float eps,
                                     const std::vector<Linear>& qkv, int group_size, std::optional<int> bits,
                                     int n_heads, int n_kv_heads, int rope_dims, bool traditional, float base,
                                     float scale, int offset, const std::optional<mx::array>& freqs, bool q8x,
                                     const std::optional<mx::array>& k_cache, const std::optional<mx::array>& v_cache) {
  mx::Stream s = cpu_stream();
  if (qkv.size() != 3) fail("norm_qkv_rope: pass the q, k and v projections");
  if (x.ndim() != 3) fail("norm_qkv_rope: x must be (B, L, D), got " + shape_str(x));
  FlashQKV::Params P;
  mx::Dtype hdt = x.dtype(), ydt = x.dtype();
  P.fmt = check_fused("norm_qkv_rope", x, norm_weight, qkv, group_size, bits, hdt, ydt);
  if (n_heads <= 0 || n_kv_heads <= 0 || qkv[0].w.shape(0) % n_heads)
    fail("norm_qkv_rope: q rows must be a multiple of n_heads");
  const int hd = qkv[0].w.shape(0) / n_heads;
  if (qkv[1].w.shape(0) != n_kv_heads * hd || qkv[2].w.shape(0) != n_kv_heads * hd)
    fail("norm_qkv_rope: k and v must have n_kv_heads * head_dim = " + std::to_string(n_kv_heads * hd) + " rows");
  if (rope_dims <= 0 || rope_dims % 2 || rope_dims > hd)
    fail("norm_qkv_rope: rope dims must be even and in (0, " + std::to_string(hd) + "]");
  if (freqs && (freqs->ndim() != 1 || freqs->shape(0) != rope_dims / 2))
    fail("norm_qkv_rope: freqs must have shape (" + std::to_string(rope_dims / 2) + ",)");
  if (freqs) check_float(*freqs, "norm_qkv_rope: freqs");
  FusedLayout layout;
  std::vector<mx::array> inputs = fused_inputs(x, norm_weight, qkv, layout);
  layout.quant = bits.has_value();
  if (freqs) inputs.push_back(*freqs);
  if (k_cache.has_value() != v_cache.has_value()) fail("norm_qkv_rope: pass both caches or neither");
  P.has_cache = k_cache.has_value();
  P.layout = layout;
  P.group_size = bits ? group_size : 0;
  P.hdt = scalar_type(hdt);
  P.ydt = scalar_type(ydt);
  P.eps = eps;
  P.n_heads = n_heads;
  P.n_kv_heads = n_kv_heads;
  P.head_dim = hd;
  P.rope_dims = rope_dims;
  P.offset = offset;
  P.traditional = traditional;
  P.has_freqs = freqs.has_value();
  P.q8x = q8x && bits.has_value();
  P.base = base;
  P.scale = scale;
  const int B = x.shape(0), L = x.shape(1);
  std::vector<mx::Shape> shapes;
  std::vector<mx::Dtype> dtypes;
  for (int j = 0; j < 3; ++j) {
    shapes.push_back({B, j == 0 ? n_heads : n_kv_heads, L, hd});
    dtypes.push_back(qkv[j].bias ? mx::promote_types(ydt, qkv[j].bias->dtype()) : ydt);
  }
  if (P.has_cache) {
    for (int j = 1; j < 3; ++j) {
      const mx::array& c = j == 1 ? *k_cache : *v_cache;
      if (c.ndim() != 4 || c.shape(0) != B || c.shape(1) != n_kv_heads || c.shape(3) != hd ||
          offset < 0 || int64_t(offset) + L > c.shape(2))
        fail("norm_qkv_rope: a cache must be (" + std::to_string(B) + ", " + std::to_string(n_kv_heads) +
             ", S, " + std::to_string(hd) + ") with S >= offset + L = " + std::to_string(int64_t(offset) + L) +
             ", got " + shape_str(c));
      if (c.dtype() != dtypes[j]) fail("norm_qkv_rope: cache dtype must be the projections' output dtype");
      shapes[j] = c.shape();
      inputs.push_back(c);
    }
  }
  return mx::array::make_arrays(std::move(shapes), dtypes, std::make_shared<FlashQKV>(s, std::move(P)), inputs);
}

mx::array norm_swiglu(const mx::array& x, const std::optional<mx::array>& norm_weight, float eps, const Linear& gate,
                      const Linear& up, int group_size, std::optional<int> bits, bool q8x,
                      const std::optional<Linear>& down, int down_group_size, std::optional<int> down_bits) {
  mx::Stream s = cpu_stream();
  if (x.ndim() < 1) fail("norm_swiglu: x must have at least one dimension");
  if (gate.bias || up.bias) fail("norm_swiglu: projections with a bias are not supported");
  FlashSwiGLU::Params P;
  mx::Dtype hdt = x.dtype(), ydt = x.dtype();
  P.fmt = check_fused("norm_swiglu", x, norm_weight, {gate, up}, group_size, bits, hdt, ydt);
  if (gate.w.shape(0) != up.w.shape(0)) fail("norm_swiglu: gate and up must have the same rows");
  FusedLayout layout;
  std::vector<mx::array> inputs = fused_inputs(x, norm_weight, {gate, up}, layout);
  layout.quant = bits.has_value();
  P.layout = layout;
  P.group_size = bits ? group_size : 0;
  P.hdt = scalar_type(hdt);
  P.ydt = scalar_type(ydt);
  P.eps = eps;
  P.q8x = q8x && bits.has_value();
  mx::Shape shape = x.shape();
  shape.back() = gate.w.shape(0);
  mx::Dtype out_dtype = ydt;
  if (down) {
    P.has_down = true;
    P.down_fmt = check_stage_projection("norm_swiglu", *down, gate.w.shape(0), down_group_size, down_bits, inputs);
    P.down_group_size = down_bits ? down_group_size : 0;
    if (down->w.shape(0) != x.shape(-1))
      fail("norm_swiglu: down must have " + std::to_string(x.shape(-1)) + " rows (x's last dimension)");
    const mx::Dtype down_ydt = mx::promote_types(ydt, down_bits ? down->scales->dtype() : down->w.dtype());
    P.down_ydt = scalar_type(down_ydt);
    shape = x.shape();
    out_dtype = mx::promote_types(down_ydt, x.dtype());
  }
  return mx::array(shape, out_dtype, std::make_shared<FlashSwiGLU>(s, std::move(P)), std::move(inputs));
}

mx::array attention_o_proj(const mx::array& q, const mx::array& k, const mx::array& v, float scale, bool causal,
                           std::optional<int> n_keys, const Linear& o, int group_size, std::optional<int> bits,
                           const mx::array& residual, bool q8x) {
  mx::Stream s = cpu_stream();
  mx::Shape attn_shape;  // [B, Lq, Hq * Dv]
  mx::Dtype attn_dtype = mx::float32;
  check_attention(q, k, v, true, n_keys, attn_shape, attn_dtype);
  FlashAttnOut::Params P;
  P.scale = scale;
  P.causal = causal;
  P.n_keys = n_keys.value_or(-1);
  P.attn_dt = scalar_type(attn_dtype);
  std::vector<mx::array> inputs = {q, k, v};
  P.fmt = check_stage_projection("attention_o_proj", o, attn_shape[2], group_size, bits, inputs);
  P.group_size = bits ? group_size : 0;
  P.q8x = q8x && bits.has_value();
  const mx::Dtype ydt = mx::promote_types(attn_dtype, bits ? o.scales->dtype() : o.w.dtype());
  P.ydt = scalar_type(ydt);
  const mx::Shape shape{attn_shape[0], attn_shape[1], o.w.shape(0)};
  if (residual.shape() != shape)
    fail("attention_o_proj: residual must have shape " + shape_str(shape) + ", got " + shape_str(residual));
  scalar_type(residual.dtype());
  inputs.push_back(residual);
  return mx::array(shape, mx::promote_types(ydt, residual.dtype()), std::make_shared<FlashAttnOut>(s, P),
                   std::move(inputs));
}

}  // namespace flash_ext
