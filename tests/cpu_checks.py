"""Shared checks for the CPU kernel tests (test_cpu_ops, test_cpu_fused, test_cpu_patch).

Tolerance. Kernels and references both sum float32 products, in different orders. A float32 sum of
n products, each formed with at most c roundings, is off by at most gamma_{n+c} * sum |terms|,
gamma_j = j*u/(1-j*u), u = 2^-24 (Higham, Accuracy and Stability, 3.1). Two such sums (ours, the
reference) differ by at most twice that; `_bound` computes it from a magnitude matrix A (|W| for half
weights; |s|*q + |b| for quantized ones, since kernels form s*(q.x) + b*sum(x) or (h*s)*q + h*b, whose
terms can be larger than the dequantized value s*q + b) and c = 4. The references dequantise with
float32 copies of the scales/biases, so s*q + b is itself float32 math as in the kernels. When the
output is half precision each side rounds once more: one ulp of |y| (2^-10 float16, 2^-7 bfloat16),
and near zero the float16 subnormal spacing 2^-24. Keeping sums short (K <= 384) keeps the bound far
below the error of a single wrong element or group.
"""

import mlx.core as mx
import numpy as np
import pytest

from mlx_flash.cpu import ops


needs_ext = pytest.mark.skipif(
    not ops.EXTENSION_AVAILABLE,
    reason=f"mlx_flash._ext not available ({ops.EXTENSION_ERROR}); kernel-specific check",
)

U = 2.0**-24
HALF_ULP = {mx.float32: 0.0, mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7}
HALF_TINY = 2.0**-24  # float16 subnormal spacing: the absolute rounding floor near zero


@pytest.fixture(autouse=True)
def _cpu_and_enabled():
    mx.set_default_device(mx.cpu)
    ops.set_kernels_enabled(True)
    yield
    ops.set_kernels_enabled(True)
    if ops.EXTENSION_AVAILABLE:
        ops._ext.set_simd(True)


@pytest.fixture(params=["simd", "scalar"])
def path(request):
    """Run kernel checks on the AVX2 path and on the portable scalar path."""
    if ops.EXTENSION_AVAILABLE:
        ops._ext.set_simd(request.param == "simd")
    return request.param


def _f32(a):
    return np.array(a.astype(mx.float32))


def _gamma(n):
    j = n + 4
    return j * U / (1 - j * U)


def _bound(mag_w, x, k, out_dtype, ref):
    """Allowed |ours - ref| for y = x @ W.T: 2*gamma_{K+4} * |x| @ A.T plus output rounding."""
    mag = np.abs(_f32(x)).reshape(-1, k) @ np.abs(mag_w).T
    return 2 * _gamma(k) * mag.reshape(ref.shape) + HALF_ULP[out_dtype] * np.abs(ref) + HALF_TINY


def _bound_t(h, mag_w, out_dtype, ref):
    """Allowed |ours - ref| for y = h @ W[sel] (A = magnitudes of W[sel])."""
    n = mag_w.shape[0]
    mag = np.abs(_f32(h)) @ np.abs(mag_w)
    return 2 * _gamma(n) * mag + HALF_ULP[out_dtype] * np.abs(ref) + HALF_TINY


def _assert_close(y, ref, bound):
    y, ref = _f32(y), np.asarray(ref)
    assert y.shape == ref.shape
    err = np.abs(y - ref)
    worst = np.unravel_index(np.argmax(err - bound), err.shape) if err.size else None
    assert np.all(err <= bound), f"max excess at {worst}: err={err[worst]} bound={bound[worst]}"


def _quantized(n, k, bits, group, sdtype, seed=0):
    mx.random.seed(seed)
    w = mx.random.normal((n, k)).astype(sdtype)
    wq, s, b = mx.quantize(w, group_size=group, bits=bits)
    s32, b32 = s.astype(mx.float32), b.astype(mx.float32)
    deq = _f32(mx.dequantize(wq, s32, b32, group_size=group, bits=bits))
    mag = _f32(mx.dequantize(wq, mx.abs(s32), mx.abs(b32), group_size=group, bits=bits))
    return wq, s, b, deq, mag


def _x(shape, dtype, seed=1):
    mx.random.seed(seed)
    return mx.random.normal(shape).astype(dtype)


# Tiny llamas of each weight kind the kernels serve (the bf16 one with an untied lm_head).
TINY_LLAMA_VARIANTS = pytest.mark.parametrize(
    "variant",
    [dict(quantize=(4, 32)), dict(quantize=(8, 64), intermediate=128), dict(dtype="float16"),
     dict(dtype="bfloat16", tie=False)],
    ids=["q4g32", "q8g64", "f16", "bf16-untied"],
)
