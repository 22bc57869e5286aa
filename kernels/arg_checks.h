// Argument checks of the extension's entry points: every op validates its arguments when it is
// built (before anything is computed) and throws std::invalid_argument (ValueError in Python).
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>

#include "matvec.h"
#include "mlx/array.h"
#include "mlx/stream.h"
#include "mlx/utils.h"
#include "mlx_view.h"

namespace flash_ext {

[[noreturn]] inline void fail(const std::string& msg) { throw std::invalid_argument("mlx_flash: " + msg); }

inline std::string shape_str(const mx::Shape& shape);
inline std::string shape_str(const mx::array& a) { return shape_str(a.shape()); }

inline std::string shape_str(const mx::Shape& shape) {
  std::ostringstream s;
  s << "(";
  for (size_t i = 0; i < shape.size(); ++i) s << (i ? ", " : "") << shape[i];
  s << ")";
  return s.str();
}

// a's dtype is one the kernels compute with.
inline void check_float(const mx::array& a, const std::string& what) {
  if (a.dtype() != mx::float32 && a.dtype() != mx::float16 && a.dtype() != mx::bfloat16)
    fail(what + " must be float32, float16 or bfloat16");
}

// a holds indices: a signed or unsigned integer dtype.
inline void check_integer(const mx::array& a, const std::string& what) {
  if (!mx::issubdtype(a.dtype(), mx::integer)) fail(what + " must be an integer array");
}

// bits of a quantized format: 4 or 8 (checked before anything divides by it).
inline void check_bits(const std::string& op, std::optional<int> bits) {
  if (bits && *bits != 4 && *bits != 8) fail(op + ": bits must be 4 or 8, got " + std::to_string(*bits));
}

// Input size K of weight w [N, columns]: columns * 32 / bits when quantized, else columns; 0 when w
// is not 2-D (check_weights then says so).
inline int weight_k(const std::string& op, const mx::array& w, std::optional<int> bits) {
  check_bits(op, bits);
  if (w.ndim() != 2) return 0;
  const int64_t k = bits ? int64_t(w.shape(1)) * (32 / *bits) : int64_t(w.shape(1));
  if (k > std::numeric_limits<int>::max()) fail(op + ": the weight's rows are too long (" + std::to_string(k) + ")");
  return int(k);
}

// Kernel weight format of w: MLX affine-quantized uint32 words (bits 4 / 8) or float16 / bfloat16.
inline int weight_format(const mx::array& w, std::optional<int> bits) {
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

// Checks of a weight's arrays for input size K: w 2-D in a kernel format (weight_format), and when
// quantized, scales / biases of shape (N, K / group_size) in one float dtype, group_size 32 / 64 /
// 128 dividing K. `what` names K in the message. Returns the format.
inline int check_weights(const char* op, const mx::array& w, const std::optional<mx::array>& scales,
                         const std::optional<mx::array>& biases, int K, int group_size, std::optional<int> bits,
                         const std::string& what) {
  check_bits(op, bits);
  const int fmt = weight_format(w, bits);
  if (w.ndim() != 2) fail(std::string(op) + ": weights must be 2-D, got " + shape_str(w));
  const int k = weight_k(op, w, bits);
  if (k != K) fail(std::string(op) + ": weight input size " + std::to_string(k) + " != " + what + " " + std::to_string(K));
  if (bits) {
    if (!scales || !biases) fail(std::string(op) + ": quantized weights need scales and biases (affine mode)");
    if (group_size != 32 && group_size != 64 && group_size != 128) fail("group_size must be 32, 64 or 128");
    if (K % group_size) fail(std::string(op) + ": K must be a multiple of group_size");
    const mx::Shape sb{w.shape(0), K / group_size};
    if (scales->shape() != sb || biases->shape() != sb || biases->dtype() != scales->dtype())
      fail(std::string(op) + ": scales/biases must have shape (" + std::to_string(sb[0]) + ", " +
           std::to_string(sb[1]) + ") and one dtype, got " + shape_str(*scales) + " / " + shape_str(*biases));
    scalar_type(scales->dtype());
  }
  return fmt;
}

inline mx::Stream cpu_stream() {
  mx::Stream s = mx::to_stream({});
  if (s.device != mx::Device::cpu) fail("kernels need the CPU device (mx.set_default_device(mx.cpu))");
  return s;
}

}  // namespace flash_ext
