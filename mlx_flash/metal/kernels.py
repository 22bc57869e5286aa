"""Metal kernels of the sparse FFN (kernels/metal/*.metal) and their MLX-op twins.

    sparse_up(x, up, gate, n= | rows=, threshold, act)  h [..., count]: fused up/gate projection over
        the first n rows of a neuron cache or over gathered row ids, with the activation and the
        threshold mask (CATS): silu, relu_gated  h_j = act(gate_j x) * (up_j x)  where
                                                 |act(gate_j x)| > threshold
                               relu              h_j = relu(up_j x)  where relu(up_j x) > threshold
    sparse_down(h, down_t, n= | rows=)  y [..., D] = sum_j h_j * down_t[row j]: the down projection
        accumulated over the same rows (rows of the transposed down matrix); rows with h_j == 0 are
        not read.

Weights are MLX's own layouts (`Weights`): float16/bfloat16 [rows, K], or affine-quantized (4 or 8
bits, group size 32/64/128: w = scale * q + bias per group along K, uint32 words of little-endian
q values). `n` and `rows` are kernel inputs, not template arguments: a new row count or new ids
every token never recompiles and never copies the selected rows.

Dispatch: the Metal kernels when MLX runs on the GPU (default device gpu, Metal available), the
MLX-op twins otherwise (gather + matmul; they run everywhere); MLX_FLASH_KERNELS=0 selects the twins
everywhere. Passing `metal_kernel=` (e.g. mlx_flash.metal.emulator.metal_kernel) runs the kernel
sources through that factory instead: the tests run them on Linux through the emulator, with the
emulator's options (`schedule`, `seed`) passed through `run`.
"""

import math
import os
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

SOURCE_DIR = Path(__file__).resolve().parents[2] / "kernels" / "metal"
BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
HALF_DTYPES = (mx.float16, mx.bfloat16, mx.float32)
ACTS = ("silu", "relu", "relu_gated")  # gated SiLU (llama), ReLU without gate (OPT), gated ReLU (relu_llama)
GATED = ("silu", "relu_gated")
UP_ROWS_PER_THREADGROUP = 8  # SIMD groups (one output row each) per threadgroup of sparse_up
DOWN_SIMD_GROUPS = 8  # SIMD groups sharing the rows of sparse_down's threadgroup
DOWN_TARGET_THREADGROUPS = 128  # sparse_down splits its rows until the grid has about this many
MAX_METAL_TOKENS = 16  # more tokens than this: the twin (the kernels read the rows once per token)

_enabled = os.environ.get("MLX_FLASH_KERNELS", "1").strip() != "0"


@dataclass
class Weights:
    """One projection's rows: weight [rows, K] float16/bfloat16/float32 (bits None) or uint32
    [rows, K * bits / 32] with scales / biases [rows, K / group_size]; bias [rows] or None."""
    weight: mx.array
    scales: mx.array = None
    biases: mx.array = None
    bias: mx.array = None
    bits: int = None
    group_size: int = 64

    @property
    def columns(self) -> int:
        """K: values per row."""
        return self.weight.shape[1] * 32 // self.bits if self.bits else self.weight.shape[1]


def set_enabled(enabled: bool) -> None:
    """Metal kernels on/off process-wide (off: the twins everywhere). Initially MLX_FLASH_KERNELS != 0."""
    global _enabled
    _enabled = bool(enabled)


def metal_active() -> bool:
    """True when the dispatchers run the Metal kernels: enabled, default device GPU, Metal present."""
    return _enabled and mx.default_device() == mx.gpu and mx.metal.is_available()


def _read_source(name: str) -> str:
    return (SOURCE_DIR / name).read_text()


_kernels: dict = {}


def kernel(name: str, metal_kernel=None):
    """The kernel object of `name` ("sparse_up", "sparse_down", "endor_up", "endor_down") built by `metal_kernel`
    (default mx.fast.metal_kernel): built once per factory and cached."""
    factory = metal_kernel or mx.fast.metal_kernel
    key = (name, factory)
    if key not in _kernels:
        inputs = {
            "sparse_up": ["x", "up_w", "up_scales", "up_biases", "up_bias", "gate_w", "gate_scales",
                          "gate_biases", "gate_bias", "ids", "params", "thresh"],
            "sparse_down": ["h", "w", "scales", "biases", "ids", "params"],
            "endor_up": ["x", "enc", "bounds", "params", "thresh"],
            "endor_down": ["h", "enc", "down_at", "down_prefix", "params"],
        }[name]
        outputs = ["out", "down_at_out", "down_prefix_out"] if name == "endor_up" else ["out"]
        header = "endor_common.metal" if name.startswith("endor") else "sparse_common.metal"
        _kernels[key] = factory(name=f"mlx_flash_{name}", input_names=inputs, output_names=outputs,
                                source=_read_source(f"{name}.metal"), header=_read_source(header),
                                ensure_row_contiguous=True)
    return _kernels[key]


def _kernel_format_ok(w: Weights) -> bool:
    if w.bits is None:
        return w.weight.dtype in HALF_DTYPES and w.weight.ndim == 2
    return (w.bits in BITS and w.group_size in GROUP_SIZES and w.weight.dtype == mx.uint32 and w.weight.ndim == 2
            and w.scales is not None and w.biases is not None and w.scales.dtype == w.biases.dtype
            and w.scales.dtype in HALF_DTYPES and w.columns % w.group_size == 0)


def result_dtype(x_dtype, w: Weights):
    """MLX's promotion of the activations' dtype with the weights' (or scales') dtype."""
    other = w.scales.dtype if w.bits else w.weight.dtype
    return (mx.zeros((), x_dtype) + mx.zeros((), other)).dtype


def _count(rows, n) -> int:
    if (rows is None) == (n is None):
        raise ValueError("pass exactly one of rows (int32 row ids) or n (the first n rows)")
    return int(n) if rows is None else int(rows.shape[0])


def _select(a, rows, n):
    return a[:n] if rows is None else a[rows]


def _project_twin(x, w: Weights, rows, n):
    """x @ W[rows].T (+ bias[rows]) with MLX ops."""
    if w.bits:
        y = mx.quantized_matmul(x, _select(w.weight, rows, n), scales=_select(w.scales, rows, n),
                                biases=_select(w.biases, rows, n), transpose=True, group_size=w.group_size,
                                bits=w.bits)
    else:
        y = x @ _select(w.weight, rows, n).T
    return y if w.bias is None else y + _select(w.bias, rows, n)


def sparse_up_twin(x, up: Weights, gate: Weights | None, *, rows=None, n=None, threshold=0.0, act="silu"):
    """MLX-op twin of sparse_up (same arguments, same values up to float rounding)."""
    count = _count(rows, n)
    if count == 0:
        return mx.zeros((*x.shape[:-1], 0), result_dtype(x.dtype, up))
    u = _project_twin(x, up, rows, n)
    if act in GATED:
        g = _project_twin(x, gate, rows, n)
        a = _silu(g) if act == "silu" else mx.maximum(g, 0)
        return mx.where(mx.abs(a) > threshold, a * u, mx.zeros((), a.dtype))
    a = mx.maximum(u, 0)
    return mx.where(a > threshold, a, mx.zeros((), a.dtype))


def _silu(g):
    return g * mx.sigmoid(g)


def sparse_down_twin(h, down_t: Weights, *, rows=None, n=None):
    """MLX-op twin of sparse_down: h @ down_t[rows]."""
    count = _count(rows, n)
    if count == 0:
        return mx.zeros((*h.shape[:-1], down_t.columns), result_dtype(h.dtype, down_t))
    if down_t.bits:
        return mx.quantized_matmul(h, _select(down_t.weight, rows, n), scales=_select(down_t.scales, rows, n),
                                   biases=_select(down_t.biases, rows, n), transpose=False,
                                   group_size=down_t.group_size, bits=down_t.bits)
    return h @ _select(down_t.weight, rows, n)


# Placeholders and small parameter arrays have 8 elements: MLX passes an input of fewer elements in
# the `constant` address space, which makes a different kernel variant (a compile on first use).
SMALL = 8


def _dummy(dtype):
    return mx.zeros((SMALL,), dtype)


def _ids(rows):
    return mx.zeros((SMALL,), mx.int32) if rows is None else rows.astype(mx.int32)


def _params(*values):
    return mx.array(list(values) + [0] * (SMALL - len(values)), mx.int32)


def _quant_inputs(w: Weights, like: Weights):
    """weight, scales, biases, bias inputs (1-element placeholders where the format has none)."""
    sdtype = w.scales.dtype if w.bits else mx.float32
    return [w.weight, w.scales if w.bits else _dummy(sdtype), w.biases if w.bits else _dummy(sdtype),
            w.bias if w.bias is not None else _dummy(mx.float32 if like.bias is None else like.bias.dtype)]


def sparse_up_metal(x, up: Weights, gate: Weights | None, *, rows=None, n=None, threshold=0.0, act="silu",
                    metal_kernel=None, **run):
    """sparse_up on the Metal kernel (or through `metal_kernel`, e.g. the emulator, with `run` options)."""
    count = _count(rows, n)
    K = up.columns
    out_dtype = result_dtype(x.dtype, up)
    lead = x.shape[:-1]
    if count == 0:
        return mx.zeros((*lead, 0), out_dtype)
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    gated = act in GATED
    if gated and (gate is None or (gate.bias is None) != (up.bias is None)
                  or (gate.bits, gate.group_size, gate.weight.dtype) != (up.bits, up.group_size, up.weight.dtype)):
        raise ValueError(f"sparse_up: act {act!r} needs a gate in up's format (bits, group size, dtype, bias)")
    g = gate if gated else up  # ReLU: the gate inputs repeat up's (never read)
    inputs = ([x2] + _quant_inputs(up, g) + _quant_inputs(g, up)
              + [_ids(rows), _params(count, int(rows is not None), K, up.group_size if up.bits else 0),
                 mx.full((SMALL,), threshold, mx.float32)])
    out = kernel("sparse_up", metal_kernel)(
        inputs=inputs, template=[("T", out_dtype), ("BITS", up.bits or 0), ("ACT", ACTS.index(act)),
                                 ("HAS_BIAS", up.bias is not None)],
        grid=(32 * count, M, 1), threadgroup=(32 * UP_ROWS_PER_THREADGROUP, 1, 1),
        output_shapes=[(M, count)], output_dtypes=[out_dtype], **run)[0]
    return out.reshape(*lead, count)


def down_splits(count: int, column_groups: int) -> int:
    """Row splits of sparse_down: enough threadgroups (DOWN_TARGET_THREADGROUPS) to fill the GPU,
    with at least 4 rows per SIMD group in each split."""
    want = -(-DOWN_TARGET_THREADGROUPS // max(1, column_groups))
    return max(1, min(want, count // (4 * DOWN_SIMD_GROUPS), 64))


def sparse_down_metal(h, down_t: Weights, *, rows=None, n=None, metal_kernel=None, **run):
    """sparse_down on the Metal kernel (or through `metal_kernel`, with `run` options)."""
    count = _count(rows, n)
    D = down_t.columns
    out_dtype = result_dtype(h.dtype, down_t)
    lead = h.shape[:-1]
    M = math.prod(lead)
    h2 = h.reshape(M, count) if count else mx.zeros((M, SMALL), h.dtype)  # count 0 reads no h
    per_lane = 8 if down_t.bits == 4 else 4
    column_groups = -(-D // (32 * per_lane))
    splits = down_splits(count, column_groups)
    sdtype = down_t.scales.dtype if down_t.bits else mx.float32
    inputs = [h2, down_t.weight, down_t.scales if down_t.bits else _dummy(sdtype),
              down_t.biases if down_t.bits else _dummy(sdtype), _ids(rows),
              _params(count, int(rows is not None), D, down_t.group_size if down_t.bits else 0, splits)]
    partial = kernel("sparse_down", metal_kernel)(
        inputs=inputs, template=[("BITS", down_t.bits or 0), ("NSG", DOWN_SIMD_GROUPS)],
        grid=(32 * column_groups, DOWN_SIMD_GROUPS, M * splits), threadgroup=(32, DOWN_SIMD_GROUPS, 1),
        output_shapes=[(M, splits, D)], output_dtypes=[mx.float32], **run)[0]
    return partial.sum(axis=1).astype(out_dtype).reshape(*lead, D)


def _metal_serves(x, *weights) -> bool:
    return (metal_active() and x.dtype in HALF_DTYPES and x.ndim >= 1
            and x.size // max(1, x.shape[-1]) <= MAX_METAL_TOKENS and all(_kernel_format_ok(w) for w in weights))


def sparse_up(x, up: Weights, gate: Weights | None = None, *, rows=None, n=None, threshold=0.0, act="silu"):
    """h [..., count] for x [..., K] (see the module docstring): the Metal kernel on the GPU, else the twin."""
    if act not in ACTS:
        raise ValueError(f"act {act!r}: expected one of {ACTS}")
    weights = (up,) if act == "relu" else (up, gate)
    if _metal_serves(x, *weights) and (act == "relu" or ((gate.bits, gate.group_size, gate.weight.dtype)
                                       == (up.bits, up.group_size, up.weight.dtype)
                                       and (gate.bias is None) == (up.bias is None))):
        return sparse_up_metal(x, up, gate, rows=rows, n=n, threshold=threshold, act=act)
    return sparse_up_twin(x, up, gate, rows=rows, n=n, threshold=threshold, act=act)


def sparse_down(h, down_t: Weights, *, rows=None, n=None):
    """y [..., D] = h @ down_t[rows] (or [:n]): the Metal kernel on the GPU, else the twin."""
    if _metal_serves(h, down_t):
        return sparse_down_metal(h, down_t, rows=rows, n=n)
    return sparse_down_twin(h, down_t, rows=rows, n=n)
