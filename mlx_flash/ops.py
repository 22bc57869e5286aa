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


def attention_heads_last(q, k, v, cache, *, scale, mask=None, n_keys=None):
    """mlx-lm's attention followed by its transpose(0, 2, 1, 3).reshape(B, L, -1): [B, L, H * Dv],
    what o_proj reads; one primitive on the kernel. n_keys: only the first n_keys rows of k and v
    are keys (a KV cache buffer, as qkv_into_cache returns it)."""
    if n_keys is not None and n_keys == k.shape[2]:
        n_keys = None
    if not hasattr(cache, "bits") and _attention_kernel_ok(q, k, v, mask, None) and (n_keys is None or n_keys >= q.shape[2]):
        return _ext.attention(q, k, v, scale, isinstance(mask, str), heads_last=True, n_keys=n_keys)
    if n_keys is not None:
        k, v = k[..., :n_keys, :], v[..., :n_keys, :]
    B, _, L, _ = q.shape
    return mlx_lm_attention(q, k, v, cache, scale, mask).transpose(0, 2, 1, 3).reshape(B, L, -1)


# ------------------------------------------------------------------------------------------------
# Fused decoder-layer ops: each is several MLX ops of mlx-lm's llama-family blocks in one primitive
# (one dispatch, one thread-pool job for several matvecs); the twins are those MLX ops. Layers are
# mlx.nn modules (QuantizedLinear / Linear, RMSNorm, RoPE), read but never changed.


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


def linear(x, layer, add=None):
    """layer(x), plus `add` (a residual of the output's shape) when given: `add + layer(x)` in one
    primitive on the kernels (the sum sees layer(x) rounded to its dtype, as the unfused ops)."""
    proj = projection(layer) if add is not None and _use_kernel(x) else None
    if proj is not None and proj[0][3] is None:
        (w, scales, biases, _), group_size, bits = proj
        if add.shape == (*x.shape[:-1], w.shape[0]) and add.dtype in _FLOATS:
            if bits is None:
                return _ext.half_matvec(x, w, add=add)
            return _ext.quantized_matvec(x, w, scales, biases, group_size, bits, q8_activations=_q8x, add=add)
    y = layer(x)
    return y if add is None else add + y


def _qkv_kernel_args(x, norm, q_proj, k_proj, v_proj, n_heads, rope, offset):
    """(args of _ext.norm_qkv_rope after n_kv_heads' place is filled, k's output dtype) when the fused
    kernel serves these modules (plain nn.RoPE, one weight format, an RMSNorm or none), else None."""
    projs = _shared_projections(q_proj, k_proj, v_proj) if _use_kernel(x) and x.ndim == 3 else None
    nw = _rms_weight(norm) if norm is not None else (None, 0.0)
    if (projs is None or nw is None or not isinstance(rope, nn.RoPE) or not isinstance(offset, int)
            or rope.base is None or rope.dims % 2 or rope.dims <= 0):
        return None
    (q, group_size, bits), (k, _, _), (v, _, _) = projs
    if q[0].shape[0] % n_heads or rope.dims > q[0].shape[0] // n_heads:
        return None
    # The kernel's output dtypes are MLX's promotion of the unfused ops' (normed x, weights, bias).
    y = _promote(x.dtype, nw[0].dtype if nw[0] is not None else x.dtype, (k[1] if bits else k[0]).dtype)
    k_dtype = y if k[3] is None else _promote(y, k[3].dtype)
    return (nw[0], nw[1], q, k, v, group_size or 64, bits), k_dtype


def _promote(*dtypes):
    """MLX's promotion of float32 / float16 / bfloat16 (float16 with bfloat16 gives float32)."""
    kinds = set(dtypes)
    return kinds.pop() if len(kinds) == 1 else mx.float32


def norm_qkv_rope(x, norm, q_proj, k_proj, v_proj, n_heads, n_kv_heads, rope, offset=0):
    """(q, k, v) [B, H, L, head_dim] as mlx-lm's llama Attention computes them before its KV cache:
    h = norm(x) (None: h = x); q_proj(h), k_proj(h), v_proj(h) split into heads; RoPE at positions
    offset.. on q and k. One primitive on the kernels (plain nn.RoPE, one weight format)."""
    fused = _qkv_kernel_args(x, norm, q_proj, k_proj, v_proj, n_heads, rope, offset)
    if fused is not None:
        nw, eps, q, k, v, group_size, bits = fused[0]
        return _ext.norm_qkv_rope(x, nw, eps, q, k, v, group_size, bits, n_heads, n_kv_heads, rope.dims,
                                  rope.traditional, rope.base, rope.scale, offset, None, q8_activations=_q8x)
    h = norm(x) if norm is not None else x
    B, L, _ = x.shape
    q, k, v = (m(h).reshape(B, L, heads, -1).transpose(0, 2, 1, 3)
               for m, heads in ((q_proj, n_heads), (k_proj, n_kv_heads), (v_proj, n_kv_heads)))
    return rope(q, offset=offset), rope(k, offset=offset), v


def qkv_into_cache(x, norm, q_proj, k_proj, v_proj, n_heads, n_kv_heads, rope, cache):
    """(q, keys, values, n_keys): norm_qkv_rope at the cache's offset with k and v appended to mlx-lm's
    KV `cache` (None: no cache), as mlx-lm's attention does with cache.update_and_fetch; keys / values
    hold all positions so far in their first n_keys rows (pass n_keys to attention_heads_last).
    On the kernels, a plain KVCache whose buffers have room gets k and v written into them by the
    same primitive (in place, as MLX's slice_update), instead of two slice_update and two slice ops."""
    if cache is None:
        q, k, v = norm_qkv_rope(x, norm, q_proj, k_proj, v_proj, n_heads, n_kv_heads, rope, 0)
        return q, k, v, k.shape[2]
    offset = cache.offset
    if (type(cache) is _KVCache and cache.keys is not None and x.ndim == 3
            and offset + x.shape[1] <= cache.keys.shape[2]):
        fused = _qkv_kernel_args(x, norm, q_proj, k_proj, v_proj, n_heads, rope, offset)
        if fused is not None and cache.keys.dtype == fused[1] == cache.values.dtype:
            nw, eps, q, k, v, group_size, bits = fused[0]
            q, cache.keys, cache.values = _ext.norm_qkv_rope(
                x, nw, eps, q, k, v, group_size, bits, n_heads, n_kv_heads, rope.dims, rope.traditional,
                rope.base, rope.scale, offset, None, q8_activations=_q8x, k_cache=cache.keys,
                v_cache=cache.values)
            cache.offset += x.shape[1]
            return q, cache.keys, cache.values, cache.offset
    q, k, v = norm_qkv_rope(x, norm, q_proj, k_proj, v_proj, n_heads, n_kv_heads, rope, offset)
    k, v = cache.update_and_fetch(k, v)
    return q, k, v, k.shape[2]


def norm_swiglu(x, norm, gate_proj, up_proj):
    """swiglu(gate_proj(h), up_proj(h)) = silu(gate) * up with h = norm(x) (None: h = x): mlx-lm's
    gated MLP before its down projection. One primitive on the kernels."""
    projs = _shared_projections(gate_proj, up_proj) if _use_kernel(x) else None
    nw = _rms_weight(norm) if norm is not None else (None, 0.0)
    if projs is not None and nw is not None and projs[0][0][3] is None and projs[1][0][3] is None:
        (g, group_size, bits), (u, _, _) = projs
        return _ext.norm_swiglu(x, nw[0], nw[1], g, u, group_size or 64, bits, q8_activations=_q8x)
    h = norm(x) if norm is not None else x
    return _swiglu(gate_proj(h), up_proj(h))


try:
    from mlx_lm.models.activations import swiglu as _swiglu
    from mlx_lm.models.base import scaled_dot_product_attention as MLX_LM_ATTENTION  # what we replace
    from mlx_lm.models.cache import KVCache as _KVCache
except ImportError:  # mlx-lm missing: nothing to patch
    MLX_LM_ATTENTION = _KVCache = None

    def _swiglu(gate, x):
        return nn.silu(gate) * x


