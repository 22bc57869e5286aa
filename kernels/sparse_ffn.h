// A flash layer's FFN on the rows it holds now, and the mask of the neurons it needs, as CPU primitives: what FlashFFN's row projections
// build as about a dozen MLX ops per row set (gate take, up matvec, the activation's elementwise ops,
// down matvec, the adds between row sets) in one dispatch, with every intermediate rounded where the
// op-by-op path rounds it.
#pragma once

#include <optional>
#include <vector>

#include "mlx/array.h"
#include "mlx_view.h"

namespace flash_ext {

// One set of rows: up [R, K], gate [R, K] (absent: the gate comes from gate_values), down_t [R, K],
// all float16 or all bfloat16; the first n rows are used; ids (int32 [n]): their neuron ids, the
// columns of gate_values they take (absent: columns 0..n-1).
struct RowSet {
  mlx::core::array up;
  std::optional<mlx::core::array> gate;
  mlx::core::array down;
  int n;
  std::optional<mlx::core::array> ids;
};

// Activations (h from the gate's output g and the up projection's u, each rounded to the dtype):
//   0 "silu":       a = silu(g) rounded; h = a * u where |a| > threshold, else 0 (SwiGLU; CATS)
//   1 "relu_gated": h = g * u where g > threshold, else 0 (ReLU, FATReLU)
//   2 "relu":       h = u where u > threshold, else 0 (no gate: down(relu(up x)))
// y = [add +] sum over the row sets of round(h @ down_t[:n]) with each partial sum rounded, as
// `y = y + part` computes it; x [..., K]; gate_values [..., N] when a set has no gate rows.
// A set without gate rows multiplies only the rows some x row activates (its gate values are
// known first; the others' h is 0 and adds nothing): a CATS layer pays for its active neurons.
// What sparse_ffn computes a row set with: the rows' format (flash::FMT_F16 / FMT_BF16), act (as
// above), the output dtype (DT_*) and the threshold rounded to it (ffn_params).
struct FfnParams {
  int fmt, act, ydt;
  float threshold;
};
FfnParams ffn_params(int fmt, int act, mlx::core::Dtype ydt, float threshold);

// One row set as a task reads it: up / gate / down_t [R, K] views, the first n rows used, ids
// (int32 [n]) their neuron ids (nullptr: 0..n-1).
struct SetRows {
  View up, gate;
  bool has_gate = false;
  View down;
  int n = 0;
  const int32_t* ids = nullptr;
};

// sparse_ffn's arithmetic inside a task: y [M, K] (float32 values of P.ydt) <- [y +] each set's
// part in order (have_y: y already holds a sum; true on return); xin [M, K] float32; gate_values
// [M, N] for sets without gate rows (nullptr when none needs it).
void ffn_sets(const FfnParams& P, int M, int K, const float* xin, const View* gate_values,
              const std::vector<SetRows>& sets, float* y, bool& have_y);

mlx::core::array sparse_ffn(const mlx::core::array& x, const std::vector<RowSet>& sets,
                            const std::optional<mlx::core::array>& gate_values, int act, float threshold,
                            const std::optional<mlx::core::array>& add);

// The neurons a gate-threshold predictor keeps, from the gate's output g [..., N]: mask[i] = any over
// the leading rows of |a| > threshold, a = silu(g) (act 0, as MLX rounds it) or g where g > act_threshold
// else 0 (act 1: ReLU, FATReLU); both thresholds compared in g's dtype, as MLX compares a Python
// float with an array. bool [N].
mlx::core::array active_mask(const mlx::core::array& g, int act, float act_threshold, float threshold);

}  // namespace flash_ext
