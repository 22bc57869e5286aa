// What the extension's MLX primitives share: a CPU-only base class, the output allocation and the
// hand-off of the work to the stream's CPU command encoder (as MLX's own CPU primitives do).
#pragma once

#include <stdexcept>
#include <utility>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"

namespace flash_ext {

namespace mx = mlx::core;

// Base of the extension's primitives: they run on the CPU stream only.
class CpuPrimitive : public mx::Primitive {
 public:
  using mx::Primitive::Primitive;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mlx_flash._ext kernels run on the CPU stream only");
  }
};

inline uint8_t* allocate_output(mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  return out.data<uint8_t>();
}

// Registers the buffers with the stream's encoder and runs `work` on it (after allocate_output).
template <typename Fn>
void dispatch(mx::Stream s, const std::vector<mx::array>& inputs, std::vector<mx::array> outs, Fn&& work) {
  auto& enc = mx::cpu::get_command_encoder(s);
  for (auto& a : inputs) enc.set_input_array(a);
  for (auto& o : outs) enc.set_output_array(o);
  enc.dispatch(std::forward<Fn>(work));
}

}  // namespace flash_ext
