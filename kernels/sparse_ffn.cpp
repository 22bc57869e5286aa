// A flash layer's FFN on its current rows as one CPU primitive (see sparse_ffn.h).

#include "sparse_ffn.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "arg_checks.h"
#include "cpu_features.h"
#include "matvec.h"
#include "mlx/ops.h"
#include "mlx_view.h"
#include "primitive.h"
#include "row_ops.h"

namespace flash_ext {

namespace {

thread_local std::vector<float> tl_x, tl_gu, tl_h, tl_y, tl_part, tl_add, tl_act;
thread_local std::vector<int32_t> tl_rows;

// g[i] = nn.silu(g[i]) for n values of dtype dt as MLX's CPU computes it: sigmoid from exp(|g|)
// (rounded to dt) as 1 / (1 + e) or 1 minus that, rounded to dt, times g, rounded to dt (every
// float16 and bfloat16 value checked). tmp: room for 2n floats.
void mlx_silu(float* g, int64_t n, int dt, float* tmp) {
  float *e = tmp, *s = tmp + n;
  flash::mlx_exp_abs(flash::simd_active(), g, e, n);
  round_to(dt, e, int(n));
  for (int64_t i = 0; i < n; ++i) {
    const float y = 1.f / (1.f + e[i]);
    s[i] = g[i] < 0.f ? y : 1.f - y;
  }
  round_to(dt, s, int(n));
  for (int64_t i = 0; i < n; ++i) g[i] *= s[i];
  round_to(dt, g, int(n));
}

struct SetLayout {
  bool has_gate, has_ids;
  int n;
};

// h [M, n] from u (and g) [M, n], float32 values of dtype P.ydt; returns h in u.
void activate(const FfnParams& P, int M, int n, float* u, float* g);

// The product rule (relu_llama "product"): h = silu(g) * u rounded to the dtype, kept where |h| >
// threshold; a = silu(g) already applied; h into u.
void product_rule(const FfnParams& P, int64_t count, float* u, const float* a) {
  for (int64_t i = 0; i < count; ++i) u[i] = a[i] * u[i];
  round_to(P.ydt, u, int(count));
  for (int64_t i = 0; i < count; ++i) u[i] = std::fabs(u[i]) > P.threshold ? u[i] : 0.f;
}

void activate(const FfnParams& P, int M, int n, float* u, float* g) {
  const int64_t count = int64_t(M) * n;
  if (P.act == 2) {
    for (int64_t i = 0; i < count; ++i) u[i] = u[i] > P.threshold ? u[i] : 0.f;
    return;
  }
  if (P.act == 1) {
    for (int64_t i = 0; i < count; ++i) u[i] = g[i] > P.threshold ? g[i] * u[i] : 0.f;
    round_to(P.ydt, u, int(count));
    return;
  }
  // silu(g) as MLX computes it (mx.sigmoid then the product, each rounded to the dtype), then the
  // mask on it and the product with u.
  mlx_silu(g, count, P.ydt, scratch(tl_act, size_t(2 * count)));
  if (P.act == 3) {
    product_rule(P, count, u, g);
    return;
  }
  for (int64_t i = 0; i < count; ++i) u[i] = std::fabs(g[i]) > P.threshold ? g[i] * u[i] : 0.f;
  round_to(P.ydt, u, int(count));
}

// True when an activated gate value v (silu(g) for silu, g for relu_gated) keeps its neuron.
bool passes(const FfnParams& P, float v) { return P.act == 0 ? std::fabs(v) > P.threshold : v > P.threshold; }

// h [M, na] of the rows `active` (nullptr: rows 0..n) from u [M, na] and the activated gate
// g [M, n] (silu already applied for silu), as activate computes it; returns h in u.
void activate_rows(const FfnParams& P, int M, int n, int na, const int32_t* active, float* u, const float* g) {
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < na; ++j) {
      const float gv = g[int64_t(m) * n + (active ? active[j] : j)];
      float& h = u[int64_t(m) * na + j];
      h = passes(P, gv) ? gv * h : 0.f;
    }
  round_to(P.ydt, u, M * na);
}

class FlashSparseFFN : public CpuPrimitive {
 public:
  struct Params {
    std::vector<SetLayout> sets;
    bool has_gate_values, has_add;
    FfnParams ffn;
  };
  FlashSparseFFN(mx::Stream s, Params p) : CpuPrimitive(s), p_(std::move(p)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const Params P = p_;
    size_t next = 0;
    const View x = View::of(inputs[next++]);
    View gate_values, add;
    if (P.has_gate_values) gate_values = View::of(inputs[next++]);
    if (P.has_add) add = View::of(inputs[next++]);
    std::vector<SetRows> sets;
    std::vector<View> ids;
    for (const SetLayout& s : P.sets) {
      SetRows r;
      r.up = View::of(inputs[next++]);
      r.has_gate = s.has_gate;
      if (s.has_gate) r.gate = View::of(inputs[next++]);
      r.down = View::of(inputs[next++]);
      r.n = s.n;
      ids.push_back(s.has_ids ? View::of(inputs[next++]) : View());
      sets.push_back(std::move(r));
    }
    uint8_t* out = allocate_output(outputs[0]);
    const int odt = scalar_type(outputs[0].dtype());
    dispatch(stream(), inputs, outputs, [=]() mutable {
      const int K = int(x.shape.back());
      const int M = K == 0 ? 0 : int(x.size() / K);
      const int64_t out_size = int64_t(M) * K;
      if (out_size == 0) return;
      float* xin = scratch(tl_x, size_t(out_size));
      to_float(x, xin);
      float* y = scratch(tl_y, size_t(out_size));
      bool have_y = P.has_add;
      if (P.has_add) to_float(add, y);
      std::vector<std::vector<int32_t>> id_rows(sets.size());
      for (size_t j = 0; j < sets.size(); ++j)
        if (ids[j].ptr != nullptr) {
          id_rows[j].resize(size_t(sets[j].n));
          for (int i = 0; i < sets[j].n; ++i)
            id_rows[j][i] = reinterpret_cast<const int32_t*>(ids[j].ptr)[ids[j].offset(i)];
          sets[j].ids = id_rows[j].data();
        }
      ffn_sets(P.ffn, M, K, xin, P.has_gate_values ? &gate_values : nullptr, sets, y, have_y);
      store_row(out, odt, 0, int(out_size), y);
    });
  }

  const char* name() const override { return "FlashSparseFFN"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const Params& o = static_cast<const FlashSparseFFN&>(other).p_;
    if (p_.sets.size() != o.sets.size()) return false;
    for (size_t j = 0; j < p_.sets.size(); ++j)
      if (p_.sets[j].has_gate != o.sets[j].has_gate || p_.sets[j].has_ids != o.sets[j].has_ids ||
          p_.sets[j].n != o.sets[j].n)
        return false;
    return p_.has_gate_values == o.has_gate_values && p_.has_add == o.has_add && p_.ffn.fmt == o.ffn.fmt &&
           p_.ffn.act == o.ffn.act && p_.ffn.ydt == o.ffn.ydt && p_.ffn.threshold == o.ffn.threshold;
  }

 private:
  Params p_;
};

class FlashActiveMask : public CpuPrimitive {
 public:
  FlashActiveMask(mx::Stream s, int act, float act_threshold, float threshold)
      : CpuPrimitive(s), act_(act), act_threshold_(act_threshold), threshold_(threshold) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const View g = View::of(inputs[0]);
    uint8_t* out = allocate_output(outputs[0]);
    const int act = act_;
    const float act_threshold = act_threshold_, threshold = threshold_;
    dispatch(stream(), inputs, outputs, [=]() {
      const int64_t N = g.shape.back(), M = N == 0 ? 0 : g.size() / N;
      const int dt = scalar_type(g.dtype);
      float* v = scratch(tl_x, size_t(g.size()));
      to_float(g, v);
      std::fill(out, out + N, uint8_t(0));
      if (act == 0) {
        mlx_silu(v, g.size(), dt, scratch(tl_act, size_t(2 * g.size())));
      } else {
        for (int64_t i = 0; i < g.size(); ++i) v[i] = v[i] > act_threshold ? v[i] : 0.f;
      }
      for (int64_t m = 0; m < M; ++m)
        for (int64_t i = 0; i < N; ++i)
          if (std::fabs(v[m * N + i]) > threshold) out[i] = 1;
    });
  }
  const char* name() const override { return "FlashActiveMask"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const FlashActiveMask&>(other);
    return act_ == o.act_ && act_threshold_ == o.act_threshold_ && threshold_ == o.threshold_;
  }

 private:
  int act_;
  float act_threshold_, threshold_;
};

// t as an MLX array of dtype dt holds it (a Python float compared with such an array).
float in_dtype(float t, int dt) {
  round_to(dt, &t, 1);
  return t;
}

}  // namespace

void ffn_sets(const FfnParams& P, int M, int K, const float* xin, const View* gate_values,
              const std::vector<SetRows>& sets, float* y, bool& have_y) {
  const int64_t out_size = int64_t(M) * K;
  const int64_t n_gate = gate_values != nullptr ? gate_values->shape.back() : 0;
  for (const SetRows& s : sets) {
    const int n = s.n;
    if (n == 0) {  // no rows: a zero part (`y + 0` leaves y as it is)
      if (!have_y) std::fill(y, y + out_size, 0.f);
      have_y = true;
      continue;
    }
    float* u = scratch(tl_gu, size_t(2) * M * n);
    float* g = u + size_t(M) * n;
    // Without gate rows the gate's values are known before any matvec: the up and down
    // matvecs run only on the rows some token activates (the others' h is exactly 0, and
    // matvec_t adds its rows in order, so skipping them leaves every sum as it was).
    const int32_t* active = nullptr;
    int na = n;
    if (!s.has_gate && P.act != 2) {
      const int gdt = scalar_type(gate_values->dtype);
      for (int m = 0; m < M; ++m)
        for (int i = 0; i < n; ++i) {
          const int64_t c = s.ids ? s.ids[i] : i;
          g[int64_t(m) * n + i] = c < 0 || c >= n_gate ? std::numeric_limits<float>::quiet_NaN()
                                                       : flash::load_scalar(gate_values->ptr, gdt,
                                                                            gate_values->offset(m * n_gate + c));
        }
      if (P.act == 0 || P.act == 3) mlx_silu(g, int64_t(M) * n, P.ydt, scratch(tl_act, size_t(2) * M * n));
      int32_t* rows = scratch(tl_rows, size_t(n));
      na = 0;
      for (int i = 0; P.act != 3 && i < n; ++i)  // the product rule needs u too: every row
        for (int m = 0; m < M; ++m)
          if (passes(P, g[int64_t(m) * n + i])) {
            rows[na++] = i;
            break;
          }
      if (P.act == 3) na = n;
      if (na < n) active = rows;
    }
    flash::Problem ps[2];
    WeightCopies copies[2];
    const View* weights[2] = {&s.up, s.has_gate ? &s.gate : nullptr};
    for (int r = 0; r < (s.has_gate ? 2 : 1); ++r) {
      flash::Problem& p = ps[r];
      set_weights(p, P.fmt, 0, *weights[r], nullptr, nullptr, copies[r]);
      p.n = na;
      p.M = M;
      p.rows = active;
      p.in = xin;
      p.out = r == 0 ? u : g;
      p.out_dtype = flash::DT_F32;
    }
    if (na > 0) flash::matvec_many(ps, s.has_gate ? 2 : 1);
    round_to(P.ydt, u, M * na);
    if (s.has_gate) {
      round_to(P.ydt, g, M * n);
      activate(P, M, n, u, g);
    } else if (P.act == 3) {
      product_rule(P, int64_t(M) * n, u, g);
    } else if (P.act != 2) {
      activate_rows(P, M, n, na, active, u, g);
    } else {
      activate(P, M, n, u, g);
    }
    flash::Problem pd;
    WeightCopies down_copy;
    set_weights(pd, P.fmt, 0, s.down, nullptr, nullptr, down_copy);
    pd.n = na;
    pd.M = M;
    pd.rows = active;
    pd.in = u;
    float* part = have_y ? scratch(tl_part, size_t(out_size)) : y;
    std::fill(part, part + out_size, 0.f);
    pd.out = part;
    pd.out_dtype = flash::DT_F32;
    if (na > 0) flash::matvec_t(pd);
    round_to(P.ydt, part, int(out_size));
    if (have_y) {
      for (int64_t i = 0; i < out_size; ++i) y[i] += part[i];
      round_to(P.ydt, y, int(out_size));
    }
    have_y = true;
  }
  if (!have_y) std::fill(y, y + out_size, 0.f);
  have_y = true;
}

FfnParams ffn_params(int fmt, int act, mx::Dtype ydt, float threshold) {
  FfnParams P{fmt, act, scalar_type(ydt), threshold};
  flash::round_floats(P.ydt, &P.threshold, 1);
  return P;
}

mx::array active_mask(const mx::array& g, int act, float act_threshold, float threshold) {
  const std::string op = "active_mask";
  if (g.ndim() < 1) fail(op + ": g must have at least one dimension");
  check_float(g, op + ": g");
  if (act != 0 && act != 1) fail(op + ": act must be 0 (silu) or 1 (relu / fatrelu), got " + std::to_string(act));
  const int dt = scalar_type(g.dtype());
  auto prim = std::make_shared<FlashActiveMask>(cpu_stream(), act, in_dtype(act_threshold, dt), in_dtype(threshold, dt));
  return mx::array({g.shape(-1)}, mx::bool_, prim, {g});
}

mx::array sparse_ffn(const mx::array& x, const std::vector<RowSet>& sets, const std::optional<mx::array>& gate_values,
                     int act, float threshold, const std::optional<mx::array>& add) {
  const std::string op = "sparse_ffn";
  mx::Stream s = cpu_stream();
  if (x.ndim() < 1) fail(op + ": x must have at least one dimension");
  check_float(x, op + ": x");
  if (act < 0 || act > 3)
    fail(op + ": act must be 0 (silu), 1 (relu_gated), 2 (relu) or 3 (product), got " + std::to_string(act));
  if (sets.empty()) fail(op + ": needs at least one row set");
  const int K = x.shape(-1);
  const mx::Dtype wdt = sets[0].up.dtype();
  if (wdt != mx::float16 && wdt != mx::bfloat16) fail(op + ": rows must be float16 or bfloat16");
  const int fmt = wdt == mx::float16 ? flash::FMT_F16 : flash::FMT_BF16;
  const mx::Dtype ydt = mx::promote_types(x.dtype(), wdt);
  std::vector<mx::array> inputs = {x};
  FlashSparseFFN::Params P;
  P.has_gate_values = gate_values.has_value();
  P.has_add = add.has_value();
  P.ffn = ffn_params(fmt, act, ydt, threshold);
  mx::Shape out_shape = x.shape();
  if (gate_values) {
    check_float(*gate_values, op + ": gate_values");
    if (gate_values->dtype() != ydt) fail(op + ": gate_values must have the output's dtype");
    if (gate_values->ndim() != x.ndim() || !std::equal(x.shape().begin(), x.shape().end() - 1, gate_values->shape().begin()))
      fail(op + ": gate_values must be [..., N] with x's leading shape, got " + shape_str(*gate_values));
    inputs.push_back(*gate_values);
  }
  if (add) {
    if (add->shape() != out_shape || add->dtype() != ydt)
      fail(op + ": add must have the output's shape " + shape_str(out_shape) + " and dtype");
    inputs.push_back(*add);
  }
  for (const RowSet& r : sets) {
    const bool gated = r.gate.has_value();
    if (act == 2 && gated) fail(op + ": act relu takes no gate rows");
    if (act != 2 && !gated && !gate_values) fail(op + ": a row set without gate rows needs gate_values");
    for (const mx::array* w : {&r.up, gated ? &*r.gate : nullptr, &r.down}) {
      if (w == nullptr) continue;
      if (w->dtype() != wdt || w->ndim() != 2 || w->shape(1) != K)
        fail(op + ": rows must be 2-D [R, " + std::to_string(K) + "] of one half dtype, got " + shape_str(*w));
      if (r.n < 0 || r.n > w->shape(0))
        fail(op + ": n=" + std::to_string(r.n) + " is outside 0.." + std::to_string(w->shape(0)));
      inputs.push_back(*w);
    }
    if (r.ids) {
      check_integer(*r.ids, op + ": ids");
      if (r.ids->ndim() != 1 || r.ids->shape(0) != r.n) fail(op + ": ids must be [n], got " + shape_str(*r.ids));
      inputs.push_back(r.ids->dtype() == mx::int32 ? *r.ids : mx::astype(*r.ids, mx::int32, s));
    }
    P.sets.push_back({gated, r.ids.has_value(), r.n});
  }
  auto prim = std::make_shared<FlashSparseFFN>(s, std::move(P));
  return mx::array(out_shape, ydt, prim, std::move(inputs));
}

}  // namespace flash_ext
