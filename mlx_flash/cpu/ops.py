"""Matvec and layer ops: our CPU kernels (mlx_flash._ext) with MLX-op twins.

Every op returns a lazy MLX array. On the CPU device with the extension built, inputs of up to
MAX_KERNEL_ROWS rows (decode and prompt chunks) run our kernels; everything else (Metal, unsupported
formats, extension missing) runs the equivalent MLX ops, so results agree to float32 rounding.

Weight layouts are MLX's own: affine-quantized `w` uint32 [N, K*bits/32] with `scales`/`biases`
[N, K/group_size] (w = scale*q + bias), or float16/bfloat16 `w` [N, K]. All ops compute y = x @ W.T
unless named `_t` (y = h @ W[rows]).

The layer ops (rms_norm, layer_norm, rope, scaled_dot_product_attention) mirror mx.fast's: on the CPU stream
MLX runs those as op-by-op fallbacks (about a hundred primitives per decoder layer, each costing a
few microseconds of dispatch), ours are one primitive each. A whole decoder block per call:
fused.py; routing a loaded model's modules through these ops: patch.py.
"""

import importlib
import operator
import os
import warnings

import mlx.core as mx
import mlx.nn as nn

from ..errors import FlashError

# Rows of x per kernel call. MLX's CPU ops have no fast path for quantized or half weights (measured
# 17-30x slower than ours from 8 to 512 rows), so prompts run on the kernels too, up to mlx-lm's
# prefill chunk of 2048 tokens; beyond that MLX's ops (the kernel converts x to float32 scratch).
MAX_KERNEL_ROWS = 2048
KERNEL_BITS = (4, 8)
KERNEL_GROUP_SIZES = (32, 64, 128)
HALF_DTYPES = (mx.float16, mx.bfloat16)
FLOAT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


# Slowest first; each includes the ones before it. avx512 = AVX-512 F/BW/VL + VBMI2 (the ENDOR decode
# has kernels of its own for it; the other kernels run their avx2 versions there).
KERNEL_ISAS = ("scalar", "avx2", "avx512")
MAX_KERNEL_THREADS = 256


def check_kernel_environment(environ=os.environ) -> None:
    """FlashError naming the variable unless MLX_FLASH_ISA and MLX_FLASH_THREADS are unset, empty or
    valid. This module is the one reader of both: the C++ reads no environment variable."""
    isa = environ.get("MLX_FLASH_ISA", "")
    if isa and isa not in KERNEL_ISAS:
        raise FlashError(f"MLX_FLASH_ISA={isa!r:.40}: unknown instruction set (choose from "
                         f"{', '.join(KERNEL_ISAS)}, or leave it unset for the best this CPU has)")
    threads = environ.get("MLX_FLASH_THREADS", "")
    if threads and not (threads.isdigit() and 1 <= int(threads) <= MAX_KERNEL_THREADS):
        raise FlashError(f"MLX_FLASH_THREADS={threads!r:.40}: must be a whole number in "
                         f"1..{MAX_KERNEL_THREADS} (unset: the CPU's cores, at most 16)")


def _load_extension():
    try:
        ext = importlib.import_module("mlx_flash._ext")
    except ImportError as exc:
        return None, f"not built ({exc})"
    built = getattr(ext, "built_with_mlx", "?")
    if built != mx.__version__:  # libmlx's C++ ABI changes between releases
        return None, f"built for mlx {built}, running mlx {mx.__version__}; rebuild with `pip install .`"
    return ext, None


def apply_kernel_environment(ext, environ=os.environ) -> None:
    """Set the kernels' instruction set and thread count from MLX_FLASH_ISA / MLX_FLASH_THREADS
    (checked by check_kernel_environment). An ISA this CPU lacks runs the best one it has (`avx512`
    on an AVX2-only CPU runs avx2; `avx2` without AVX2 runs scalar)."""
    isa = environ.get("MLX_FLASH_ISA", "")
    if isa:
        best = ext.best_isa()
        ext.set_isa(isa if KERNEL_ISAS.index(isa) <= KERNEL_ISAS.index(best) else best)
    threads = environ.get("MLX_FLASH_THREADS", "")
    if threads:
        ext.set_num_threads(int(threads))


check_kernel_environment()
_ext, EXTENSION_ERROR = _load_extension()
if _ext is not None:
    apply_kernel_environment(_ext)
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


def q8_activations() -> bool:
    """Whether quantized matvecs round activations to int8 now (set_q8_activations)."""
    return _q8x


def extension():
    """The compiled kernel module (mlx_flash._ext), None when not built."""
    return _ext


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


def use_kernel(x) -> bool:
    """True when an op on input x runs a kernel (kernels active, float x, at most MAX_KERNEL_ROWS rows)."""
    if not kernels_active():
        say_fallback_once()
        return False
    if x.dtype not in FLOAT_DTYPES or x.ndim == 0 or x.shape[-1] == 0:
        return False
    return x.size // x.shape[-1] <= MAX_KERNEL_ROWS


def quant_ok(w, scales, biases, group_size, bits) -> bool:
    """True when the kernels read this affine-quantized weight (bits, group size, dtypes)."""
    return (
        bits in KERNEL_BITS
        and group_size in KERNEL_GROUP_SIZES
        and biases is not None
        and w.dtype == mx.uint32
        and w.ndim == 2
        and scales.dtype in FLOAT_DTYPES
        and biases.dtype == scales.dtype
    )


def quantized_matvec(x, w, scales, biases, group_size=64, bits=4):
    """y = x @ dequantize(w).T for MLX affine-quantized w [N, K]; x [..., K] -> y [..., N]."""
    if use_kernel(x) and quant_ok(w, scales, biases, group_size, bits):
        return _ext.quantized_matvec(x, w, scales, biases, group_size, bits, q8_activations=_q8x)
    return mx.quantized_matmul(x, w, scales=scales, biases=biases, transpose=True,
                               group_size=group_size, bits=bits)


def quantized_embedding(ids, w, scales, biases, group_size=64, bits=4):
    """mlx-lm's QuantizedEmbedding lookup, mx.dequantize(w[ids], scales[ids], biases[ids]): one
    primitive on the kernel (MLX's ops: about 35 for a 4- or 8-bit table), the same values.
    Ids outside 0..rows-1 give NaN rows on both paths (MLX's gather does not check them: the twin
    gathers row 0 for them instead), with no host sync: mlx-lm's generate builds a token's graph on
    the last token's id before it is evaluated, so reading the ids here would stall that pipeline.
    Host ids (a prompt) are checked where they come in (api.check_token_ids)."""
    _check_id_dtype(ids)
    if (kernels_active() and ids.dtype in (mx.int32, mx.uint32)
            and quant_ok(w, scales, biases, group_size, bits)):
        return _ext.quantized_embedding(ids, w, scales, biases, group_size, bits)
    inside = (ids >= 0) & (ids < w.shape[0])
    safe = mx.where(inside, ids, 0)
    y = mx.dequantize(w[safe], scales=scales[safe], biases=None if biases is None else biases[safe],
                      group_size=group_size, bits=bits)
    return mx.where(inside[..., None], y, mx.array(float("nan"), y.dtype))


def half_matvec(x, w):
    """y = x @ w.T for float16/bfloat16 w [N, K]; x [..., K] -> y [..., N]."""
    if use_kernel(x) and w.dtype in HALF_DTYPES and w.ndim == 2:
        return _ext.half_matvec(x, w)
    return x @ w.T


def result_dtype(a, b):
    """MLX's type promotion of two dtypes (the output dtype of a kernel op)."""
    return (mx.zeros((), a) + mx.zeros((), b)).dtype


def _select(a, rows, n):
    return a[:n] if rows is None else a[rows]


def _check_id_dtype(ids) -> None:
    """ValueError unless `ids` are integers (its dtype only: the values stay lazy)."""
    if ids.size and (ids.dtype not in (mx.int32, mx.uint32, mx.int64, mx.uint64, mx.int16, mx.uint16,
                                       mx.int8, mx.uint8)):
        raise ValueError(f"ids must be integers, not {ids.dtype}")


def _check_rows(rows, n, w=None):
    """Exactly one of rows / n; n an integer in 0..len(w); rows int32/uint32: the kernel and its
    MLX twin then see the same valid request (a negative n meant all rows on one and 3 on the other)."""
    if (rows is None) == (n is None):
        raise ValueError("pass exactly one of rows (int32 indices) or n (use the first n rows)")
    if w is None:
        return
    if n is not None:
        try:
            ok = not isinstance(n, bool) and 0 <= operator.index(n) <= w.shape[0]
        except TypeError:
            ok = False
        if not ok:
            raise ValueError(f"n = {n!r}: must be an integer in 0..{w.shape[0]}")
    if rows is not None and rows.dtype not in (mx.int32, mx.uint32):
        # (rows' values are not checked here: that would evaluate them mid-graph on the hot path)
        raise ValueError(f"rows must be int32 or uint32 indices, not {rows.dtype}")


def gather_matvec(x, w, rows=None, n=None, scales=None, biases=None, group_size=64, bits=None):
    """y[..., i] = dot(W[rows[i]], x) (or W[:n]); x [..., K] -> y [..., len(rows) or n].

    W is half precision when bits is None, else MLX affine-quantized with scales/biases.
    The selected rows are read in place; the gather is never materialised on the kernel path.
    """
    _check_rows(rows, n, w)
    quant = bits is not None
    count = n if rows is None else rows.shape[0]
    if use_kernel(x) and (quant_ok(w, scales, biases, group_size, bits) if quant else w.dtype in HALF_DTYPES):
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
    _check_rows(rows, n, w)
    quant = bits is not None
    if use_kernel(h) and (quant_ok(w, scales, biases, group_size, bits) if quant else w.dtype in HALF_DTYPES):
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


def bank_ok(w, scales, biases, group_size, bits) -> bool:
    """True when the kernels read this bank of affine-quantized experts: w uint32 [slots, N,
    K * bits / 32], scales / biases [slots, N, K / group_size] in one float dtype."""
    return (bits in KERNEL_BITS and group_size in KERNEL_GROUP_SIZES and biases is not None
            and w.dtype == mx.uint32 and w.ndim == 3 and scales.dtype in FLOAT_DTYPES
            and biases.dtype == scales.dtype)


def experts_swiglu(x, slots, gate, up, down, group_size, bits, down_group_size, down_bits):
    """mlx-lm's SwitchGLU (SwiGLU) on a bank of experts: y[t, j] = down(silu(gate(x[t])) *
    up(x[t])) with the expert in bank slot slots[t, j]; x [T, D], slots int [T, k] -> y [T, k, D].

    gate / up / down: (w, scales, biases) banks [slots, rows, columns] (MLX affine; down in its own
    group size and bits). An extension built before this op runs the twin. The kernel is one primitive for all pairs (grouped by slot; a pair's
    result depends on the tokens its expert serves, not on the slot); MLX's twin is SwitchGLU's
    own gather_qmm calls.
    """
    if (use_kernel(x) and hasattr(_ext, "experts_swiglu") and x.ndim == 2 and bank_ok(*gate, group_size, bits) and bank_ok(*up, group_size, bits)
            and bank_ok(*down, down_group_size, down_bits)):
        return _ext.experts_swiglu(x, slots, (*gate, None), (*up, None), (*down, None), group_size, bits,
                                   down_group_size, down_bits, q8_activations=_q8x)
    xe = mx.expand_dims(x, (-2, -3))

    def project(v, bank, gs, b):
        return mx.gather_qmm(v, *bank, rhs_indices=slots, transpose=True, group_size=gs, bits=b)
    h = nn.silu(project(xe, gate, group_size, bits)) * project(xe, up, group_size, bits)
    return project(h, down, down_group_size, down_bits).squeeze(-2)


# ------------------------------------------------------------------------------------------------
# Layer ops

# The attention kernel keeps a [query heads per kv head * Lq, Lk] float32 score block per thread;
# above this many scores (16 MB) MLX's op runs instead.
MAX_ATTENTION_SCORES = 1 << 22


def _layer_kernel_ok(*arrays):
    if not kernels_active():
        say_fallback_once()
        return False
    return all(a.dtype in FLOAT_DTYPES for a in arrays)


def _norm_kernel_ok(x, *params):
    """Kernel norms take x [..., D] and optional float vectors (weight, bias)."""
    return _layer_kernel_ok(x) and x.ndim >= 1 and all(
        a is None or (a.dtype in FLOAT_DTYPES and a.ndim == 1) for a in params)


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


# ------------------------------------------------------------------------------------------------
# FFN activations: the one definition the kernels' MLX twins, the predictors and relu_llama share

ACTIVATIONS = {"silu": nn.silu, "gelu": nn.gelu, "gelu_approx": nn.gelu_approx, "relu": nn.relu}


def fatrelu(g, threshold):
    """FATReLU (Song et al. 2024): g where g > threshold, else 0."""
    return mx.where(g > threshold, g, mx.zeros_like(g))


def cats(a, threshold):
    """CATS (Lee et al. 2024) on a = silu(gate x): a where |a| > threshold, else 0."""
    return mx.where(mx.abs(a) > threshold, a, mx.zeros_like(a))


def activation_fn(name: str):
    """The elementwise activation called `name`: one of ACTIVATIONS, or "fatrelu:T" (FATReLU at
    threshold T, the relu_llama model's)."""
    if name in ACTIVATIONS:
        return ACTIVATIONS[name]
    kind, _, arg = str(name).partition(":")
    if kind == "fatrelu":
        t = float(arg)
        return lambda g: fatrelu(g, t)
    raise FlashError(f"unknown activation {name!r} (one of {', '.join(ACTIVATIONS)} or fatrelu:T)")


# ------------------------------------------------------------------------------------------------
# A flash layer's FFN on its current rows

SPARSE_FFN_ACTS = ("silu", "relu_gated", "relu", "product")


def _hidden(g, u, act, threshold):
    """h of one row set by MLX's ops (sparse_ffn's activations; g is None for "relu")."""
    if act == "relu":
        return fatrelu(u, threshold)
    if act == "relu_gated":
        return fatrelu(g, threshold) * u
    if act == "product":
        return cats(nn.silu(g) * u, threshold)
    return cats(nn.silu(g), threshold) * u


def sparse_ffn(x, sets, gate_values=None, act="silu", threshold=0.0, add=None):
    """A flash layer's FFN on the rows it holds: y = [add +] sum over the row sets of
    down_t[:n].T @ h, each part and partial sum rounded to y's dtype as `y = y + part` does.

    sets: (up, gate or None, down_t, n, ids or None) per row set: rows [R, K] of one half dtype,
    the first n used; a set without gate rows takes gate_values[..., ids] (ids: int32 [n] neuron
    ids, None: columns 0..n-1). act (g: the gate's output, u: up's, each rounded to y's dtype):
      "silu"        a = silu(g); h = a * u where |a| > threshold, else 0   (SwiGLU; CATS)
      "relu_gated"  h = g * u where g > threshold, else 0                  (ReLU, FATReLU)
      "relu"        h = u where u > threshold, else 0 (sets without gate rows, no gate_values)
      "product"     h = silu(g) * u where |h| > threshold, else 0              (relu_llama product)
    One kernel primitive on the CPU (a dozen MLX ops per row set otherwise; an extension built
    before this op runs them too); sets taking gate_values multiply only the rows some token
    activates (same result: the others add 0); x [..., K] -> [..., K].
    """
    if act not in SPARSE_FFN_ACTS:
        raise ValueError(f"act {act!r} is not one of {', '.join(SPARSE_FFN_ACTS)}")
    if use_kernel(x) and hasattr(_ext, "sparse_ffn") and all(s[0].dtype in HALF_DTYPES for s in sets):
        return _ext.sparse_ffn(x, [(u, g, d, int(n), i) for u, g, d, n, i in sets], gate_values,
                               SPARSE_FFN_ACTS.index(act), float(threshold), add)
    return sparse_ffn_ops(x, sets, gate_values, act, threshold, add)


# The counters of a sparse_decode call (kernels/sparse_decode.h, DecodeCounter), in order.
DECODE_COUNTERS = ("needed", "hits", "loaded", "bytes", "reads", "io_ns", "mem_ns", "call_ns", "window",
                   "fill_copied", "overflow", "ahead_read", "ahead_taken", "ahead_used", "ahead_copied")


def decode_kernel_enabled(environ=os.environ) -> bool:
    """Whether flash decode may run a sparse layer's token as one primitive (sparse_decode): the
    kernels have it (Linux AIO) and MLX_FLASH_DECODE_KERNEL is not 0 (0: the per-layer host path,
    for comparisons; same results)."""
    return hasattr(_ext, "sparse_decode_state") and environ.get("MLX_FLASH_DECODE_KERNEL", "1") != "0"


def sparse_decode_state(**kwargs):
    """A sparse layer's decode state for sparse_decode (kernels/sparse_decode.h; decode_bind.cpp
    names the arguments: the neuron cache's arrays, the streaming buffer's rows, the bundle file's
    read arguments). The arrays must outlive every call made with it."""
    return _ext.sparse_decode_state(**kwargs)


def sparse_decode_lookahead(ctx: int, staging, rows_a, rows_b):
    """The decode primitives' lookahead (kernels/sparse_decode.h, Lookahead): an AIO context and a
    staging buffer of its own, two buffers of rows (each component's uint8 [rows, bytes]) the
    next layer's predicted neurons land in. Given to sparse_decode_state(lookahead=...)."""
    return _ext.sparse_decode_lookahead(ctx, staging, rows_a, rows_b)


def sparse_decode_drain(lookahead) -> None:
    """Wait for the lookahead's read in flight, if any (before its buffers or files go)."""
    _ext.sparse_decode_drain(lookahead)


def sparse_decode(x, gate_values, mask, state, cache, buf, roles, act, threshold, step, ahead_mask=None, next_state=None):
    """(y, counters) of one token's step of a sparse layer as one CPU primitive: its neuron cache
    updated for the neurons of `mask` (bool [N]) at `step`, those it lacks read, and y as
    sparse_ffn computes it over the cached rows, then the streamed ones (bit for bit
    FlashFFN's per-layer path). cache / buf: the cache's and the streaming buffer's component
    arrays in the state's order; roles: (up, gate or -1, down_t) indices into them; act as
    sparse_ffn's. ahead_mask (bool [N of the next sparse layer]) with next_state (its state, the
    same lookahead): those neurons the next layer's cache lacks start landing in the lookahead's
    buffer once this layer's reads are in, and the next layer's call takes them from there.
    counters: int64 [len(DECODE_COUNTERS)]. No twin: the per-layer path is it."""
    return _ext.sparse_decode(x, gate_values, mask, state, cache, buf, list(roles), SPARSE_FFN_ACTS.index(act),
                              float(threshold), int(step), ahead_mask, next_state)


def sparse_ffn_ops(x, sets, gate_values=None, act="silu", threshold=0.0, add=None):
    """sparse_ffn's twin: the row projections' ops one by one (gather_matvec / _t, MLX's
    elementwise ops), as FlashFFN's MLP computes it."""
    y = add
    for up, gate, down, n, ids in sets:
        u = gather_matvec(x, up, n=n)
        g = None
        if act != "relu":
            if gate is not None:
                g = gather_matvec(x, gate, n=n)
            else:
                g = gate_values[..., :n] if ids is None else mx.take(gate_values, ids, axis=-1)
        part = gather_matvec_t(_hidden(g, u, act, threshold), down, n=n)
        y = part if y is None else y + part
    return y


def _mask_activation(activation: str):
    """(act code, act threshold) of active_mask for a predictor's activation name, or None."""
    if activation == "silu":
        return 0, 0.0
    if activation == "relu":
        return 1, 0.0
    kind, _, arg = str(activation).partition(":")
    return (1, float(arg)) if kind == "fatrelu" and arg else None


def mask_activation_ok(activation: str) -> bool:
    """True when active_mask computes this activation: "silu", "relu" or "fatrelu:T"."""
    return _mask_activation(activation) is not None


def active_mask(g, activation: str, threshold: float):
    """The neurons a gate-threshold predictor keeps, from the gate's output g [..., N]: bool [N],
    any over g's leading rows of |act(g)| > threshold (act: activation_fn's "silu", "relu" or
    "fatrelu:T"); thresholds compared in g's dtype. One kernel primitive on the CPU (MLX: the
    activation, abs, compare and any)."""
    code = _mask_activation(activation)
    if code is None:
        raise ValueError(f"activation {activation!r}: active_mask computes silu, relu or fatrelu:T")
    if use_kernel(g) and hasattr(_ext, "active_mask"):
        return _ext.active_mask(g, code[0], code[1], float(threshold))
    return (mx.abs(activation_fn(activation)(g)) > threshold).reshape(-1, g.shape[-1]).any(axis=0)
