// mlx_flash._ext: the matvec kernels of matvec.cpp as lazy MLX primitives (CPU only).
// eval_cpu allocates the output and enqueues the work on the stream's CPU command encoder, so the
// ops compose with the rest of an MLX graph exactly like MLX's own CPU primitives.

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "fused_ops.h"
#include "layer_ops.h"
#include "matvec.h"
#include "mlx_view.h"
#include "row_ops.h"
#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"
#include "mlx/utils.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

using namespace flash_ext;

thread_local std::vector<float> tl_in, tl_y;

class FlashMatvec : public CpuPrimitive {
 public:
  // add_dtype >= 0: a last input of the output's shape is added (residual): out = round(y) + add,
  // y rounded to its own dtype y_dtype first, as the unfused `x + layer(h)` computes it.
  FlashMatvec(mx::Stream s, int fmt, int group_size, bool transposed, bool has_rows, int n, bool q8x, int y_dtype,
              bool has_add)
      : CpuPrimitive(s), fmt_(fmt), group_size_(group_size), transposed_(transposed),
        has_rows_(has_rows), n_(n), q8x_(q8x), y_dtype_(y_dtype), has_add_(has_add) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);

    const bool quant = fmt_ == flash::FMT_Q4 || fmt_ == flash::FMT_Q8;
    View x = View::of(inputs[0]), w = View::of(inputs[1]);
    View scales, biases, rows;
    size_t next = 2;
    if (quant) {
      scales = View::of(inputs[next++]);
      biases = View::of(inputs[next++]);
    }
    if (has_rows_) rows = View::of(inputs[next++]);
    View add;
    if (has_add_) add = View::of(inputs[next++]);
    const int out_dtype = scalar_type(out.dtype());
    uint8_t* out_ptr = out.data<uint8_t>();
    const int fmt = fmt_, gs = group_size_, n_prefix = n_, y_dtype = y_dtype_;
    const bool transposed = transposed_, has_rows = has_rows_, q8x = q8x_, has_add = has_add_;

    enc.dispatch([=]() {
      WeightCopies copies;  // only used for non-dense rows (rare)
      flash::Problem p;
      set_weights(p, fmt, gs, w, quant ? &scales : nullptr, quant ? &biases : nullptr, copies);
      const int64_t K = p.K;
      std::vector<int32_t> tmp_rows;
      if (has_rows) {
        p.n = int(rows.size());
        if (rows.contiguous) {
          p.rows = reinterpret_cast<const int32_t*>(rows.ptr);
        } else {
          tmp_rows.resize(p.n);
          for (int i = 0; i < p.n; ++i) std::memcpy(&tmp_rows[i], rows.ptr + rows.offset(i) * 4, 4);
          p.rows = tmp_rows.data();
        }
      } else {
        p.n = n_prefix;
      }
      const int64_t inner = transposed ? p.n : K;
      p.M = inner == 0 ? 0 : int(x.size() / inner);
      if (tl_in.size() < size_t(x.size())) tl_in.resize(size_t(x.size()));
      to_float(x, tl_in.data());
      p.in = tl_in.data();
      const int64_t out_size = has_add ? add.size() : 0;
      if (has_add) {  // y in float32 scratch, then round(y) + add into the output
        if (tl_y.size() < size_t(2 * out_size)) tl_y.resize(size_t(2 * out_size));
        std::fill_n(tl_y.data(), out_size, 0.f);
        p.out = tl_y.data();
        p.out_dtype = flash::DT_F32;
      } else {
        p.out = out_ptr;
        p.out_dtype = out_dtype;
      }
      p.q8_activations = q8x;
      if (transposed) {
        if (p.M == 0 && x.size() == 0) {  // h has no columns: the weighted sum of no rows is 0
          int64_t lead = 1;
          for (size_t d = 0; d + 1 < x.shape.size(); ++d) lead *= x.shape[d];
          for (int64_t i = 0; i < lead * K && !has_add; ++i) flash::store_scalar(out_ptr, out_dtype, i, 0.f);
        } else {
          flash::matvec_t(p);
        }
      } else {
        flash::matvec(p);
      }
      if (has_add) store_residual(tl_y.data(), add, out_size, y_dtype, out_ptr, out_dtype, tl_y.data() + out_size);
    });
  }


  const char* name() const override { return "FlashMatvec"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const FlashMatvec&>(other);
    return fmt_ == o.fmt_ && group_size_ == o.group_size_ && transposed_ == o.transposed_ &&
           has_rows_ == o.has_rows_ && n_ == o.n_ && q8x_ == o.q8x_ && y_dtype_ == o.y_dtype_ &&
           has_add_ == o.has_add_;
  }

 private:
  int fmt_, group_size_;
  bool transposed_, has_rows_;
  int n_;
  bool q8x_;
  int y_dtype_;
  bool has_add_;
};

// One builder for all variants. x: [..., K] (forward) or [..., n] (transposed).
mx::array build(mx::array x, const mx::array& w, std::optional<mx::array> scales,
                std::optional<mx::array> biases, std::optional<mx::array> rows, int n_prefix,
                int group_size, std::optional<int> bits, bool transposed, bool q8x = false,
                std::optional<mx::array> add = std::nullopt) {
  mx::Stream s = cpu_stream();
  const bool quant = bits.has_value();
  if (q8x && (!quant || transposed)) fail("q8_activations: only for the forward quantized matvec");
  if (x.ndim() < 1) fail("x must have at least one dimension");
  if (!mx::issubdtype(x.dtype(), mx::floating)) fail("x must be a floating point array");
  const int K = w.ndim() == 2 ? (quant ? w.shape(1) * (32 / *bits) : w.shape(1)) : 0;
  const int fmt = check_weights("matvec", w, scales, biases, K, group_size, bits, "the weight's row size");
  const int N = w.shape(0);
  mx::Dtype out_dtype = x.dtype();
  std::vector<mx::array> inputs = {x, w};
  if (quant) {
    out_dtype = mx::promote_types(x.dtype(), scales->dtype());
    inputs.push_back(*scales);
    inputs.push_back(*biases);
  } else {
    out_dtype = mx::promote_types(x.dtype(), w.dtype());
  }
  scalar_type(out_dtype);
  int n = N;
  if (rows) {
    if (rows->ndim() != 1) fail("rows must be 1-D");
    mx::array r = rows->dtype() == mx::int32 ? *rows : mx::astype(*rows, mx::int32, s);
    inputs.push_back(r);
    n = rows->shape(0);
  } else if (n_prefix >= 0) {
    if (n_prefix > N) fail("n=" + std::to_string(n_prefix) + " exceeds the " + std::to_string(N) + " weight rows");
    n = n_prefix;
  }
  const int inner = transposed ? n : K;
  if (x.shape(-1) != inner)
    fail(std::string(transposed ? "h" : "x") + " last dimension must be " + std::to_string(inner) + ", got " +
         shape_str(x));
  mx::Shape out_shape = x.shape();
  out_shape.back() = transposed ? K : n;
  const mx::Dtype y_dtype = out_dtype;
  if (add) {
    if (add->shape() != out_shape)
      fail("add must have the output's shape " + shape_str(out_shape) + ", got " + shape_str(*add));
    scalar_type(add->dtype());
    out_dtype = mx::promote_types(out_dtype, add->dtype());
    inputs.push_back(*add);
  }
  // A plain matvec is the prefix n = N of the weight.
  auto prim = std::make_shared<FlashMatvec>(s, fmt, quant ? group_size : 0, transposed, rows.has_value(),
                                            rows ? -1 : n, q8x, scalar_type(y_dtype), add.has_value());
  return mx::array(out_shape, out_dtype, prim, std::move(inputs));
}

// A projection from Python: (w, scales, biases, bias), the last three None where absent.
using Proj = std::tuple<mx::array, std::optional<mx::array>, std::optional<mx::array>, std::optional<mx::array>>;
flash_ext::Linear linear(const Proj& p) {
  return {std::get<0>(p), std::get<1>(p), std::get<2>(p), std::get<3>(p)};
}

}  // namespace

NB_MODULE(_ext, m) {
  m.doc() = "mlx_flash CPU matvec kernels as MLX primitives";
  nb::module_::import_("mlx.core");

  m.def(
      "quantized_matvec",
      [](const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
         int group_size, int bits, bool q8_activations, std::optional<mx::array> add) {
        return build(x, w, scales, biases, std::nullopt, -1, group_size, bits, false, q8_activations, add);
      },
      nb::arg("x"), nb::arg("w"), nb::arg("scales"), nb::arg("biases"), nb::arg("group_size"),
      nb::arg("bits"), nb::arg("q8_activations") = false, nb::arg("add").none() = nb::none(),
      "y = x @ dequantize(w).T [+ add] for MLX affine-quantized w [N, K]; x [..., K]. q8_activations: x "
      "rounded to int8 per 32-element block (scale max|x|/127) and integer dot products. add: a residual "
      "of y's shape, added after y is rounded to its dtype.");
  m.def(
      "half_matvec",
      [](const mx::array& x, const mx::array& w, std::optional<mx::array> add) {
        return build(x, w, std::nullopt, std::nullopt, std::nullopt, -1, 0, std::nullopt, false, false, add);
      },
      nb::arg("x"), nb::arg("w"), nb::arg("add").none() = nb::none(),
      "y = x @ w.T [+ add] for float16/bfloat16 w [N, K]; x [..., K].");
  m.def(
      "gather_matvec",
      [](const mx::array& x, const mx::array& w, std::optional<mx::array> scales,
         std::optional<mx::array> biases, std::optional<mx::array> rows, std::optional<int> n,
         int group_size, std::optional<int> bits, bool q8_activations) {
        if (!rows && !n) fail("pass rows or n");
        return build(x, w, scales, biases, rows, rows ? -1 : *n, group_size, bits, false, q8_activations);
      },
      nb::arg("x"), nb::arg("w"), nb::arg("scales").none() = nb::none(), nb::arg("biases").none() = nb::none(),
      nb::arg("rows").none() = nb::none(), nb::arg("n").none() = nb::none(), nb::arg("group_size") = 64, nb::arg("bits").none() = nb::none(),
      nb::arg("q8_activations") = false,
      "y[..., i] = dot(W[rows[i]], x) (or W[:n]); bits=None for float16/bfloat16 W.");
  m.def(
      "gather_matvec_t",
      [](const mx::array& h, const mx::array& w, std::optional<mx::array> scales,
         std::optional<mx::array> biases, std::optional<mx::array> rows, std::optional<int> n,
         int group_size, std::optional<int> bits) {
        if (!rows && !n) fail("pass rows or n");
        return build(h, w, scales, biases, rows, rows ? -1 : *n, group_size, bits, true);
      },
      nb::arg("h"), nb::arg("w"), nb::arg("scales").none() = nb::none(), nb::arg("biases").none() = nb::none(),
      nb::arg("rows").none() = nb::none(), nb::arg("n").none() = nb::none(), nb::arg("group_size") = 64, nb::arg("bits").none() = nb::none(),
      "y[..., :] = sum_i h[..., i] * W[rows[i], :] (or W[:n]); bits=None for float16/bfloat16 W.");
  m.def("quantized_embedding", &flash_ext::quantized_embedding, nb::arg("ids"), nb::arg("w"), nb::arg("scales"),
        nb::arg("biases"), nb::arg("group_size"), nb::arg("bits"),
        "mx.dequantize(w[ids], scales[ids], biases[ids]) (mlx-lm's QuantizedEmbedding lookup) as one CPU primitive.");
  m.def(
      "rms_norm",
      [](const mx::array& x, std::optional<mx::array> weight, float eps) { return flash_ext::rms_norm(x, weight, eps); },
      nb::arg("x"), nb::arg("weight").none(), nb::arg("eps"),
      "mx.fast.rms_norm as one CPU primitive: x * rsqrt(mean(x^2, -1) + eps) * weight.");
  m.def(
      "layer_norm",
      [](const mx::array& x, std::optional<mx::array> weight, std::optional<mx::array> bias, float eps) {
        return flash_ext::layer_norm(x, weight, bias, eps);
      },
      nb::arg("x"), nb::arg("weight").none(), nb::arg("bias").none(), nb::arg("eps"),
      "mx.fast.layer_norm as one CPU primitive: (x - mean) * rsqrt(var + eps) * weight + bias.");
  m.def(
      "rope",
      [](const mx::array& x, int dims, bool traditional, float base, float scale, int offset,
         std::optional<mx::array> freqs) { return flash_ext::rope(x, dims, traditional, base, scale, offset, freqs); },
      nb::arg("x"), nb::arg("dims"), nb::arg("traditional"), nb::arg("base"), nb::arg("scale"), nb::arg("offset"),
      nb::arg("freqs").none() = nb::none(),
      "mx.fast.rope (integer offset) as one CPU primitive; base is ignored when freqs is given.");
  m.def(
      "attention",
      [](const mx::array& q, const mx::array& k, const mx::array& v, float scale, bool causal, bool heads_last,
         std::optional<int> n_keys) {
        return flash_ext::attention(q, k, v, scale, causal, heads_last, n_keys);
      },
      nb::arg("queries"), nb::arg("keys"), nb::arg("values"), nb::arg("scale"), nb::arg("causal") = false,
      nb::arg("heads_last") = false, nb::arg("n_keys").none() = nb::none(),
      "mx.fast.scaled_dot_product_attention without a mask or with a causal one, as one CPU primitive; "
      "heads_last: output [B, L, H * Dv] instead of [B, H, L, Dv]; n_keys: attend to the first n_keys "
      "keys and values only (a KV cache buffer filled that far).");
  m.def(
      "norm_qkv_rope",
      [](const mx::array& x, std::optional<mx::array> norm_weight, float eps, const Proj& q, const Proj& k,
         const Proj& v, int group_size, std::optional<int> bits, int n_heads, int n_kv_heads, int rope_dims,
         bool traditional, float base, float scale, int offset, std::optional<mx::array> freqs,
         bool q8_activations, std::optional<mx::array> k_cache, std::optional<mx::array> v_cache) {
        auto out = flash_ext::norm_qkv_rope(x, norm_weight, eps, {linear(q), linear(k), linear(v)}, group_size, bits,
                                            n_heads, n_kv_heads, rope_dims, traditional, base, scale, offset, freqs,
                                            q8_activations, k_cache, v_cache);
        return std::make_tuple(out[0], out[1], out[2]);
      },
      nb::arg("x"), nb::arg("norm_weight").none(), nb::arg("eps"), nb::arg("q"), nb::arg("k"), nb::arg("v"),
      nb::arg("group_size"), nb::arg("bits").none(), nb::arg("n_heads"), nb::arg("n_kv_heads"), nb::arg("rope_dims"),
      nb::arg("traditional"), nb::arg("base"), nb::arg("scale"), nb::arg("offset"), nb::arg("freqs").none(),
      nb::arg("q8_activations") = false, nb::arg("k_cache").none() = nb::none(), nb::arg("v_cache").none() = nb::none(),
      "(q, k, v) of a llama-family attention block from x [B, L, D] as one CPU primitive: rms_norm, the three "
      "projections (each (w, scales, biases, bias)), heads [B, H, L, head_dim] and RoPE on q and k. With "
      "k_cache / v_cache [B, Hkv, S, head_dim]: k and v are written into them at positions offset.. and the "
      "updated caches are returned in their place (in place when MLX can donate the buffers).");
  m.def(
      "norm_swiglu",
      [](const mx::array& x, std::optional<mx::array> norm_weight, float eps, const Proj& gate, const Proj& up,
         int group_size, std::optional<int> bits, bool q8_activations, std::optional<Proj> down,
         int down_group_size, std::optional<int> down_bits) {
        std::optional<flash_ext::Linear> d;
        if (down) d = linear(*down);
        return flash_ext::norm_swiglu(x, norm_weight, eps, linear(gate), linear(up), group_size, bits, q8_activations,
                                      d, down_group_size, down_bits);
      },
      nb::arg("x"), nb::arg("norm_weight").none(), nb::arg("eps"), nb::arg("gate"), nb::arg("up"),
      nb::arg("group_size"), nb::arg("bits").none(), nb::arg("q8_activations") = false,
      nb::arg("down").none() = nb::none(), nb::arg("down_group_size") = 64, nb::arg("down_bits").none() = nb::none(),
      "silu(h @ Wg.T) * (h @ Wu.T), h = rms_norm(x) (skipped when norm_weight is None), as one CPU primitive; "
      "gate / up are (w, scales, biases, bias) with bias None. With down ((w, scales, biases, None) in its own "
      "format down_group_size / down_bits): x + down(that), the MLP block with its residual.");
  m.def(
      "attention_o_proj",
      [](const mx::array& q, const mx::array& k, const mx::array& v, float scale, bool causal,
         std::optional<int> n_keys, const Proj& o, int group_size, std::optional<int> bits, const mx::array& residual,
         bool q8_activations) {
        return flash_ext::attention_o_proj(q, k, v, scale, causal, n_keys, linear(o), group_size, bits, residual,
                                           q8_activations);
      },
      nb::arg("queries"), nb::arg("keys"), nb::arg("values"), nb::arg("scale"), nb::arg("causal"),
      nb::arg("n_keys").none(), nb::arg("o"), nb::arg("group_size"), nb::arg("bits").none(), nb::arg("residual"),
      nb::arg("q8_activations") = false,
      "residual + o(attention(q, k, v) in heads-last layout) as one CPU primitive: the attention block's output "
      "with its residual; o is (w, scales, biases, None); n_keys as in attention.");
  m.def("set_simd", &flash::set_simd_enabled, nb::arg("enabled"),
        "Use the AVX2 path when the CPU has it (True) or force the portable scalar path (False).");
  m.def(
      "round_floats",
      [](std::vector<float> v, mx::Dtype dtype) {
        flash::round_floats(scalar_type(dtype), v.data(), int64_t(v.size()));
        return v;
      },
      nb::arg("values"), nb::arg("dtype"),
      "Test hook: float32 values rounded to dtype (float16 / bfloat16) and back, as the fused ops round "
      "their intermediates.");
  m.def("simd_active", &flash::simd_active);
  m.def("num_threads", &flash::num_threads);
  m.attr("built_with_mlx") = MLX_FLASH_BUILT_MLX_VERSION;
}
