"""The ENDOR decode-matvec Metal kernels (mlx_flash/metal/endor.py) against numpy and their MLX-op twin.

Bundles are encoded by mlx_flash/pack/bitmap.py (the format) and the reference decodes them with its
numpy decoder. On Linux the kernels run through the Metal emulator under each schedule; on a Mac
with Metal they run on the GPU. Seeded bugs (an inclusive prefix sum where the exclusive one
belongs, a missing barrier, a bitmap bound off by one) show that the checks catch them.
"""

import mlx.core as mx
import numpy as np
import pytest

from metal_checks import BACKENDS, as_f64, check_close, emulated, mutated, needs_backend, schedules_caught
from metal_checks import run_kernel as run

from mlx_flash.errors import FlashError
from mlx_flash.metal import emulator as em
from mlx_flash.metal import endor as E
from mlx_flash.pack import bitmap as B

pytestmark = needs_backend

COUNT, HIDDEN, DOWN, TOKENS = 37, 100, 1100, 3  # neurons, x width (not a multiple of 32), two down chunks
PAYLOADS = {
    "f16": {"dtype": "float16"}, "bf16": {"dtype": "bfloat16"}, "f32": {"dtype": "float32"},
    "q4g32": {"bits": 4, "group_size": 32}, "q4g128": {"bits": 4, "group_size": 128},
    "q8g64": {"bits": 8, "group_size": 64},
}
NP_DTYPES = {"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32}


def pruned(rows, columns, seed, payload):
    """numpy [rows, columns] with about half exact zeros; row 0 all zero, row 1 dense."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(rows, columns)).astype(np.float32) * 0.3
    w[rng.random((rows, columns)) < 0.5] = 0
    w[0] = 0
    w[1] = rng.normal(size=columns) * 0.3 + 1.0
    dtype = payload.get("dtype", "float16")
    if dtype == "bfloat16":
        return (mx.array(w).astype(mx.bfloat16).view(mx.uint16)).__array__()
    return w.astype(NP_DTYPES[dtype])


def bundles(payload, gated=True, count=COUNT, seed=0):
    """(enc uint32 mx.array, byte offsets [count + 1], decoded float64 [gate, up, down] rows)."""
    mats = [pruned(count, HIDDEN, seed + 1, payload)] if gated else []
    mats += [pruned(count, HIDDEN, seed + 2, payload), pruned(count, DOWN, seed + 3, payload)]
    blocks = [np.concatenate([B.encode_row(m[j], payload) for m in mats]) for j in range(count)]
    offsets = np.concatenate([[0], np.cumsum([len(b) for b in blocks])]).astype(np.int64)
    flat = np.concatenate(blocks)
    dests = [np.zeros((count, m.shape[1] * (4 if m.dtype == np.float32 and not payload.get("bits") else 2)),
                      np.uint8) for m in mats]
    B.decode_bundles(flat, offsets[:-1], np.diff(offsets), np.arange(count),
                     [(d, m.shape[1], payload) for d, m in zip(dests, mats)])
    decoded = [as_f64(mx.array(d).view(E.decoded_dtype(payload))) for d in dests]
    return mx.array(flat.view(np.uint32)), offsets, decoded


def reference_h(x, decoded, act):
    """(h float64 [M, count], threshold, rows near the threshold) of the thresholded FFN."""
    x64 = as_f64(x)
    u = x64 @ decoded[-2].T
    if act == "relu":
        a = np.maximum(u, 0)
        t = float(np.quantile(a, 0.6))
        return np.where(a > t, a, 0), t, np.abs(a - t) < 1e-2 * max(1.0, np.abs(a).max())
    g = x64 @ decoded[0].T
    a = g / (1 + np.exp(-g)) if act == "silu" else np.maximum(g, 0)
    t = float(np.quantile(np.abs(a), 0.4 if act == "silu" else 0.7))
    return np.where(np.abs(a) > t, a * u, 0), t, np.abs(np.abs(a) - t) < 1e-2 * max(1.0, np.abs(a).max())


def x_for(payload):
    dtype = mx.bfloat16 if payload.get("dtype") == "bfloat16" else mx.float16
    return (mx.random.normal((TOKENS, HIDDEN), key=mx.random.key(5))).astype(dtype)


def down_prefix_of(enc, down_at):
    """numpy's down_prefix: values stored before each 1024-column chunk of each down block, then all."""
    raw = np.array(enc).view(np.uint8)
    bits = np.stack([np.unpackbits(raw[4 * a: 4 * a + B.bitmap_nbytes(DOWN)], bitorder="little", count=DOWN)
                     for a in down_at.tolist()]).astype(np.int64)
    edges = list(range(0, DOWN, E.DOWN_COLUMNS)) + [DOWN]
    return np.stack([bits[:, :e].sum(axis=1) for e in edges], axis=1)


def check_ffn(payload, act, backend):
    gated = act != "relu"
    enc, offsets, decoded = bundles(payload, gated)
    x = x_for(payload)
    bounds = E.word_bounds(offsets)
    h_ref, t, near = reference_h(x, decoded, act)
    kw = dict(columns=HIDDEN, down_columns=DOWN, payload=payload, act=act, threshold=t)
    h, down_at, prefix = run(E.endor_up_metal, backend, x, enc, bounds, **kw)
    out_dtype = h.dtype
    check_close(h, h_ref, out_dtype, skip=near)
    at = np.array(down_at)
    assert (at >= 0).all() and (at < offsets[1:] // 4).all() and (at > offsets[:-1] // 4).all()
    assert np.array_equal(np.array(prefix), down_prefix_of(enc, at))
    y = run(E.endor_down_metal, backend, h, enc, down_at, prefix, columns=DOWN, payload=payload)
    check_close(y, as_f64(h) @ decoded[-1], out_dtype)
    y_twin, ok = E.endor_ffn_twin(x, enc, bounds, **kw)
    assert np.array(ok).all()
    check_close(y_twin, h_ref @ decoded[-1], out_dtype, scale=8, skip=near.any(axis=1)[:, None].repeat(DOWN, 1))
    return h, y


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("payload", list(PAYLOADS))
def test_endor_ffn_gated_silu(payload, backend):
    h, _ = check_ffn(PAYLOADS[payload], "silu", backend)
    assert (as_f64(h) == 0).mean() > 0.3  # the threshold masks: down skips those rows


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("act", ["relu", "relu_gated"])
def test_endor_ffn_relu(act, backend):
    check_ffn(PAYLOADS["q8g64"] if act == "relu" else PAYLOADS["f16"], act, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_endor_bundles_that_disagree_with_their_bitmaps_are_flagged(backend):
    """Bitmap bits set where no values are stored, a bundle cut short, and bits set past the row's
    end (ignored, as the CPU decode ignores them): bad bundles give ok False and contribute 0,
    nothing is read outside a bundle (the emulator's guard pages would fault), the rest is exact."""
    payload = PAYLOADS["q4g32"]
    enc, offsets, decoded = bundles(payload)
    words = np.array(enc).copy()
    nbw = -(-HIDDEN // 32)
    words[offsets[5] // 4] = 0xFFFFFFFF  # about 16 more stored values than the bundle holds
    words[offsets[9] // 4 + nbw - 1] |= np.uint32(1 << 31)  # bit 127 of a 100-element row: padding
    last = offsets[-2]
    gate_nnz = int(np.unpackbits(words.view(np.uint8)[last: last + B.bitmap_nbytes(HIDDEN)]).sum())
    offsets = offsets.copy()
    offsets[-1] = last + B.block_nbytes(HIDDEN, gate_nnz, payload) + 16  # the last bundle cut inside its up block
    bounds = E.word_bounds(offsets)
    enc = mx.array(words[: offsets[-1] // 4])
    x = x_for(payload)
    h_ref, t, near = reference_h(x, decoded, "silu")
    kw = dict(columns=HIDDEN, down_columns=DOWN, payload=payload, act="silu", threshold=t)
    bad = np.zeros(COUNT, bool)
    bad[[5, COUNT - 1]] = True
    flat = words.view(np.uint8)
    for j in range(COUNT):  # the format's own decoder agrees on which bundles are bad
        dests = [(np.zeros((1, 2 * n), np.uint8), n, payload) for n in (HIDDEN, HIDDEN, DOWN)]
        try:
            B.decode_bundles(flat, offsets[j:j + 1], np.diff(offsets)[j:j + 1], [0], dests)
            assert not bad[j]
        except FlashError:
            assert bad[j]
    h, down_at, prefix = run(E.endor_up_metal, backend, x, enc, bounds, **kw)
    assert (np.array(down_at) < 0).tolist() == bad.tolist()
    h_ref[:, bad] = 0
    check_close(h, h_ref, h.dtype, skip=near)
    y = run(E.endor_down_metal, backend, h, enc, down_at, prefix, columns=DOWN, payload=payload)
    check_close(y, as_f64(h) @ decoded[-1], h.dtype)
    y_twin, ok = E.endor_ffn_twin(x, enc, bounds, **kw)
    assert (~np.array(ok)).tolist() == bad.tolist()
    check_close(y_twin, as_f64(y), h.dtype, scale=8)


def test_endor_ffn_runs_the_twin_off_the_gpu_and_checks_alignment():
    payload = PAYLOADS["f16"]
    enc, offsets, _ = bundles(payload, count=9)
    x = x_for(payload)
    kw = dict(columns=HIDDEN, down_columns=DOWN, payload=payload, threshold=0.1)
    device = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        y, ok = E.endor_ffn(x, enc, E.word_bounds(offsets), **kw)
        y_twin, _ = E.endor_ffn_twin(x, enc, E.word_bounds(offsets), **kw)
        assert mx.array_equal(y, y_twin) and np.array(ok).all()
    finally:
        mx.set_default_device(device)
    with pytest.raises(ValueError, match="4-byte boundaries"):
        E.word_bounds(offsets + 2)


# ------------------------------------------------------------------------------------------------
# Seeded bugs: each mutation of a kernel source must fail the checks above


def down_case(payload):
    """(enc, (down_at, down_prefix), h [TOKENS, COUNT] float16 with exact zeros, float64 y reference)."""
    enc, offsets, decoded = bundles(payload)
    h = mx.array(np.linspace(-1, 1, COUNT * TOKENS).reshape(TOKENS, COUNT).astype(np.float16))
    h = mx.where(mx.abs(h) < 0.2, mx.zeros((), h.dtype), h)
    _, down_at, prefix = E.endor_up_metal(x_for(payload), enc, E.word_bounds(offsets), columns=HIDDEN,
                                          down_columns=DOWN, payload=payload, metal_kernel=em.metal_kernel)
    return enc, (down_at, prefix), h, as_f64(h) @ decoded[-1]


@emulated
def test_seeded_inclusive_prefix_in_endor_up_is_caught():
    """Each lane's first stored value one word late (the inclusive sum): wrong h."""
    payload = PAYLOADS["q8g64"]
    enc, offsets, decoded = bundles(payload)
    x = x_for(payload)
    h_ref, t, near = reference_h(x, decoded, "silu")
    factory = mutated("uint v = done + metal::simd_prefix_exclusive_sum(pc);",
                      "uint v = done + metal::simd_prefix_inclusive_sum(pc);", where="header")
    h, _, _ = E.endor_up_metal(x, enc, E.word_bounds(offsets), columns=HIDDEN, down_columns=DOWN, payload=payload,
                               threshold=t, metal_kernel=factory, schedule="forward")
    with pytest.raises(AssertionError, match="max error"):
        check_close(h, h_ref, h.dtype, skip=near)


@emulated
def test_seeded_wrong_prefix_in_endor_down_is_caught():
    """The earlier chunks' values left out of a lane's first stored value: wrong y past column 1024."""
    payload = PAYLOADS["f16"]
    enc, down, h, y_ref = down_case(payload)
    factory = mutated("uint v = before + metal::simd_prefix_exclusive_sum", "uint v = metal::simd_prefix_exclusive_sum")
    y = E.endor_down_metal(h, enc, *down, columns=DOWN, payload=payload, metal_kernel=factory, schedule="forward")
    with pytest.raises(AssertionError, match="max error"):
        check_close(y, y_ref, mx.float16)


@emulated
def test_seeded_missing_barrier_in_endor_down_is_caught():
    payload = PAYLOADS["q4g128"]
    enc, down, h, y_ref = down_case(payload)
    factory = mutated("metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);", "")
    assert schedules_caught(lambda schedule: E.endor_down_metal(h, enc, *down, columns=DOWN, payload=payload,
                                                               metal_kernel=factory, schedule=schedule),
                            y_ref, mx.float16) > 0


@emulated
def test_seeded_off_by_one_bitmap_bound_in_endor_up_is_caught():
    """One bitmap word too many (<= for <): the payload's first word read as bitmap bits, its
    "columns" past the row's end (x of the next token, or past x: the guard page)."""
    payload = PAYLOADS["q8g64"]
    enc, offsets, decoded = bundles(payload)
    x = x_for(payload)
    _, t, _ = reference_h(x, decoded, "silu")
    factory = mutated("uint word = i < words ?", "uint word = i <= words ?", where="header")
    with pytest.raises(em.KernelFault, match="out-of-bounds read: .* buffer `x`"):
        E.endor_up_metal(x, enc, E.word_bounds(offsets), columns=HIDDEN, down_columns=DOWN, payload=payload,
                         threshold=t, metal_kernel=factory, schedule="forward")
