// Shared by the extension's primitives: reading MLX arrays of any dtype and strides from a task.
#pragma once

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>

#include "matvec.h"
#include "mlx/array.h"
#include "mlx/stream.h"
#include "mlx/utils.h"

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
    for (int64_t i = 0; i < n; ++i) dst[i] = flash::load_scalar(v.ptr, dt, i);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = flash::load_scalar(v.ptr, dt, v.offset(i));
  }
}


[[noreturn]] inline void fail(const std::string& msg) { throw std::invalid_argument("mlx_flash: " + msg); }

inline std::string shape_str(const mx::array& a) {
  std::ostringstream s;
  s << "(";
  for (size_t i = 0; i < a.ndim(); ++i) s << (i ? ", " : "") << a.shape(int(i));
  s << ")";
  return s.str();
}

inline mx::Stream cpu_stream() {
  mx::Stream s = mx::to_stream({});
  if (s.device != mx::Device::cpu) fail("kernels need the CPU device (mx.set_default_device(mx.cpu))");
  return s;
}

}  // namespace flash_ext
