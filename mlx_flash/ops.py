"""Matvec and layer ops: our CPU kernels (mlx_flash._ext) with MLX-op twins.

Every op returns a lazy MLX array. On the CPU device with the extension built, inputs of up to
MAX_KERNEL_ROWS rows (decode and prompt chunks) run our kernels; everything else (Metal, unsupported
formats, extension missing) runs the equivalent MLX ops, so results agree to float32 rounding.

Weight layouts are MLX's own: affine-quantized `w` uint32 [N, K*bits/32] with `scales`/`biases`
[N, K/group_size] (w = scale*q + bias), or float16/bfloat16 `w` [N, K]. All ops compute y = x @ W.T
unless named `_t` (y = h @ W[rows]).

The layer ops (rms_norm, layer_norm, rope, scaled_dot_product_attention) mirror mx.fast's: on the CPU stream
MLX runs those as op-by-op fallbacks (about a hundred primitives per decoder layer, each costing a
few microseconds of dispatch), ours are one primitive each.
"""

import importlib
import operator
import os
import sys
import warnings

import mlx.core as mx
import mlx.nn as nn

# Rows of x per kernel call. MLX's CPU ops have no fast path for quantized or half weights (measured
# 17-30x slower than ours from 8 to 512 rows), so prompts run on the kernels too, up to mlx-lm's
# prefill chunk of 2048 tokens; beyond that MLX's ops (the kernel converts x to float32 scratch).
MAX_KERNEL_ROWS = 2048
KERNEL_BITS = (4, 8)
KERNEL_GROUP_SIZES = (32, 64, 128)
HALF_DTYPES = (mx.float16, mx.bfloat16)
_FLOATS = (mx.float32, mx.float16, mx.bfloat16)


def _load_extension():
    try:
        ext = importlib.import_module("mlx_flash._ext")
    except ImportError as exc:
        return None, f"not built ({exc})"
    built = getattr(ext, "built_with_mlx", "?")
    if built != mx.__version__:  # libmlx's C++ ABI changes between releases
        return None, f"built for mlx {built}, running mlx {mx.__version__}; rebuild with `pip install .`"
    return ext, None


_ext, EXTENSION_ERROR = _load_extension()
EXTENSION_AVAILABLE = _ext is not None
# MLX_FLASH_KERNELS=0 in the environment starts with the kernels off (MLX's own ops everywhere),
# e.g. `MLX_FLASH_KERNELS=0 python -m mlx_flash.generate` to compare with MLX's CPU path.
_enabled = os.environ.get("MLX_FLASH_KERNELS", "1").strip() != "0"
# MLX_FLASH_Q8_ACTIVATIONS=1 (or --q8-activations, set_q8_activations) starts with int8 activations.
_q8x = os.environ.get("MLX_FLASH_Q8_ACTIVATIONS", "0").strip() == "1"
_warned = False


def set_kernels_enabled(enabled: bool) -> None:
    """Turn the CPU kernels on/off process-wide (off: always the MLX-op path; for tests and bench).

    The initial state comes from the environment: MLX_FLASH_KERNELS=0 starts with them off.
    """
    global _enabled
    _enabled = bool(enabled)


def set_q8_activations(enabled: bool) -> None:
    """Quantized matvecs round x to int8 per 32-element block (scale max|x|/127, like llama.cpp's q8
    activations) and use integer dot products: faster on the CPU kernels, but no longer equal to
    MLX's ops within float rounding: the result is W @ x_rounded, x_rounded carrying up to half an
    int8 step of error per element.
    Off by default; the MLX-op fallback ignores it."""
    global _q8x
    _q8x = bool(enabled)


def kernels_active() -> bool:
    """True when ops would run our kernels now: extension built, enabled, default device is CPU."""
    return EXTENSION_AVAILABLE and _enabled and mx.default_device() == mx.cpu


def say_fallback_once():
    global _warned
    if not _warned and not EXTENSION_AVAILABLE and mx.default_device() == mx.cpu:
        _warned = True
        warnings.warn(
            f"mlx_flash: CPU kernels not built; using the slower MLX-op path [{EXTENSION_ERROR}]",
            RuntimeWarning,
            stacklevel=3,
        )


def _use_kernel(x):
    if not kernels_active():
        say_fallback_once()
        return False
    if x.dtype not in _FLOATS or x.ndim == 0 or x.shape[-1] == 0:
        return False
    return x.size // x.shape[-1] <= MAX_KERNEL_ROWS


def _quant_ok(w, scales, biases, group_size, bits):
    return (
        bits in KERNEL_BITS
        and group_size in KERNEL_GROUP_SIZES
        and biases is not None
        and w.dtype == mx.uint32
        and w.ndim == 2
        and scales.dtype in _FLOATS
        and biases.dtype == scales.dtype
    )


def quantized_matvec(x, w, scales, biases, group_size=64, bits=4):
    """y = x @ dequantize(w).T for MLX affine-quantized w [N, K]; x [..., K] -> y [..., N]."""
    if _use_kernel(x) and _quant_ok(w, scales, biases, group_size, bits):
        return _ext.quantized_matvec(x, w, scales, biases, group_size, bits, q8_activations=_q8x)
    return mx.quantized_matmul(x, w, scales=scales, biases=biases, transpose=True,
                               group_size=group_size, bits=bits)


def quantized_embedding(ids, w, scales, biases, group_size=64, bits=4):
    """mlx-lm's QuantizedEmbedding lookup, mx.dequantize(w[ids], scales[ids], biases[ids]): one
    primitive on the kernel (MLX's ops: about 35 for a 4- or 8-bit table), the same values."""
    if (kernels_active() and ids.dtype in (mx.int32, mx.uint32)
            and _quant_ok(w, scales, biases, group_size, bits)):
        return _ext.quantized_embedding(ids, w, scales, biases, group_size, bits)
    return mx.dequantize(w[ids], scales=scales[ids], biases=None if biases is None else biases[ids],
                         group_size=group_size, bits=bits)


def half_matvec(x, w):
    """y = x @ w.T for float16/bfloat16 w [N, K]; x [..., K] -> y [..., N]."""
    if _use_kernel(x) and w.dtype in HALF_DTYPES and w.ndim == 2:
        return _ext.half_matvec(x, w)
    return x @ w.T


def result_dtype(a, b):
    """MLX's type promotion of two dtypes (the output dtype of a kernel op)."""
    return (mx.zeros((), a) + mx.zeros((), b)).dtype


def _select(a, rows, n):
    return a[:n] if rows is None else a[rows]


def _check_rows(rows, n):
    if (rows is None) == (n is None):
        raise ValueError("pass exactly one of rows (int32 indices) or n (use the first n rows)")


def gather_matvec(x, w, rows=None, n=None, scales=None, biases=None, group_size=64, bits=None):
    """y[..., i] = dot(W[rows[i]], x) (or W[:n]); x [..., K] -> y [..., len(rows) or n].

    W is half precision when bits is None, else MLX affine-quantized with scales/biases.
    The selected rows are read in place; the gather is never materialised on the kernel path.
    """
    _check_rows(rows, n)
    quant = bits is not None
    count = n if rows is None else rows.shape[0]
    if _use_kernel(x) and (_quant_ok(w, scales, biases, group_size, bits) if quant else w.dtype in HALF_DTYPES):
        return _ext.gather_matvec(x, w, scales, biases, rows, n, group_size, bits, q8_activations=_q8x and quant)
    if count == 0:
        dtype = result_dtype(x.dtype, scales.dtype if quant else w.dtype)
        return mx.zeros((*x.shape[:-1], 0), dtype)
    if quant:
        return mx.quantized_matmul(x, _select(w, rows, n), scales=_select(scales, rows, n),
                                   biases=_select(biases, rows, n), transpose=True,
                                   group_size=group_size, bits=bits)
    return x @ _select(w, rows, n).T


def gather_matvec_t(h, w, rows=None, n=None, scales=None, biases=None, group_size=64, bits=None):
    """y = h @ W[rows] (or W[:n]): the h-weighted sum of selected rows; h [..., n] -> y [..., K].

    W is half precision when bits is None, else MLX affine-quantized with scales/biases.
    """
    _check_rows(rows, n)
    quant = bits is not None
    if _use_kernel(h) and (_quant_ok(w, scales, biases, group_size, bits) if quant else w.dtype in HALF_DTYPES):
        return _ext.gather_matvec_t(h, w, scales, biases, rows, n, group_size, bits)
    count = n if rows is None else rows.shape[0]
    K = w.shape[1] * 32 // bits if quant else w.shape[1]
    if count == 0:
        dtype = result_dtype(h.dtype, scales.dtype if quant else w.dtype)
        return mx.zeros((*h.shape[:-1], K), dtype)
    if quant:
        return mx.quantized_matmul(h, _select(w, rows, n), scales=_select(scales, rows, n),
                                   biases=_select(biases, rows, n), transpose=False,
                                   group_size=group_size, bits=bits)
    return h @ _select(w, rows, n)


# ------------------------------------------------------------------------------------------------
# Layer ops

# The attention kernel keeps a [query heads per kv head * Lq, Lk] float32 score block per thread;
# above this many scores (16 MB) MLX's op runs instead.
MAX_ATTENTION_SCORES = 1 << 22


def _layer_kernel_ok(*arrays):
    if not kernels_active():
        say_fallback_once()
        return False
    return all(a.dtype in _FLOATS for a in arrays)


def _norm_kernel_ok(x, *params):
    """Kernel norms take x [..., D] and optional float vectors (weight, bias)."""
    return _layer_kernel_ok(x) and x.ndim >= 1 and all(
        a is None or (a.dtype in _FLOATS and a.ndim == 1) for a in params)


def rms_norm(x, weight, eps):
    """mx.fast.rms_norm(x, weight, eps): x * rsqrt(mean(x^2, -1) + eps) * weight."""
    if _norm_kernel_ok(x, weight):
        return _ext.rms_norm(x, weight, eps)
    return mx.fast.rms_norm(x, weight, eps)


def layer_norm(x, weight, bias, eps):
    """mx.fast.layer_norm(x, weight, bias, eps): (x - mean) * rsqrt(var + eps) * weight + bias."""
    if _norm_kernel_ok(x, weight, bias):
        return _ext.layer_norm(x, weight, bias, eps)
    return mx.fast.layer_norm(x, weight, bias, eps)


def rope(x, dims, *, traditional, base, scale, offset, freqs=None):
    """mx.fast.rope with the same arguments (x [..., L, D]; positions offset .. offset + L - 1)."""
    if (_layer_kernel_ok(x) and isinstance(offset, int) and x.ndim >= 2 and dims % 2 == 0
            and 0 < dims <= x.shape[-1] and (freqs is None) != (base is None)):
        return _ext.rope(x, dims, traditional, 1.0 if base is None else base, scale, offset, freqs)
    return mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=offset, freqs=freqs)


def _attention_kernel_ok(q, k, v, mask, sinks):
    causal = isinstance(mask, str) and mask == "causal"
    return (_layer_kernel_ok(q, k, v) and sinks is None and (mask is None or causal)
            and q.ndim == k.ndim == v.ndim == 4 and k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0
            and k.shape[2] >= q.shape[2]
            and q.shape[1] // k.shape[1] * q.shape[2] * k.shape[2] <= MAX_ATTENTION_SCORES)


def scaled_dot_product_attention(q, k, v, *, scale, mask=None, sinks=None):
    """mx.fast.scaled_dot_product_attention; the kernel serves masks None and "causal" (scores <= 16 MB)."""
    if _attention_kernel_ok(q, k, v, mask, sinks):
        return _ext.attention(q, k, v, scale, isinstance(mask, str))
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)


def mlx_lm_attention(queries, keys, values, cache, scale, mask, sinks=None):
    """Drop-in for mlx_lm.models.base.scaled_dot_product_attention (quantized caches keep theirs)."""
    if hasattr(cache, "bits"):
        return MLX_LM_ATTENTION(queries, keys, values, cache, scale, mask, sinks)
    return scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)


# ------------------------------------------------------------------------------------------------
# A whole llama-family decoder block per call (fused_block): norm + q/k/v + RoPE (+ the KV cache
# write), attention + o_proj + residual, norm + gate/up + SwiGLU + down + residual: three primitives,
# with their arguments read from the block's modules once. Decoding calls every block once per
# token; reading and checking its seven layers every time cost as much Python as the rest of the
# step. Modules are read, never changed; where the fused ops do not apply, mlx-lm's own block code
# runs (on the per-layer kernels patch_layers installs).


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
        if (getattr(layer, "mode", "affine") == "affine" and _quant_ok(layer["weight"], layer["scales"],
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
    if isinstance(norm, nn.RMSNorm) and "weight" in norm and norm["weight"].dtype in _FLOATS and norm["weight"].ndim == 1:
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
    if x.ndim != 3 or not _use_kernel(x):
        return None
    plan = _block_plan(block, dense_mlp)
    if plan.qkv is None:
        return None
    B, L, _ = x.shape
    offset = 0 if cache is None else cache.offset
    causal = isinstance(mask, str) and mask == "causal"
    if ((mask is not None and not causal) or not isinstance(offset, int) or hasattr(cache, "bits")
            or plan.group * L * (offset + L) > MAX_ATTENTION_SCORES):
        return None
    k_cache = v_cache = None
    if (type(cache) is _KVCache and cache.keys is not None and offset + L <= cache.keys.shape[2]
            and cache.keys.dtype == _promote(x.dtype, *plan.k_dtypes) == cache.values.dtype):
        k_cache, v_cache = cache.keys, cache.values
    q, k, v = _ext.norm_qkv_rope(x, *plan.qkv, offset, None, q8_activations=_q8x, k_cache=k_cache,
                                 v_cache=v_cache)
    n_keys = None
    if k_cache is not None:
        cache.keys, cache.values = k, v
        cache.offset = n_keys = offset + L
    elif cache is not None:
        k, v = cache.update_and_fetch(k, v)
    h = _ext.attention_o_proj(q, k, v, plan.scale, causal, n_keys, *plan.o, x, q8_activations=_q8x)
    if plan.mlp is None:
        return h + block.mlp(block.post_attention_layernorm(h))
    return _ext.norm_swiglu(h, *plan.mlp, q8_activations=_q8x, down=plan.down[0], down_group_size=plan.down[1],
                            down_bits=plan.down[2])


try:
    from mlx_lm.models.base import scaled_dot_product_attention as MLX_LM_ATTENTION  # what we replace
    from mlx_lm.models.cache import KVCache as _KVCache
except ImportError:  # mlx-lm missing: nothing to patch
    MLX_LM_ATTENTION = _KVCache = None


