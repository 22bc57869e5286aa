// A mixture-of-experts layer's routed experts as one CPU primitive (mlx-lm's SwitchGLU on a slot
// bank): every (token, choice) pair's gate and up projections, SwiGLU and down projection, with
// the experts' weights read in place from bank arrays [slots, ...].
#pragma once

#include <optional>

#include "fused_ops.h"
#include "mlx/array.h"

namespace flash_ext {

// y [T, k, D]: y[t, j] = down_s(silu(gate_s(x[t])) * up_s(x[t])), s = slots[t, j], for x [T, D] and
// slots int32 [T, k]. gate / up: banks w [S, I, D * bits / 32] with scales / biases [S, I, D / gs]
// (no bias); down: a bank [S, D, I * down_bits / 32] in its own width and group size. The pairs
// are grouped by slot (tokens in order within a group) and each group is one set of matvecs over
// its rows, so a pair's result depends on which tokens its expert serves, never on which slot
// holds the expert. Intermediates are rounded where mlx-lm's SwitchGLU rounds them (gate / up
// outputs to their dtype, the SwiGLU product to it). Slots outside [0, S) give NaN rows.
mlx::core::array experts_swiglu(const mlx::core::array& x, const mlx::core::array& slots, const Linear& gate,
                                const Linear& up, const Linear& down, int group_size, int bits, int down_group_size,
                                int down_bits, bool q8_activations);

}  // namespace flash_ext
