// The matvec kernels (matvec.h) as one lazy MLX CPU primitive: eval_cpu allocates the output and
// enqueues the work on the stream's CPU command encoder, so the ops compose with the rest of an MLX
// graph exactly like MLX's own CPU primitives. Weights: MLX affine-quantized uint32 words with
// scales / biases [N, K / group_size] (bits 4 or 8, group_size 32 / 64 / 128), or float16 /
// bfloat16 [N, K]. Arguments are checked here (std::invalid_argument); gathered rows outside [0, N)
// are only known when the graph runs and give NaN outputs.
#pragma once

#include <optional>

#include "mlx/array.h"

namespace flash_ext {

namespace mx = mlx::core;

// y = x @ dequantize(w).T [+ add]; x [..., K]. q8x: x rounded to int8 per 32-element block. add: a
// residual of y's shape, added after y is rounded to its dtype.
mx::array quantized_matvec(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                           int group_size, int bits, bool q8x, const std::optional<mx::array>& add);

// y = x @ w.T [+ add] for half w [N, K]; x [..., K].
mx::array half_matvec(const mx::array& x, const mx::array& w, const std::optional<mx::array>& add);

// y[..., i] = dot(W[rows[i]], x) for rows (1-D, integer) or i < n (0 <= n <= N): exactly one of them.
// bits unset: half W.
mx::array gather_matvec(const mx::array& x, const mx::array& w, const std::optional<mx::array>& scales,
                        const std::optional<mx::array>& biases, const std::optional<mx::array>& rows,
                        std::optional<int> n, int group_size, std::optional<int> bits, bool q8x);

// y[..., :] = sum_i h[..., i] * W[rows[i], :] (or over the first n rows); h [..., len(rows) or n].
mx::array gather_matvec_t(const mx::array& h, const mx::array& w, const std::optional<mx::array>& scales,
                          const std::optional<mx::array>& biases, const std::optional<mx::array>& rows,
                          std::optional<int> n, int group_size, std::optional<int> bits);

}  // namespace flash_ext
