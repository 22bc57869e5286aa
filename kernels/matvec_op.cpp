// The matvec kernels as a lazy MLX primitive (see matvec_op.h).

#include "matvec_op.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "arg_checks.h"
#include "matvec.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx_view.h"
#include "primitive.h"
#include "row_ops.h"

namespace flash_ext {

namespace {

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
    uint8_t* out_ptr = allocate_output(out);
    const int fmt = fmt_, gs = group_size_, n_prefix = n_, y_dtype = y_dtype_;
    const bool transposed = transposed_, has_rows = has_rows_, q8x = q8x_, has_add = has_add_;

    dispatch(stream(), inputs, {out}, [=]() {
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
      int64_t lead = 1;  // x rows: all dims but the last (also when that one is empty)
      for (size_t d = 0; d + 1 < x.shape.size(); ++d) lead *= x.shape[d];
      p.M = int(lead);
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
        if (p.n == 0) {  // h has no columns: the weighted sum of no rows is 0
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

// The one builder of all variants (see matvec_op.h); n: the prefix of W (None: all rows) when
// rows is absent.
mx::array matvec_op(const mx::array& x, const mx::array& w, const std::optional<mx::array>& scales,
                    const std::optional<mx::array>& biases, const std::optional<mx::array>& rows,
                    std::optional<int> n_prefix, int group_size, std::optional<int> bits, bool transposed, bool q8x,
                    const std::optional<mx::array>& add, const char* op) {
  mx::Stream s = cpu_stream();
  const bool quant = bits.has_value();
  if (q8x && (!quant || transposed)) fail("q8_activations: only for the forward quantized matvec");
  if (x.ndim() < 1) fail(std::string(op) + ": x must have at least one dimension");
  check_float(x, std::string(op) + ": x");
  const int K = weight_k(op, w, bits);
  const int fmt = check_weights(op, w, scales, biases, K, group_size, bits, "the weight's row size");
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
    if (rows->ndim() != 1) fail(std::string(op) + ": rows must be 1-D, got " + shape_str(*rows));
    check_integer(*rows, std::string(op) + ": rows");
    mx::array r = rows->dtype() == mx::int32 ? *rows : mx::astype(*rows, mx::int32, s);
    inputs.push_back(r);
    n = rows->shape(0);
  } else if (n_prefix) {
    if (*n_prefix < 0) fail(std::string(op) + ": n must be >= 0, got " + std::to_string(*n_prefix));
    if (*n_prefix > N)
      fail(std::string(op) + ": n=" + std::to_string(*n_prefix) + " exceeds the " + std::to_string(N) + " weight rows");
    n = *n_prefix;
  }
  const int inner = transposed ? n : K;
  if (x.shape(-1) != inner)
    fail(std::string(op) + ": " + (transposed ? "h" : "x") + " last dimension must be " + std::to_string(inner) + ", got " +
         shape_str(x));
  mx::Shape out_shape = x.shape();
  out_shape.back() = transposed ? K : n;
  const mx::Dtype y_dtype = out_dtype;
  if (add) {
    if (add->shape() != out_shape)
      fail(std::string(op) + ": add must have the output's shape " + shape_str(out_shape) + ", got " + shape_str(*add));
    scalar_type(add->dtype());
    out_dtype = mx::promote_types(out_dtype, add->dtype());
    inputs.push_back(*add);
  }
  // A plain matvec is the prefix n = N of the weight.
  auto prim = std::make_shared<FlashMatvec>(s, fmt, quant ? group_size : 0, transposed, rows.has_value(),
                                            rows ? -1 : n, q8x, scalar_type(y_dtype), add.has_value());
  return mx::array(out_shape, out_dtype, prim, std::move(inputs));
}

}  // namespace

mx::array quantized_matvec(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                           int group_size, int bits, bool q8x, const std::optional<mx::array>& add) {
  return matvec_op(x, w, scales, biases, std::nullopt, std::nullopt, group_size, bits, false, q8x, add,
                   "quantized_matvec");
}

mx::array half_matvec(const mx::array& x, const mx::array& w, const std::optional<mx::array>& add) {
  return matvec_op(x, w, std::nullopt, std::nullopt, std::nullopt, std::nullopt, 0, std::nullopt, false, false, add,
                   "half_matvec");
}

mx::array gather_matvec(const mx::array& x, const mx::array& w, const std::optional<mx::array>& scales,
                        const std::optional<mx::array>& biases, const std::optional<mx::array>& rows,
                        std::optional<int> n, int group_size, std::optional<int> bits, bool q8x) {
  if (rows.has_value() == n.has_value()) fail("gather_matvec: pass rows or n (one of them)");
  return matvec_op(x, w, scales, biases, rows, n, group_size, bits, false, q8x, std::nullopt, "gather_matvec");
}

mx::array gather_matvec_t(const mx::array& h, const mx::array& w, const std::optional<mx::array>& scales,
                          const std::optional<mx::array>& biases, const std::optional<mx::array>& rows,
                          std::optional<int> n, int group_size, std::optional<int> bits) {
  if (rows.has_value() == n.has_value()) fail("gather_matvec_t: pass rows or n (one of them)");
  return matvec_op(h, w, scales, biases, rows, n, group_size, bits, true, false, std::nullopt, "gather_matvec_t");
}

}  // namespace flash_ext
