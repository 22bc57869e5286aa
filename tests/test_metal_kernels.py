"""The sparse FFN Metal kernels (mlx_flash/metal/kernels.py) against numpy and their MLX-op twins.

On Linux the kernel sources run through the Metal emulator under each schedule (forward, reverse,
shuffled); on a Mac with Metal they run on the GPU. Seeded bugs (a missing barrier, an off-by-one
bound, a wrong index) show that these tests catch what they should.
"""

import mlx.core as mx
import numpy as np
import pytest

from metal_checks import (BACKENDS, as_f64, check_close, emulated, mutated, needs_backend, run_kernel,
                          schedules_caught, tolerance)

from mlx_flash.metal import emulator as em
from mlx_flash.metal import kernels as K

pytestmark = needs_backend

CAPACITY, HIDDEN, TOKENS = 70, 128, 8  # neuron-cache rows, model width, tokens per call
FORMATS = {  # name: (bits, group_size, dtype of weights or scales)
    "q4g32": (4, 32, mx.float16), "q4g64": (4, 64, mx.float16), "q4g128": (4, 128, mx.bfloat16),
    "q8g32": (8, 32, mx.float16), "q8g64": (8, 64, mx.bfloat16), "q8g128": (8, 128, mx.float16),
    "f16": (None, 64, mx.float16), "bf16": (None, 64, mx.bfloat16),
}
IDS = np.array([69, 3, 3, 40, 0, 12, 68, 25, 7, 33, 51], np.int32)  # unsorted, a duplicate, both ends
SELECTIONS = {"n=37": dict(n=37), "ids": dict(rows=IDS)}
EDGE_SELECTIONS = {"n=0": dict(n=0), "n=1": dict(n=1), "n=all": dict(n=CAPACITY),
                   "3 ids": dict(rows=IDS[:3])}


def make_weights(fmt, seed, columns=HIDDEN, bias=False, rows=CAPACITY):
    """(Weights, float64 numpy matrix it stands for)."""
    bits, group_size, dtype = FORMATS[fmt]
    w = (mx.random.normal((rows, columns), key=mx.random.key(seed)) * 0.2).astype(dtype)
    b = (mx.random.normal((rows,), key=mx.random.key(seed + 100)) * 0.3).astype(dtype) if bias else None
    if bits is None:
        return K.Weights(w, bias=b), np.array(w.astype(mx.float32), np.float64)
    q, s, z = mx.quantize(w, group_size=group_size, bits=bits)
    # float32 scales: the weights exactly as scale * q + bias (not rounded to 16 bits)
    dense = mx.dequantize(q, s.astype(mx.float32), z.astype(mx.float32), group_size=group_size, bits=bits)
    return K.Weights(q, s, z, bias=b, bits=bits, group_size=group_size), np.array(dense, np.float64)


def rows_of(sel):
    return np.arange(sel["n"]) if "n" in sel else sel["rows"]


def mx_sel(sel):
    return {k: (mx.array(v) if k == "rows" else v) for k, v in sel.items()}


def up_case(fmt, act, sel, tokens=TOKENS, bias=False):
    """Inputs and the float64 reference of one sparse_up call: (x, up, gate, threshold, h_ref, near)."""
    dtype = FORMATS[fmt][2]
    x = (mx.random.normal((tokens, HIDDEN), key=mx.random.key(5))).astype(dtype)
    up, up64 = make_weights(fmt, 1, bias=bias)
    gate, gate64 = make_weights(fmt, 2, bias=bias)
    x64, r = as_f64(x), rows_of(sel)
    u = x64 @ up64[r].T + (as_f64(up.bias)[r] if bias else 0)
    if act in ("silu", "relu_gated"):
        g = x64 @ gate64[r].T + (as_f64(gate.bias)[r] if bias else 0)
        a = g / (1 + np.exp(-g)) if act == "silu" else np.maximum(g, 0)
        threshold = float(np.quantile(np.abs(a), 0.4 if act == "silu" else 0.7)) if a.size else 0.1
        h = np.where(np.abs(a) > threshold, a * u, 0)
        margin = np.abs(np.abs(a) - threshold)
    else:
        a = np.maximum(u, 0)
        threshold = float(np.quantile(a, 0.6)) if a.size else 0.1
        h = np.where(a > threshold, a, 0)
        margin = np.abs(a - threshold)
    # 16-bit rounding (of the output, or of everything in the twin) may put these on either side
    near = margin < 4 * tolerance(dtype) * max(1.0, float(np.abs(a).max()) if a.size else 1.0)
    return x, up, gate, threshold, h, near


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sel", list(SELECTIONS), ids=list(SELECTIONS))
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_sparse_up_gated(fmt, sel, backend):
    x, up, gate, t, h_ref, near = up_case(fmt, "silu", SELECTIONS[sel])
    kw = dict(threshold=t, act="silu", **mx_sel(SELECTIONS[sel]))
    h = run_kernel(K.sparse_up_metal, backend, x, up, gate, **kw)
    assert h.dtype == x.dtype
    check_close(h, h_ref, x.dtype, skip=near)
    check_close(K.sparse_up_twin(x, up, gate, **kw), as_f64(h), x.dtype, skip=near, scale=8)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sel", list(SELECTIONS), ids=list(SELECTIONS))
@pytest.mark.parametrize("fmt", ["q8g32", "bf16"])
def test_sparse_up_gated_relu(fmt, sel, backend):
    """relu_llama's FFN: relu(gate x) * up x, the threshold acting as FATReLU's."""
    x, up, gate, t, h_ref, near = up_case(fmt, "relu_gated", SELECTIONS[sel])
    kw = dict(threshold=t, act="relu_gated", **mx_sel(SELECTIONS[sel]))
    h = run_kernel(K.sparse_up_metal, backend, x, up, gate, **kw)
    assert t > 0 and (as_f64(h) == 0).mean() > 0.5  # the threshold masks more than ReLU alone
    check_close(h, h_ref, x.dtype, skip=near)
    check_close(K.sparse_up_twin(x, up, gate, **kw), as_f64(h), x.dtype, skip=near, scale=8)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sel", list(SELECTIONS), ids=list(SELECTIONS))
@pytest.mark.parametrize("fmt", ["q4g64", "f16"])
def test_sparse_up_relu_with_bias(fmt, sel, backend):
    """OPT's FFN: ReLU without a gate, fc1 with a bias."""
    x, up, _, t, h_ref, near = up_case(fmt, "relu", SELECTIONS[sel], bias=True)
    kw = dict(threshold=t, act="relu", **mx_sel(SELECTIONS[sel]))
    h = run_kernel(K.sparse_up_metal, backend, x, up, None, **kw)
    check_close(h, h_ref, x.dtype, skip=near)
    check_close(K.sparse_up_twin(x, up, None, **kw), as_f64(h), x.dtype, skip=near, scale=8)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sel", list(SELECTIONS), ids=list(SELECTIONS))
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_sparse_down(fmt, sel, backend):
    dtype = FORMATS[fmt][2]
    _, _, _, _, h_ref, _ = up_case(fmt, "silu", SELECTIONS[sel])
    h = mx.array(h_ref.astype(np.float32)).astype(dtype)  # thresholded: some exact zeros
    down, down64 = make_weights(fmt, 3, columns=HIDDEN * 2)
    kw = mx_sel(SELECTIONS[sel])
    y = run_kernel(K.sparse_down_metal, backend, h, down, **kw)
    y_ref = as_f64(h) @ down64[rows_of(SELECTIONS[sel])]
    check_close(y, y_ref, dtype)
    check_close(K.sparse_down_twin(h, down, **kw), as_f64(y), dtype, scale=8)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("select", ["n", "ids"])
@pytest.mark.parametrize("fmt", ["q8g64", "f16"])
def test_sparse_down_row_splits(fmt, select, backend):
    """Enough rows that sparse_down cuts them into several splits (threadgroups along z)."""
    rows = 600
    dtype = FORMATS[fmt][2]
    down, down64 = make_weights(fmt, 3, columns=HIDDEN * 2, rows=rows)
    ids = np.sort(np.random.default_rng(2).choice(rows, 450, replace=False)).astype(np.int32)
    sel = dict(n=rows) if select == "n" else dict(rows=ids)
    count = rows if select == "n" else len(ids)
    assert K.down_splits(count, 2) > 4
    h = mx.random.normal((2, count), key=mx.random.key(9)).astype(dtype)
    y = run_kernel(K.sparse_down_metal, backend, h, down, **mx_sel(sel))
    check_close(y, as_f64(h) @ down64[rows_of(sel)], dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sel", list(EDGE_SELECTIONS), ids=list(EDGE_SELECTIONS))
@pytest.mark.parametrize("fmt", ["q4g64", "bf16"])
def test_edge_row_counts(fmt, sel, backend):
    """n = 0, 1, every row, and fewer ids than MLX's constant-buffer size; up then down."""
    s = EDGE_SELECTIONS[sel]
    x, up, gate, t, h_ref, near = up_case(fmt, "silu", s, tokens=1)
    kw = dict(threshold=t, act="silu", **mx_sel(s))
    h = run_kernel(K.sparse_up_metal, backend, x, up, gate, **kw)
    check_close(h, h_ref, x.dtype, skip=near)
    down, down64 = make_weights(fmt, 3, columns=HIDDEN)
    y = run_kernel(K.sparse_down_metal, backend, h, down, **mx_sel(s))
    check_close(y, as_f64(h) @ down64[rows_of(s)], x.dtype)
    assert y.shape == (1, HIDDEN)


def test_dispatch_runs_the_twin_off_the_gpu():
    """Off the GPU (or with MLX_FLASH_KERNELS=0) the dispatchers are the twins."""
    x, up, gate, t, _, _ = up_case("q4g64", "silu", dict(n=37))
    device = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        assert not K.metal_active()
        h = K.sparse_up(x, up, gate, n=37, threshold=t)
        assert mx.array_equal(h, K.sparse_up_twin(x, up, gate, n=37, threshold=t))
        y = K.sparse_down(h, up, n=37)
        assert mx.array_equal(y, K.sparse_down_twin(h, up, n=37))
    finally:
        mx.set_default_device(device)
    try:
        K.set_enabled(False)
        assert not K.metal_active()
    finally:
        K.set_enabled(True)
    with pytest.raises(ValueError, match="exactly one of rows"):
        K.sparse_up(x, up, gate, n=3, rows=mx.array([1]))


# ------------------------------------------------------------------------------------------------
# Seeded bugs: each mutation of a kernel source must fail the checks above


@emulated
def test_seeded_missing_barrier_in_sparse_down_is_caught():
    h = mx.array(np.linspace(-1, 1, CAPACITY * TOKENS).reshape(TOKENS, CAPACITY).astype(np.float32)).astype(
        mx.float16)
    down, down64 = make_weights("q4g64", 3, columns=HIDDEN * 2)
    y_ref = as_f64(h) @ down64
    factory = mutated("metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);", "")
    assert schedules_caught(lambda schedule: K.sparse_down_metal(h, down, n=CAPACITY, metal_kernel=factory,
                                                                schedule=schedule), y_ref, mx.float16) > 0


@emulated
def test_seeded_off_by_one_in_sparse_up_hits_the_guard_page():
    x, up, gate, t, _, _ = up_case("q4g64", "silu", dict(n=CAPACITY))
    factory = mutated("for (uint i = lane; i < words; i += 32)", "for (uint i = lane; i <= words; i += 32)",
                      where="header")
    with pytest.raises(em.KernelFault, match=r"out-of-bounds read: .* buffer `(up|gate)_w`"):
        K.sparse_up_metal(x, up, gate, n=CAPACITY, threshold=t, metal_kernel=factory)


@emulated
def test_seeded_wrong_index_in_sparse_up_is_caught():
    sel = SELECTIONS["ids"]
    x, up, gate, t, h_ref, near = up_case("q4g64", "silu", sel)
    factory = mutated("uint r = use_ids ? uint(ids[j]) : j;", "uint r = j;")
    h = K.sparse_up_metal(x, up, gate, threshold=t, metal_kernel=factory, schedule="forward", **mx_sel(sel))
    with pytest.raises(AssertionError, match="max error"):
        check_close(h, h_ref, x.dtype, skip=near)
