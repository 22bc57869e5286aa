"""Kernel-backed mlx-lm layers: the seam where a loaded model's modules run on our CPU kernels.

patch_layers re-classes modules in place, so parameters, names and isinstance checks are unchanged;
only __call__ / as_linear route through cpu/ops.py (which falls back to MLX's ops whenever the
kernels do not apply). Decoder blocks of the llama family become FusedBlock subclasses: 3
primitives per token and layer instead of 27 (norm + q/k/v + RoPE + the KV cache write; attention
over the cache buffer + o_proj + residual; norm + gate/up + SwiGLU + down + residual; see
fused.fused_block).
"""

import sys

import mlx.nn as nn
from mlx_lm.models import llama, qwen2
from mlx_lm.models.base import scaled_dot_product_attention as MLX_LM_ATTENTION  # what we replace

from . import ops
from .fused import fused_block


class KernelQuantizedLinear(nn.QuantizedLinear):
    def __call__(self, x):
        y = ops.quantized_matvec(x, self["weight"], self["scales"], self["biases"], self.group_size, self.bits)
        if "bias" in self:
            y = y + self["bias"]
        return y


class KernelLinear(nn.Linear):
    def __call__(self, x):
        y = ops.half_matvec(x, self["weight"])
        if "bias" in self:
            y = y + self["bias"]
        return y


class KernelRMSNorm(nn.RMSNorm):
    def __call__(self, x):
        return ops.rms_norm(x, self["weight"], self.eps)


class KernelLayerNorm(nn.LayerNorm):
    def __call__(self, x):
        weight = self.weight if "weight" in self else None
        bias = self.bias if "bias" in self else None
        return ops.layer_norm(x, weight, bias, self.eps)


class KernelRoPE(nn.RoPE):
    def __call__(self, x, offset: int = 0):
        return ops.rope(x, self.dims, traditional=self.traditional, base=self.base, scale=self.scale, offset=offset)


class KernelQuantizedEmbedding(nn.QuantizedEmbedding):
    def __call__(self, x):
        return ops.quantized_embedding(x, self["weight"], self["scales"], self.get("biases"), self.group_size,
                                       self.bits)

    def as_linear(self, x):
        return ops.quantized_matvec(x, self["weight"], self["scales"], self["biases"], self.group_size, self.bits)


class KernelEmbedding(nn.Embedding):
    def as_linear(self, x):
        return ops.half_matvec(x, self.weight)


def _affine_ok(m):
    return (
        getattr(m, "mode", "affine") == "affine"
        and m.bits in ops.KERNEL_BITS
        and m.group_size in ops.KERNEL_GROUP_SIZES
        and "biases" in m
    )


def patch_layers(model) -> int:
    """Route a loaded mlx-lm model's layers through the CPU kernels where they apply.

    Swaps nn.QuantizedLinear (affine, 4/8 bits, groups 32/64/128), nn.Linear with float16/bfloat16
    weights, nn.QuantizedEmbedding / nn.Embedding (their as_linear, used for tied lm_head),
    nn.RMSNorm, nn.LayerNorm and nn.RoPE, re-classes llama-family decoder blocks (mlx-lm's llama and qwen2
    TransformerBlock) to FusedBlock versions, and points the model's module-level
    `scaled_dot_product_attention` (mlx-lm's) at ours. Each swapped call still checks kernels_active(), so turning the kernels off
    later restores MLX's ops. Weights are untouched. Returns the number of modules swapped; 0
    unless kernels_active().
    """
    if not ops.kernels_active():
        ops.say_fallback_once()
        return 0
    swapped = 0
    for _, m in model.named_modules():
        cls = type(m)
        if cls is nn.QuantizedLinear and _affine_ok(m):
            m.__class__ = KernelQuantizedLinear
        elif cls is nn.Linear and m["weight"].dtype in ops.HALF_DTYPES:
            m.__class__ = KernelLinear
        elif cls is nn.QuantizedEmbedding and _affine_ok(m):
            m.__class__ = KernelQuantizedEmbedding
        elif cls is nn.Embedding and m["weight"].dtype in ops.HALF_DTYPES:
            m.__class__ = KernelEmbedding
        elif cls is nn.RMSNorm:
            m.__class__ = KernelRMSNorm
        elif cls is nn.LayerNorm:
            m.__class__ = KernelLayerNorm
        elif cls is nn.RoPE:
            m.__class__ = KernelRoPE
        elif cls in _FUSED_BLOCKS and _fusable_block(m):
            m.__class__ = _FUSED_BLOCKS[cls]
        else:
            _patch_attention(type(m).__module__)
            continue
        swapped += 1
    return swapped


def mlx_lm_attention(queries, keys, values, cache, scale, mask, sinks=None):
    """Drop-in for mlx_lm.models.base.scaled_dot_product_attention (quantized caches keep theirs)."""
    if hasattr(cache, "bits"):
        return MLX_LM_ATTENTION(queries, keys, values, cache, scale, mask, sinks)
    return ops.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)


def _patch_attention(module_name):
    # mlx-lm's model files import base.scaled_dot_product_attention by name; rebind that name.
    module = sys.modules.get(module_name)
    if getattr(module, "scaled_dot_product_attention", None) is MLX_LM_ATTENTION:
        module.scaled_dot_product_attention = mlx_lm_attention


class FusedBlock:
    """__call__ of a llama-family decoder block (mlx-lm's TransformerBlock: input_layernorm,
    self_attn with q/k/v/o_proj + rope + KV cache, post_attention_layernorm, mlp) through
    fused.fused_block; mixed in front of the block's own class, whose __call__ runs when the kernels
    are off or do not serve the call. An MLP that is not the block's dense gated MLP (e.g. a flash
    FFN) is called as a module."""

    def __call__(self, x, mask=None, cache=None):
        if ops.kernels_active():
            y = fused_block(self, x, mask, cache, dense_mlp=type(self.mlp) is self._dense_mlp)
            if y is not None:
                return y
        return super().__call__(x, mask, cache)


# {mlx-lm block class: its dense MLP class} for the architectures FusedBlock serves; mistral loads
# as llama in mlx-lm; qwen2's block is llama's with q/k/v biases.
_LLAMA_FAMILY = {llama.TransformerBlock: llama.MLP, qwen2.TransformerBlock: qwen2.MLP}
_FUSED_BLOCKS = {cls: type(f"Fused{cls.__name__}", (FusedBlock, cls), {"_dense_mlp": mlp})
                 for cls, mlp in _LLAMA_FAMILY.items()}


def _fusable_block(block):
    a = getattr(block, "self_attn", None)
    return (a is not None and all(hasattr(a, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "rope",
                                                           "n_heads", "n_kv_heads", "scale"))
            and isinstance(getattr(block, "input_layernorm", None), nn.RMSNorm)
            and isinstance(getattr(block, "post_attention_layernorm", None), nn.RMSNorm))
