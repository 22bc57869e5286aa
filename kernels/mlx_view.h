// Shared by the extension's primitives: reading MLX arrays of any dtype and strides from a task.
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "dtype.h"
#include "matvec.h"
#include "mlx/array.h"

namespace flash_ext {

namespace mx = mlx::core;

inline int scalar_type(mx::Dtype t) {
  if (t == mx::float16) return flash::DT_F16;
  if (t == mx::bfloat16) return flash::DT_BF16;
  if (t == mx::float32) return flash::DT_F32;
  throw std::invalid_argument("mlx_flash: expected float32, float16 or bfloat16");
}

// What a task needs to read one input: captured by value at eval time (the buffers themselves
// are kept alive by MLX until the stream's task has run).
struct View {
  const uint8_t* ptr = nullptr;
  mx::Dtype dtype = mx::float32;
  mx::Shape shape;
  mx::Strides strides;
  bool contiguous = false;

  static View of(const mx::array& a) {
    View v;
    v.ptr = a.data<uint8_t>();
    v.dtype = a.dtype();
    v.shape = a.shape();
    v.strides = a.strides();
    v.contiguous = a.flags().row_contiguous;
    return v;
  }
  int64_t size() const {
    int64_t n = 1;
    for (auto s : shape) n *= s;
    return n;
  }
  // Element offset (in elements) of flat row-major index i.
  int64_t offset(int64_t i) const {
    int64_t off = 0;
    for (int d = int(shape.size()) - 1; d >= 0 && i > 0; --d) {
      off += (i % shape[d]) * strides[d];
      i /= shape[d];
    }
    return off;
  }
};

// x (any float dtype, any strides) -> contiguous float32.
inline void to_float(const View& v, float* dst) {
  const int dt = scalar_type(v.dtype);
  const int64_t n = v.size();
  if (v.contiguous) {
    flash::load_floats(v.ptr, dt, n, dst);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = flash::load_scalar(v.ptr, dt, v.offset(i));
  }
}


// A 2-D weight-like input: rows may be strided, but each row must be dense; otherwise copy.
struct Rows2D {
  const uint8_t* ptr;
  int64_t row_bytes;
};
inline Rows2D rows2d(const View& v, std::vector<uint8_t>& tmp, bool force_copy = false) {
  const int64_t item = mx::size_of(v.dtype);
  if (!force_copy && v.shape.size() == 2 && (v.strides[1] == 1 || v.shape[1] == 1) && v.strides[0] >= 0)
    return {v.ptr, v.strides[0] * item};
  tmp.resize(size_t(v.size() * item));
  for (int64_t i = 0; i < v.size(); ++i) std::memcpy(tmp.data() + i * item, v.ptr + v.offset(i) * item, item);
  return {tmp.data(), v.shape.size() == 2 ? v.shape[1] * item : item};
}

// Copies of weight inputs whose rows are not dense (rare); they must outlive the problem.
struct WeightCopies {
  std::vector<uint8_t> w, scales, biases;
};

// Points p at weight w [N, Kw] (uint32 words when quantized, else half elements) and, for the
// quantized formats, its scales / biases [N, K / gs]: sets fmt, group_size, K, N and the pointers.
inline void set_weights(flash::Problem& p, int fmt, int gs, const View& w, const View* scales, const View* biases,
                        WeightCopies& copies) {
  const int64_t wcols = w.shape.back();
  p.fmt = fmt;
  p.group_size = gs;
  p.K = int(fmt == flash::FMT_Q4 ? wcols * 8 : fmt == flash::FMT_Q8 ? wcols * 4 : wcols);
  p.N = int(w.shape[0]);
  Rows2D wr = rows2d(w, copies.w);
  p.w = wr.ptr;
  p.w_row_bytes = wr.row_bytes;
  if (scales) {
    Rows2D sr = rows2d(*scales, copies.scales), br = rows2d(*biases, copies.biases);
    p.sb_dtype = scalar_type(scales->dtype);
    if (sr.row_bytes != br.row_bytes) {  // different row strides: densify both so one stride serves
      sr = rows2d(*scales, copies.scales, true);
      br = rows2d(*biases, copies.biases, true);
    }
    p.scales = sr.ptr;
    p.biases = br.ptr;
    p.sb_row = sr.row_bytes / int64_t(mx::size_of(scales->dtype));
  }
}

}  // namespace flash_ext
