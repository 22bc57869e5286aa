// The matvec kernels (matvec.h) as one lazy MLX CPU primitive: eval_cpu allocates the output and
// enqueues the work on the stream's CPU command encoder, so the op composes with the rest of an MLX
// graph exactly like MLX's own CPU primitives.
#pragma once

#include <optional>

#include "mlx/array.h"

namespace flash_ext {

// y = x @ W.T (forward; x [..., K], y [..., n]) or y = h @ W[rows] (transposed; h [..., n],
// y [..., K]) over rows `rows` of W (1-D, integer), or its first n_prefix rows (n_prefix >= 0), or
// all of it (no rows, n_prefix < 0). W: uint32 words with scales / biases when bits (4 or 8) is set,
// else float16 / bfloat16 [N, K]. q8x: int8 activations (forward quantized only). add: a residual
// of y's shape added after y is rounded to its dtype. Rows outside [0, N) give NaN outputs.
mlx::core::array matvec_op(const mlx::core::array& x, const mlx::core::array& w,
                           const std::optional<mlx::core::array>& scales,
                           const std::optional<mlx::core::array>& biases,
                           const std::optional<mlx::core::array>& rows, int n_prefix, int group_size,
                           std::optional<int> bits, bool transposed, bool q8x = false,
                           const std::optional<mlx::core::array>& add = std::nullopt);

}  // namespace flash_ext
