// The non-matvec ops of a decoder layer as MLX CPU primitives. On the CPU stream MLX runs its
// mx.fast.rms_norm / layer_norm / rope / scaled_dot_product_attention as their op-by-op fallbacks (~100
// primitives per layer, each a few microseconds of dispatch); these are one primitive each.
#pragma once

#include <optional>

#include "mlx/array.h"
#include "mlx_view.h"

namespace flash_ext {

// mx.fast.rms_norm: x * rsqrt(mean(x^2, -1) + eps) [* w]; dtype promote(x, w).
mlx::core::array rms_norm(const mlx::core::array& x, const std::optional<mlx::core::array>& w, float eps);

// mx.fast.layer_norm: (x - mean) * rsqrt(var + eps) [* w] [+ b]; dtype promote(x, w, b).
mlx::core::array layer_norm(const mlx::core::array& x, const std::optional<mlx::core::array>& w,
                            const std::optional<mlx::core::array>& b, float eps);

// mx.fast.rope on x [..., L, D]: rotates the first `dims` features of position offset + l.
// inv_freq[j] = 1 / freqs[j] when freqs is given, else base^(-2j/dims).
mlx::core::array rope(const mlx::core::array& x, int dims, bool traditional, float base, float scale, int offset,
                      const std::optional<mlx::core::array>& freqs);

// mx.fast.scaled_dot_product_attention for q [B, Hq, Lq, D], k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv]
// (Hq a multiple of Hkv), no mask or a causal one (query i sees keys j <= Lk - Lq + i). heads_last:
// the output is [B, Lq, Hq * Dv] (the transpose + reshape mlx-lm applies before o_proj) instead of
// [B, Hq, Lq, Dv]. n_keys: only the first n_keys rows of k and v are keys (a KV cache buffer).
// What FlashAttention's task runs, on the calling thread and the kernels' pool: q [B, Hq, Lq, D]
// over the first n_keys rows of k / v into contiguous out (dtype odt), [B, Lq, Hq * Dv] when
// heads_last, else [B, Hq, Lq, Dv].
void attention_into(const View& q, const View& k, const View& v, int n_keys, float scale, bool causal,
                    bool heads_last, uint8_t* out, int odt);

// attention's argument checks; out_shape / out_dtype: its output's.
void check_attention(const mlx::core::array& q, const mlx::core::array& k, const mlx::core::array& v,
                     bool heads_last, std::optional<int> n_keys, mlx::core::Shape& out_shape,
                     mlx::core::Dtype& out_dtype);

mlx::core::array attention(const mlx::core::array& q, const mlx::core::array& k, const mlx::core::array& v,
                           float scale, bool causal, bool heads_last = false,
                           std::optional<int> n_keys = std::nullopt);

// The rows ids (int32 / uint32, any shape) of an MLX affine-quantized table w [V, K * bits / 32]
// with scales / biases [V, K / group_size], dequantized exactly as mx.dequantize(w[ids], scales[ids],
// biases[ids]) computes them: out [..., K] in the scales' dtype. Ids outside [0, V) give NaN rows.
mlx::core::array quantized_embedding(const mlx::core::array& ids, const mlx::core::array& w,
                                     const mlx::core::array& scales, const mlx::core::array& biases, int group_size,
                                     int bits);

}  // namespace flash_ext
