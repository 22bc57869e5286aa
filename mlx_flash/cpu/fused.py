"""A whole llama-family decoder block per kernel call (block fusion).

fused_block: norm + q/k/v + RoPE (+ the KV cache write), attention + o_proj + residual, norm +
gate/up + SwiGLU + down + residual: three primitives, with their arguments read from the block's
modules once. Decoding calls every block once per token; reading and checking its seven layers
every time cost as much Python as the rest of the step. Modules are read, never changed; where the
fused ops do not apply, mlx-lm's own block code runs (on the per-layer kernels patch_layers installs).
"""

import operator

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from .ops import FLOAT_DTYPES, HALF_DTYPES, MAX_ATTENTION_SCORES, extension, q8_activations, quant_ok, use_kernel


def projection(layer):
    """((w, scales, biases, bias), group_size, bits) of a linear layer the kernels read, else None.
    bits is None for float16/bfloat16 weights; scales, biases and bias are None where absent.
    Remembered on the layer until one of its arrays is replaced (decode asks every token)."""
    get = layer.get
    w, s, b, bias = get("weight"), get("scales"), get("biases"), get("bias")
    memo = layer.__dict__.get("_flash_projection")
    if memo is not None and memo[0] is w and memo[1] is s and memo[2] is b and memo[3] is bias:
        return memo[4]
    result = _read_projection(layer)
    object.__setattr__(layer, "_flash_projection", (w, s, b, bias, result))  # not a parameter: bypass Module
    return result


def _read_projection(layer):
    bias = layer["bias"] if "bias" in layer else None
    if isinstance(layer, nn.QuantizedLinear):
        if (getattr(layer, "mode", "affine") == "affine" and quant_ok(layer["weight"], layer["scales"],
                                                                      layer.get("biases"), layer.group_size, layer.bits)):
            return (layer["weight"], layer["scales"], layer["biases"], bias), layer.group_size, layer.bits
        return None
    if isinstance(layer, nn.Linear) and layer["weight"].dtype in HALF_DTYPES and layer["weight"].ndim == 2:
        return (layer["weight"], None, None, bias), None, None
    return None


def _shared_projections(*layers):
    """The layers' projections when all are kernel-readable in one format, else None."""
    projs = [projection(m) for m in layers]
    if any(p is None for p in projs) or len({(p[1], p[2], p[0][0].dtype, p[0][1] is None or p[0][1].dtype)
                                             for p in projs}) != 1:
        return None
    return projs


def _rms_weight(norm):
    """(weight, eps) of an RMSNorm module the fused kernels apply, or None."""
    if isinstance(norm, nn.RMSNorm) and "weight" in norm and norm["weight"].dtype in FLOAT_DTYPES and norm["weight"].ndim == 1:
        return norm["weight"], norm.eps
    return None


def _promote(*dtypes):
    """MLX's promotion of float32 / float16 / bfloat16 (float16 with bfloat16 gives float32)."""
    kinds = set(dtypes)
    return kinds.pop() if len(kinds) == 1 else mx.float32


_PARAMS = ("weight", "scales", "biases", "bias")
_BLOCK_CHILDREN = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
_ATTN_CHILDREN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP_CHILDREN = ("gate_proj", "up_proj", "down_proj")


class _BlockPlan:
    """The fused ops' arguments for one block, and what they were read from: holders[i][keys[i]] was
    held[i] (the block's child modules, their projections and norms, and those modules' arrays)."""

    __slots__ = ("dense_mlp", "holders", "keys", "held", "qkv", "k_dtypes", "group", "scale", "o", "mlp", "down")


def _output_projection(proj):
    """((w, scales, biases, None), group_size, bits) of a bias-free projection() result, else None."""
    if proj is None or proj[0][3] is not None:
        return None
    arrays, group_size, bits = proj
    return arrays, group_size or 64, bits


def _read_block_plan(plan, attn, mlp, norm1, norm2):
    """Fills plan's op arguments; leaves plan.qkv None when the fused ops do not serve the block."""
    plan.qkv = plan.mlp = plan.down = None
    nw = _rms_weight(norm1)
    projs = _shared_projections(attn.q_proj, attn.k_proj, attn.v_proj)
    rope = attn.rope
    if (nw is None or projs is None or not isinstance(rope, nn.RoPE) or rope.base is None
            or rope.dims % 2 or rope.dims <= 0):
        return
    (q, group_size, bits), (k, _, _), (v, _, _) = projs
    n_heads, n_kv_heads = attn.n_heads, attn.n_kv_heads
    if q[0].shape[0] % n_heads or rope.dims > q[0].shape[0] // n_heads or n_heads % n_kv_heads:
        return
    o = _output_projection(projection(attn.o_proj))
    if o is None:
        return
    plan.qkv = (nw[0], nw[1], q, k, v, group_size or 64, bits, n_heads, n_kv_heads, rope.dims,
                rope.traditional, rope.base, rope.scale)
    # k's dtype is MLX's promotion of x's, the norm weight's, the weights' (or scales') and k's bias's
    plan.k_dtypes = (nw[0].dtype, (k[1] if bits else k[0]).dtype) + ((k[3].dtype,) if k[3] is not None else ())
    plan.group, plan.scale, plan.o = n_heads // n_kv_heads, attn.scale, o
    if mlp is not None:
        nw2 = _rms_weight(norm2)
        gate_up = _shared_projections(mlp.gate_proj, mlp.up_proj)
        down = _output_projection(projection(mlp.down_proj))
        if (nw2 is not None and gate_up is not None and down is not None and gate_up[0][0][3] is None
                and gate_up[1][0][3] is None):
            (g, group_size, bits), (u, _, _) = gate_up
            plan.mlp, plan.down = (nw2[0], nw2[1], g, u, group_size or 64, bits), down


def _block_plan(block, dense_mlp):
    """The block's plan (plan.qkv None: the fused ops do not serve it), read again when a module or
    array of the block was replaced. dense_mlp: whether block.mlp is the gated MLP the fused ops compute."""
    plan = block.__dict__.get("_flash_plan")
    # The check runs every call: C-level maps over (module, key, what it held) triples, ~2 us.
    if (plan is not None and plan.dense_mlp is dense_mlp
            and all(map(operator.is_, map(dict.get, plan.holders, plan.keys), plan.held))):
        return plan
    attn, mlp, norm1, norm2 = (block[name] for name in _BLOCK_CHILDREN)
    holders = [(block, name) for name in _BLOCK_CHILDREN] + [(attn, name) for name in _ATTN_CHILDREN]
    leaves = [norm1, norm2] + [attn[name] for name in _ATTN_CHILDREN]
    if dense_mlp:
        holders += [(mlp, name) for name in _MLP_CHILDREN]
        leaves += [mlp[name] for name in _MLP_CHILDREN]
    holders += [(m, name) for m in leaves for name in _PARAMS]
    plan = _BlockPlan()
    plan.dense_mlp = dense_mlp
    plan.holders, plan.keys = tuple(h for h, _ in holders), tuple(k for _, k in holders)
    plan.held = tuple(h.get(k) for h, k in holders)
    _read_block_plan(plan, attn, mlp if dense_mlp else None, norm1, norm2)
    object.__setattr__(block, "_flash_plan", plan)  # not a parameter: bypass Module
    return plan


def fused_block(block, x, mask=None, cache=None, dense_mlp=True):
    """mlx-lm's llama-family TransformerBlock.__call__(x, mask, cache) on the fused kernels (a block.mlp
    that is not the block's dense gated MLP, dense_mlp False, is called as a module). Returns None
    when the kernels do not serve this call; the caller then runs mlx-lm's own code.

    A plain mlx-lm KVCache whose buffers have room gets k and v written into them by the q/k/v
    primitive (in place when MLX can donate the buffer, as its slice_update would) and attention
    reads their first offset + L rows: no slice_update and slice ops per layer. Otherwise (no room
    yet, other cache types) the cache's own update_and_fetch runs."""
    if x.ndim != 3 or not use_kernel(x):
        return None
    plan = _block_plan(block, dense_mlp)
    if plan.qkv is None:
        return None
    ext, q8x = extension(), q8_activations()
    B, L, _ = x.shape
    offset = 0 if cache is None else cache.offset
    causal = isinstance(mask, str) and mask == "causal"
    if ((mask is not None and not causal) or not isinstance(offset, int) or hasattr(cache, "bits")
            or plan.group * L * (offset + L) > MAX_ATTENTION_SCORES):
        return None
    k_cache = v_cache = None
    if (type(cache) is KVCache and cache.keys is not None and offset + L <= cache.keys.shape[2]
            and cache.keys.dtype == _promote(x.dtype, *plan.k_dtypes) == cache.values.dtype):
        k_cache, v_cache = cache.keys, cache.values
    q, k, v = ext.norm_qkv_rope(x, *plan.qkv, offset, None, q8_activations=q8x, k_cache=k_cache,
                                 v_cache=v_cache)
    n_keys = None
    if k_cache is not None:
        cache.keys, cache.values = k, v
        cache.offset = n_keys = offset + L
    elif cache is not None:
        k, v = cache.update_and_fetch(k, v)
    h = ext.attention_o_proj(q, k, v, plan.scale, causal, n_keys, *plan.o, x, q8_activations=q8x)
    if plan.mlp is None:
        return h + block.mlp(block.post_attention_layernorm(h))
    return ext.norm_swiglu(h, *plan.mlp, q8_activations=q8x, down=plan.down[0], down_group_size=plan.down[1],
                            down_bits=plan.down[2])
