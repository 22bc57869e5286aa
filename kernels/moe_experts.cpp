// A mixture-of-experts layer's routed experts as one CPU primitive (see moe_experts.h).
//
// Per call: the (token, choice) pairs are grouped by slot on the task's thread, then two pool
// dispatches cover every group: gate and up of all groups (matvec_batch), SwiGLU, down of all
// groups. A decode token's 8 experts were 24 matvec primitives, 72 bank slices, 8 activations and
// a concatenate per layer; now they are one primitive and the pool splits all their rows at once.

#include "moe_experts.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
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

// Pairs per batch of whole groups: bounds the float32 scratch of a long prompt (a group is never
// split, so each expert's matvecs see the same rows whatever the batching).
constexpr int64_t kBatchPairs = 1024;

thread_local std::vector<float> tl_xin, tl_xs, tl_gu, tl_h, tl_y;

// One expert's weights: slot s of bank views w / scales / biases [S, N, C] as a 2-D view [N, C].
View slot_view(const View& bank, int64_t s) {
  View v;
  v.ptr = bank.ptr + s * bank.strides[0] * int64_t(mx::size_of(bank.dtype));
  v.dtype = bank.dtype;
  v.shape = {bank.shape[1], bank.shape[2]};
  v.strides = {bank.strides[1], bank.strides[2]};
  v.contiguous = bank.contiguous;
  return v;
}

struct BankViews {
  View w, scales, biases;
};

void set_expert(flash::Problem& p, const BankViews& b, int64_t slot, int fmt, int gs, WeightCopies& copies,
                const float* in, int M, float* out, bool q8x) {
  const View w = slot_view(b.w, slot), s = slot_view(b.scales, slot), bi = slot_view(b.biases, slot);
  set_weights(p, fmt, gs, w, &s, &bi, copies);
  p.n = p.N;
  p.M = M;
  p.in = in;
  p.out = out;
  p.out_dtype = flash::DT_F32;
  p.q8_activations = q8x;
}

struct SwigluCtx {
  float* gu;           // per group: gate rows [m, I] then up rows [m, I]
  float* h;            // [rows, I] out: round(silu(round(g)) * round(u))
  const int64_t* row0;  // first row of each group in h; gu's group g starts at 2 * row0[g] * I
  const int* m;
  int I, ydt;
  bool simd;
};

void swiglu_group(const void* vctx, int g) {
  const SwigluCtx& c = *static_cast<const SwigluCtx*>(vctx);
  const int64_t n = int64_t(c.m[g]) * c.I;
  float* gate = c.gu + 2 * c.row0[g] * c.I;
  float* up = gate + n;
  float* h = c.h + c.row0[g] * c.I;
  round_to(c.ydt, gate, int(n));
  round_to(c.ydt, up, int(n));
  std::memcpy(h, gate, size_t(n) * sizeof(float));
  silu_mul(c.simd, h, up, int(n));
  round_to(c.ydt, h, int(n));
}

class FlashExpertsSwiGLU : public CpuPrimitive {
 public:
  struct Params {
    int fmt, group_size, down_fmt, down_group_size, ydt, out_dt;
    bool q8x;
  };
  FlashExpertsSwiGLU(mx::Stream s, Params p) : CpuPrimitive(s), p_(p) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const Params P = p_;
    const View x = View::of(inputs[0]), slots = View::of(inputs[1]);
    const BankViews gate{View::of(inputs[2]), View::of(inputs[3]), View::of(inputs[4])};
    const BankViews up{View::of(inputs[5]), View::of(inputs[6]), View::of(inputs[7])};
    const BankViews down{View::of(inputs[8]), View::of(inputs[9]), View::of(inputs[10])};
    uint8_t* out = allocate_output(outputs[0]);
    dispatch(stream(), inputs, outputs, [=]() {
      const int T = int(x.shape[0]), D = int(x.shape[1]), k = int(slots.shape[1]);
      const int I = int(gate.w.shape[1]);
      const int64_t S = gate.w.shape[0], pairs = int64_t(T) * k;
      if (pairs == 0) return;
      // slot of each pair; pairs outside [0, S) give NaN rows and join no group
      std::vector<int64_t> slot(pairs);
      const bool u32 = slots.dtype == mx::uint32;
      for (int64_t i = 0; i < pairs; ++i) {
        const int64_t off = slots.contiguous ? i : slots.offset(i);
        slot[i] = u32 ? int64_t(reinterpret_cast<const uint32_t*>(slots.ptr)[off])
                      : int64_t(reinterpret_cast<const int32_t*>(slots.ptr)[off]);
      }
      std::vector<int64_t> order;
      order.reserve(pairs);
      std::vector<float> nan_row(D, std::numeric_limits<float>::quiet_NaN());
      for (int64_t i = 0; i < pairs; ++i) {
        if (slot[i] >= 0 && slot[i] < S) order.push_back(i);
        else store_row(out, P.out_dt, i * D, D, nan_row.data());
      }
      std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return slot[a] < slot[b]; });
      float* xin = scratch(tl_xin, size_t(T) * D);
      to_float(x, xin);
      size_t a = 0;
      while (a < order.size()) {  // one batch of whole groups
        std::vector<size_t> starts;  // group starts in `order`
        size_t b = a;
        while (b < order.size() && (starts.empty() || int64_t(b - a) < kBatchPairs)) {
          starts.push_back(b);
          const int64_t s = slot[order[b]];
          while (b < order.size() && slot[order[b]] == s) ++b;
        }
        starts.push_back(b);
        run_batch(P, gate, up, down, xin, T, D, I, k, slot, order, starts, out);
        a = b;
      }
    });
  }

  const char* name() const override { return "FlashExpertsSwiGLU"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const Params& o = static_cast<const FlashExpertsSwiGLU&>(other).p_;
    return p_.fmt == o.fmt && p_.group_size == o.group_size && p_.down_fmt == o.down_fmt &&
           p_.down_group_size == o.down_group_size && p_.ydt == o.ydt && p_.out_dt == o.out_dt && p_.q8x == o.q8x;
  }

 private:
  // Groups starts[g]..starts[g + 1] of `order` (pairs sorted by slot): gate / up, SwiGLU, down, and
  // each pair's row stored at its place in out [T * k, D].
  static void run_batch(const Params& P, const BankViews& gate, const BankViews& up, const BankViews& down,
                        const float* xin, int T, int D, int I, int k, const std::vector<int64_t>& slot,
                        const std::vector<int64_t>& order, const std::vector<size_t>& starts, uint8_t* out) {
    const int G = int(starts.size()) - 1;
    const int64_t rows = int64_t(starts[G] - starts[0]);
    std::vector<int64_t> row0(G);
    std::vector<int> m(G);
    for (int g = 0; g < G; ++g) {
      row0[g] = int64_t(starts[g] - starts[0]);
      m[g] = int(starts[g + 1] - starts[g]);
    }
    // x rows of each group, contiguous (one token: every group reads x itself)
    const float* xs = xin;
    if (T > 1) {
      float* buf = scratch(tl_xs, size_t(rows) * D);
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(buf + r * D, xin + (order[starts[0] + r] / k) * D, size_t(D) * sizeof(float));
      xs = buf;
    }
    float* gu = scratch(tl_gu, size_t(2) * rows * I);
    float* h = scratch(tl_h, size_t(rows) * I);
    float* y = scratch(tl_y, size_t(rows) * D);
    std::vector<flash::Problem> ps(2 * G);
    std::vector<WeightCopies> copies(2 * G);
    for (int g = 0; g < G; ++g) {
      const int64_t s = slot[order[starts[g]]];
      const float* in = T > 1 ? xs + row0[g] * D : xs;
      float* o = gu + 2 * row0[g] * I;
      set_expert(ps[2 * g], gate, s, P.fmt, P.group_size, copies[2 * g], in, m[g], o, P.q8x);
      set_expert(ps[2 * g + 1], up, s, P.fmt, P.group_size, copies[2 * g + 1], in, m[g], o + int64_t(m[g]) * I, P.q8x);
    }
    flash::matvec_batch(ps.data(), 2 * G);
    SwigluCtx c{gu, h, row0.data(), m.data(), I, P.ydt, flash::simd_active()};
    flash::parallel_for(G, swiglu_group, &c);
    for (int g = 0; g < G; ++g) {
      const int64_t s = slot[order[starts[g]]];
      set_expert(ps[g], down, s, P.down_fmt, P.down_group_size, copies[g], h + row0[g] * I, m[g], y + row0[g] * D,
                 P.q8x);
    }
    flash::matvec_batch(ps.data(), G);
    for (int64_t r = 0; r < rows; ++r) store_row(out, P.out_dt, order[starts[0] + r] * D, D, y + r * D);
  }

  Params p_;
};

// A bank [S, N, K * bits / 32] with scales / biases [S, N, K / gs]: checked like one weight
// (check_weights) of any slot; appended to inputs. Returns the format.
int check_bank(const char* op, const Linear& b, int64_t S, int N, int K, int gs, int bits,
               std::vector<mx::array>& inputs) {
  const std::string name = std::string(op);
  if (!b.scales || !b.biases) fail(name + ": expert banks need scales and biases (affine mode)");
  if (b.bias) fail(name + ": experts with a bias are not supported");
  if (b.w.ndim() != 3 || b.scales->ndim() != 3 || b.biases->ndim() != 3)
    fail(name + ": expert banks must be 3-D (slots, rows, columns), got " + shape_str(b.w));
  if (b.w.shape(0) != S || b.scales->shape(0) != S || b.biases->shape(0) != S)
    fail(name + ": every bank must have " + std::to_string(S) + " slots, got " + shape_str(b.w));
  if (N >= 0 && b.w.shape(1) != N) fail(name + ": bank rows must be " + std::to_string(N) + ", got " + shape_str(b.w));
  check_bits(name, bits);
  const int fmt = weight_format(b.w, bits);
  if (int64_t(b.w.shape(2)) * (32 / bits) != K)
    fail(name + ": bank input size " + std::to_string(int64_t(b.w.shape(2)) * (32 / bits)) + " != " + std::to_string(K));
  if (gs != 32 && gs != 64 && gs != 128) fail("group_size must be 32, 64 or 128");
  if (K % gs) fail(name + ": K must be a multiple of group_size");
  const mx::Shape sb{int(S), b.w.shape(1), K / gs};
  if (b.scales->shape() != sb || b.biases->shape() != sb || b.biases->dtype() != b.scales->dtype())
    fail(name + ": bank scales/biases must have shape " + shape_str(sb) + " and one dtype, got " +
         shape_str(*b.scales) + " / " + shape_str(*b.biases));
  scalar_type(b.scales->dtype());
  inputs.push_back(b.w);
  inputs.push_back(*b.scales);
  inputs.push_back(*b.biases);
  return fmt;
}

}  // namespace

mx::array experts_swiglu(const mx::array& x, const mx::array& slots, const Linear& gate, const Linear& up,
                         const Linear& down, int group_size, int bits, int down_group_size, int down_bits, bool q8x) {
  const char* op = "experts_swiglu";
  mx::Stream s = cpu_stream();
  if (x.ndim() != 2) fail(std::string(op) + ": x must be (tokens, D), got " + shape_str(x));
  check_float(x, std::string(op) + ": x");
  if (slots.ndim() != 2 || slots.shape(0) != x.shape(0))
    fail(std::string(op) + ": slots must be (" + std::to_string(x.shape(0)) + ", k), got " + shape_str(slots));
  check_integer(slots, std::string(op) + ": slots");
  const mx::array sl = slots.dtype() == mx::int32 || slots.dtype() == mx::uint32 ? slots : mx::astype(slots, mx::int32, s);
  std::vector<mx::array> inputs = {x, sl};
  const int64_t S = gate.w.ndim() == 3 ? gate.w.shape(0) : -1;
  const int D = x.shape(1);
  const int I = gate.w.ndim() == 3 ? gate.w.shape(1) : -1;
  FlashExpertsSwiGLU::Params P;
  P.fmt = check_bank(op, gate, S, -1, D, group_size, bits, inputs);
  if (check_bank(op, up, S, I, D, group_size, bits, inputs) != P.fmt) fail(std::string(op) + ": gate and up must share a format");
  P.down_fmt = check_bank(op, down, S, D, I, down_group_size, down_bits, inputs);
  P.group_size = group_size;
  P.down_group_size = down_group_size;
  P.q8x = q8x;
  if (up.scales->dtype() != gate.scales->dtype()) fail(std::string(op) + ": gate and up scales must share a dtype");
  const mx::Dtype ydt = mx::promote_types(x.dtype(), gate.scales->dtype());
  const mx::Dtype out_dt = mx::promote_types(ydt, down.scales->dtype());
  P.ydt = scalar_type(ydt);
  P.out_dt = scalar_type(out_dt);
  const mx::Shape shape{x.shape(0), slots.shape(1), D};
  return mx::array(shape, out_dt, std::make_shared<FlashExpertsSwiGLU>(s, P), std::move(inputs));
}

}  // namespace flash_ext
