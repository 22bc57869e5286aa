// mlx_flash._ext: the matvec kernels of matvec.cpp as lazy MLX primitives (CPU only).
// eval_cpu allocates the output and enqueues the work on the stream's CPU command encoder, so the
// ops compose with the rest of an MLX graph exactly like MLX's own CPU primitives.

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>

#include <cstring>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "layer_ops.h"
#include "matvec.h"
#include "mlx_view.h"
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

// A 2-D weight-like input: rows may be strided, but each row must be dense; otherwise copy.
struct Rows2D {
  const uint8_t* ptr;
  int64_t row_bytes;
};
Rows2D rows2d(const View& v, std::vector<uint8_t>& tmp, bool force_copy = false) {
  const int64_t item = mx::size_of(v.dtype);
  if (!force_copy && v.shape.size() == 2 && (v.strides[1] == 1 || v.shape[1] == 1) && v.strides[0] >= 0)
    return {v.ptr, v.strides[0] * item};
  tmp.resize(size_t(v.size() * item));
  for (int64_t i = 0; i < v.size(); ++i) std::memcpy(tmp.data() + i * item, v.ptr + v.offset(i) * item, item);
  return {tmp.data(), v.shape.size() == 2 ? v.shape[1] * item : item};
}

thread_local std::vector<float> tl_in;

class FlashMatvec : public mx::Primitive {
 public:
  FlashMatvec(mx::Stream s, int fmt, int group_size, bool transposed, bool has_rows, int n, bool q8x)
      : mx::Primitive(s), fmt_(fmt), group_size_(group_size), transposed_(transposed),
        has_rows_(has_rows), n_(n), q8x_(q8x) {}

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
    const int out_dtype = scalar_type(out.dtype());
    uint8_t* out_ptr = out.data<uint8_t>();
    const int fmt = fmt_, gs = group_size_, n_prefix = n_;
    const bool transposed = transposed_, has_rows = has_rows_, q8x = q8x_;

    enc.dispatch([=]() {
      const int64_t wcols = w.shape.back();  // uint32 words (quantized) or elements (half)
      const int64_t K = fmt == flash::FMT_Q4 ? wcols * 8 : fmt == flash::FMT_Q8 ? wcols * 4 : wcols;
      std::vector<uint8_t> tmp_w, tmp_s, tmp_b;  // only used for non-dense rows (rare)
      flash::Problem p;
      p.fmt = fmt;
      p.group_size = gs;
      p.K = int(K);
      p.N = int(w.shape[0]);
      Rows2D wr = rows2d(w, tmp_w);
      p.w = wr.ptr;
      p.w_row_bytes = wr.row_bytes;
      if (quant) {
        Rows2D sr = rows2d(scales, tmp_s), br = rows2d(biases, tmp_b);
        p.sb_dtype = scalar_type(scales.dtype);
        if (sr.row_bytes != br.row_bytes) {  // different row strides: densify both so one stride serves
          sr = rows2d(scales, tmp_s, true);
          br = rows2d(biases, tmp_b, true);
        }
        p.scales = sr.ptr;
        p.biases = br.ptr;
        p.sb_row = sr.row_bytes / int64_t(mx::size_of(scales.dtype));
      }
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
      p.out = out_ptr;
      p.out_dtype = out_dtype;
      p.q8_activations = q8x;
      if (transposed) {
        if (p.M == 0 && x.size() == 0) {  // h has no columns: the weighted sum of no rows is 0
          int64_t lead = 1;
          for (size_t d = 0; d + 1 < x.shape.size(); ++d) lead *= x.shape[d];
          for (int64_t i = 0; i < lead * K; ++i) flash::store_scalar(out_ptr, out_dtype, i, 0.f);
          return;
        }
        flash::matvec_t(p);
      } else {
        flash::matvec(p);
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mlx_flash._ext kernels run on the CPU stream only");
  }

  const char* name() const override { return "FlashMatvec"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const FlashMatvec&>(other);
    return fmt_ == o.fmt_ && group_size_ == o.group_size_ && transposed_ == o.transposed_ &&
           has_rows_ == o.has_rows_ && n_ == o.n_ && q8x_ == o.q8x_;
  }

 private:
  int fmt_, group_size_;
  bool transposed_, has_rows_;
  int n_;
  bool q8x_;
};

int weight_format(const mx::array& w, std::optional<int> bits) {
  if (bits) {
    if (w.dtype() != mx::uint32) fail("quantized weights must be uint32");
    if (*bits == 4) return flash::FMT_Q4;
    if (*bits == 8) return flash::FMT_Q8;
    fail("bits must be 4 or 8");
  }
  if (w.dtype() == mx::float16) return flash::FMT_F16;
  if (w.dtype() == mx::bfloat16) return flash::FMT_BF16;
  fail("half weights must be float16 or bfloat16");
}

// One builder for all variants. x: [..., K] (forward) or [..., n] (transposed).
mx::array build(mx::array x, const mx::array& w, std::optional<mx::array> scales,
                std::optional<mx::array> biases, std::optional<mx::array> rows, int n_prefix,
                int group_size, std::optional<int> bits, bool transposed, bool q8x = false) {
  mx::Stream s = cpu_stream();
  const int fmt = weight_format(w, bits);
  const bool quant = bits.has_value();
  if (q8x && (!quant || transposed)) fail("q8_activations: only for the forward quantized matvec");
  if (w.ndim() != 2) fail("weight must be 2-D, got " + shape_str(w));
  if (x.ndim() < 1) fail("x must have at least one dimension");
  if (!mx::issubdtype(x.dtype(), mx::floating)) fail("x must be a floating point array");
  const int N = w.shape(0);
  const int K = quant ? w.shape(1) * (32 / *bits) : w.shape(1);
  mx::Dtype out_dtype = x.dtype();
  std::vector<mx::array> inputs = {x, w};
  if (quant) {
    if (!scales || !biases) fail("quantized weights need scales and biases (affine mode)");
    if (group_size != 32 && group_size != 64 && group_size != 128) fail("group_size must be 32, 64 or 128");
    if (K % group_size) fail("K must be a multiple of group_size");
    if (scales->shape() != mx::Shape{N, K / group_size} || biases->shape() != scales->shape())
      fail("scales/biases must have shape (" + std::to_string(N) + ", " + std::to_string(K / group_size) +
           "), got " + shape_str(*scales) + " / " + shape_str(*biases));
    scalar_type(scales->dtype());
    if (biases->dtype() != scales->dtype()) fail("scales and biases must share a dtype");
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
  // A plain matvec is the prefix n = N of the weight.
  auto prim = std::make_shared<FlashMatvec>(s, fmt, quant ? group_size : 0, transposed, rows.has_value(),
                                            rows ? -1 : n, q8x);
  return mx::array(out_shape, out_dtype, prim, std::move(inputs));
}

}  // namespace

NB_MODULE(_ext, m) {
  m.doc() = "mlx_flash CPU matvec kernels as MLX primitives";
  nb::module_::import_("mlx.core");

  m.def(
      "quantized_matvec",
      [](const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
         int group_size, int bits, bool q8_activations) {
        return build(x, w, scales, biases, std::nullopt, -1, group_size, bits, false, q8_activations);
      },
      nb::arg("x"), nb::arg("w"), nb::arg("scales"), nb::arg("biases"), nb::arg("group_size"),
      nb::arg("bits"), nb::arg("q8_activations") = false,
      "y = x @ dequantize(w).T for MLX affine-quantized w [N, K]; x [..., K]. q8_activations: x rounded "
      "to int8 per 32-element block (scale max|x|/127) and integer dot products.");
  m.def(
      "half_matvec",
      [](const mx::array& x, const mx::array& w) {
        return build(x, w, std::nullopt, std::nullopt, std::nullopt, -1, 0, std::nullopt, false);
      },
      nb::arg("x"), nb::arg("w"), "y = x @ w.T for float16/bfloat16 w [N, K]; x [..., K].");
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
      [](const mx::array& q, const mx::array& k, const mx::array& v, float scale, bool causal) {
        return flash_ext::attention(q, k, v, scale, causal);
      },
      nb::arg("queries"), nb::arg("keys"), nb::arg("values"), nb::arg("scale"), nb::arg("causal") = false,
      "mx.fast.scaled_dot_product_attention without a mask or with a causal one, as one CPU primitive.");
  m.def("set_simd", &flash::set_simd_enabled, nb::arg("enabled"),
        "Use the AVX2 path when the CPU has it (True) or force the portable scalar path (False).");
  m.def("simd_active", &flash::simd_active);
  m.def("num_threads", &flash::num_threads);
  m.attr("built_with_mlx") = MLX_FLASH_BUILT_MLX_VERSION;
}
