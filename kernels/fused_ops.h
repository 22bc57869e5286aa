// Fused decoder-layer primitives for the CPU: what mlx-lm's llama-family attention and MLP blocks
// build as 12 and 4 MLX primitives per token, each as one (fewer dispatches, one thread-pool job).
// Every intermediate is rounded where the unfused path rounds it, so results equal the single ops'.
#pragma once

#include <optional>
#include <vector>

#include "mlx/array.h"

namespace flash_ext {

// One linear layer's weights: w (uint32 words with scales / biases when bits is set, else half).
struct Linear {
  mlx::core::array w;
  std::optional<mlx::core::array> scales, biases, bias;  // bias: the layer's additive bias [N]
};

// q, k, v for attention from x [B, L, D]: h = rms_norm(x, norm_weight, eps) (skipped when
// norm_weight is absent), then q = rope(heads(h @ Wq.T + bq)), k = rope(heads(h @ Wk.T + bk)),
// v = heads(h @ Wv.T + bv), where heads() is reshape(B, L, H, hd).transpose(0, 2, 1, 3) and rope is
// mx.fast.rope(dims, traditional, base, scale, offset, freqs). All three projections share one
// format (bits 4 / 8 with group_size, or None for float16 / bfloat16).
// With k_cache / v_cache [B, Hkv, S, hd] (S >= offset + L, the outputs' dtype), k and v are written
// into them at positions offset..offset+L-1 and the outputs are the whole updated caches: in place
// when a cache buffer is donatable (as MLX's slice_update), else into a copy.
std::vector<mlx::core::array> norm_qkv_rope(const mlx::core::array& x, const std::optional<mlx::core::array>& norm_weight,
                                            float eps, const std::vector<Linear>& qkv, int group_size,
                                            std::optional<int> bits, int n_heads, int n_kv_heads, int rope_dims,
                                            bool traditional, float base, float scale, int offset,
                                            const std::optional<mlx::core::array>& freqs, bool q8_activations,
                                            const std::optional<mlx::core::array>& k_cache = std::nullopt,
                                            const std::optional<mlx::core::array>& v_cache = std::nullopt);

// silu(h @ Wg.T) * (h @ Wu.T) with h = rms_norm(x, norm_weight, eps) (skipped without norm_weight).
// With down (no bias; its own format): x + down(that), the product rounded to its dtype first, as
// mlx-lm's unfused `h + mlp(norm(h))` rounds it.
mlx::core::array norm_swiglu(const mlx::core::array& x, const std::optional<mlx::core::array>& norm_weight, float eps,
                             const Linear& gate, const Linear& up, int group_size, std::optional<int> bits,
                             bool q8_activations, const std::optional<Linear>& down = std::nullopt,
                             int down_group_size = 64, std::optional<int> down_bits = std::nullopt);

// residual + o(attention(q, k, v)): attention as layer_ops' attention with heads_last (n_keys: the
// first n_keys rows of k / v), then the o projection (no bias), its product rounded to its dtype
// before the residual is added, as mlx-lm's `x + self_attn(...)` rounds it. One primitive.
mlx::core::array attention_o_proj(const mlx::core::array& q, const mlx::core::array& k, const mlx::core::array& v,
                                  float scale, bool causal, std::optional<int> n_keys, const Linear& o,
                                  int group_size, std::optional<int> bits, const mlx::core::array& residual,
                                  bool q8_activations);

}  // namespace flash_ext
