"""mlx_flash.cpu.ops: CPU kernels vs MLX's own ops, and the MLX-op fallback (tolerances: cpu_checks.py)."""

import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from cpu_checks import HALF_TINY, HALF_ULP, U, _assert_close, _bound, _bound_t, _f32, _quantized, _x, needs_ext
from cpu_checks import _cpu_and_enabled, path  # noqa: F401  (pytest fixtures)

from mlx_flash.cpu import ops


# ------------------------------------------------------------------------------------------------
# Kernel exactness


@needs_ext
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("xdtype", [mx.float32, mx.float16, mx.bfloat16])
def test_quantized_matvec_exact(path, bits, group, xdtype):
    k = 384
    sdtype = {mx.float32: mx.float16, mx.float16: mx.bfloat16, mx.bfloat16: mx.float32}[xdtype]
    for n in (1, 37):
        wq, s, b, deq, mag = _quantized(n, k, bits, group, sdtype, seed=n)
        for m in (1, 2, 3, 5, 8, 13):  # from 6 rows: the tile kernel (13: a partial tile of x rows)
            x = _x((m, k), xdtype, seed=m)
            y = ops._ext.quantized_matvec(x, wq, s, b, group, bits)
            out_dtype = ops.result_dtype(xdtype, sdtype)
            assert y.dtype == out_dtype
            ref = _f32(x) @ deq.T
            _assert_close(y, ref, _bound(mag, x, k, out_dtype, ref))
            if xdtype == mx.float32 and sdtype != mx.bfloat16:  # MLX's own op, same float32 math
                mlx_ref = _f32(mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=group, bits=bits))
                _assert_close(y, mlx_ref, _bound(mag, x, k, out_dtype, mlx_ref) * 2)


@pytest.fixture(params=ops.KERNEL_ISAS)
def each_isa(request):
    """Every instruction set this CPU runs, one at a time (others skip); the best one again after."""
    isa = request.param
    if ops.KERNEL_ISAS.index(isa) > ops.KERNEL_ISAS.index(ops._ext.best_isa()):
        pytest.skip(f"this CPU has no {isa}")
    ops._ext.set_isa(isa)
    yield isa
    ops._ext.set_isa(ops._ext.best_isa())


@needs_ext
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("sdtype", [mx.float16, mx.bfloat16, mx.float32])
def test_decode_matvec_on_each_isa(each_isa, bits, group, sdtype):
    # The one-row loops (fewer than 6 x rows) of every kernel ISA: on AVX-512 CPUs the avx512 kernel.
    # K: an odd number of 32-blocks and of groups (the 4-bit loop takes blocks in pairs), an even
    # one, and (group 32) 257 groups, past the 256 a row's converted scales are taken in. x rows:
    # 1, 4 (one register block) and 5 (4 + 1). Rows: dense, a prefix, gathered with repeats, and
    # -1 / N (NaN in their columns only).
    assert ops._ext.isa() == each_isa
    n = 23
    for k in {group * 3, 384, 32 * 257 if group == 32 else 384}:
        wq, s, b, deq, mag = _quantized(n, k, bits, group, sdtype, seed=k)
        for m in (1, 4, 5):
            x = _x((m, k), mx.float32, seed=m)
            ref = _f32(x) @ deq.T
            y = ops._ext.quantized_matvec(x, wq, s, b, group, bits)
            _assert_close(y, ref, _bound(mag, x, k, y.dtype, ref))
            y = ops._ext.gather_matvec(x, wq, s, b, None, 7, group, bits)
            _assert_close(y, ref[:, :7], _bound(mag[:7], x, k, y.dtype, ref[:, :7]))
            sel = np.array([22, 0, 5, 5, -1, 3, n, 21])
            y = ops._ext.gather_matvec(x, wq, s, b, mx.array(sel.astype(np.int32)), None, group, bits)
            ok = (sel >= 0) & (sel < n)
            assert np.all(np.isnan(np.array(y)[:, ~ok]))
            good = y[:, mx.array(np.flatnonzero(ok))]
            _assert_close(good, ref[:, sel[ok]], _bound(mag[sel[ok]], x, k, good.dtype, ref[:, sel[ok]]))


@needs_ext
@pytest.mark.parametrize("kind", ["q4g128", "q8g32", "bf16"])
def test_tiles_span_blocks_of_x_rows(kind):
    # K = 4096: the tile kernel takes 12 x rows per block (about 192 KiB of x), so 40 rows span four
    # blocks, the last partial. 50 weight rows: 4 chunks of 13 rows for the two threads, each ending
    # in a partial panel whose padding must not be stored over the next chunk's rows (a race, so
    # several calls).
    k, n, m = 4096, 50, 40
    w, s, b, bits, group, deq, mag = _weights(kind, n, k)
    x = _x((m, k), mx.float16, seed=9)
    ref = _f32(x) @ deq.T
    for _ in range(6):
        y = ops._ext.half_matvec(x, w) if bits is None else ops._ext.quantized_matvec(x, w, s, b, group, bits)
        _assert_close(y, ref, _bound(mag, x, k, y.dtype, ref))


@needs_ext
@pytest.mark.parametrize("wdtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("xdtype", [mx.float32, mx.float16, mx.bfloat16])
def test_half_matvec_exact(path, wdtype, xdtype):
    for k in (1, 7, 16, 37, 296, 300):  # K a multiple of 8 from 6 x rows: the tile kernel
        for n in (1, 33):
            w = _x((n, k), wdtype, seed=k + n)
            wf = _f32(w)
            for m in (1, 4, 6, 8, 11):
                x = _x((m, k), xdtype, seed=m)
                y = ops._ext.half_matvec(x, w)
                out_dtype = ops.result_dtype(xdtype, wdtype)
                ref = _f32(x) @ wf.T
                _assert_close(y, ref, _bound(wf, x, k, out_dtype, ref))
                mlx_ref = _f32(x.astype(mx.float32) @ w.astype(mx.float32).T)
                _assert_close(y, mlx_ref, _bound(wf, x, k, out_dtype, mlx_ref) * 2)


def _weights(kind, n, k, seed=0):
    """(w, scales, biases, bits, group, float32 W, magnitudes A) for one weight kind."""
    if kind == "f16" or kind == "bf16":
        w = _x((n, k), mx.float16 if kind == "f16" else mx.bfloat16, seed=seed)
        return w, None, None, None, 64, _f32(w), _f32(w)
    bits, group = {"q4g32": (4, 32), "q4g128": (4, 128), "q8g64": (8, 64), "q8g32": (8, 32)}[kind]
    wq, s, b, deq, mag = _quantized(n, k, bits, group, mx.float16, seed=seed)
    return wq, s, b, bits, group, deq, mag


KINDS = ["f16", "bf16", "q4g32", "q4g128", "q8g64", "q8g32"]


@needs_ext
@pytest.mark.parametrize("kind", KINDS)
def test_gather_matvec_rows_and_prefix(path, kind):
    n_rows, k = 50, 256
    w, s, b, bits, group, deq, mag = _weights(kind, n_rows, k)
    rng = np.random.default_rng(0)
    for m in (1, 3, 8):  # 8: the tile kernel
        x = _x((m, k), mx.float32, seed=m)
        xf = _f32(x)
        for sel in (rng.integers(0, n_rows, 17), np.array([49, 0, 0, 7]), np.array([], dtype=np.int64)):
            rows = mx.array(sel.astype(np.int32))
            y = ops._ext.gather_matvec(x, w, s, b, rows, None, group, bits)
            ref = xf @ deq[sel].T
            assert y.shape == (m, len(sel))
            _assert_close(y, ref, _bound(mag[sel], x, k, y.dtype, ref))
        for n in (0, 1, 13, n_rows):
            y = ops._ext.gather_matvec(x, w, s, b, None, n, group, bits)
            ref = xf @ deq[:n].T
            _assert_close(y, ref, _bound(mag[:n], x, k, y.dtype, ref))


@needs_ext
@pytest.mark.parametrize("kind", KINDS)
def test_gather_matvec_t_rows_and_prefix(path, kind):
    n_rows, k = 50, 256
    w, s, b, bits, group, deq, mag = _weights(kind, n_rows, k)
    rng = np.random.default_rng(1)
    for m in (1, 2, 8):
        for sel in (rng.integers(0, n_rows, 17), np.array([3, 3, 49]), np.array([], dtype=np.int64)):
            h = _x((m, len(sel)), mx.float16, seed=m)
            rows = mx.array(sel.astype(np.int32))
            y = ops._ext.gather_matvec_t(h, w, s, b, rows, None, group, bits)
            assert y.shape == (m, k)
            ref = _f32(h) @ deq[sel]
            _assert_close(y, ref, _bound_t(h, mag[sel], y.dtype, ref))
        for n in (0, 1, 13, n_rows):
            h = _x((m, n), mx.bfloat16, seed=n)
            y = ops._ext.gather_matvec_t(h, w, s, b, None, n, group, bits)
            ref = _f32(h) @ deq[:n]
            _assert_close(y, ref, _bound_t(h, mag[:n], y.dtype, ref))


@needs_ext
@pytest.mark.parametrize("kind", ["q4g32", "q4g128", "q8g64", "f16"])
def test_gather_matvec_t_column_ranges_across_threads(path, kind):
    # Over 64 KiB of gathered weights the columns are split between threads, so each range starts
    # past column 0 (the 4-bit loop keeps its accumulators in nibble order per 32 columns and puts
    # them back when storing: a range offset shows up here, not in the small cases above).
    n_rows, k = 400, 1024
    w, s, b, bits, group, deq, mag = _weights(kind, n_rows, k)
    sel = np.sort(np.random.default_rng(2).choice(n_rows, 300, replace=False))
    h = _x((1, len(sel)), mx.float32, seed=3)
    y = ops._ext.gather_matvec_t(h, w, s, b, mx.array(sel.astype(np.int32)), None, group, bits)
    ref = _f32(h) @ deq[sel]
    _assert_close(y, ref, _bound_t(h, mag[sel], y.dtype, ref))


@needs_ext
@pytest.mark.parametrize("m", [1, 7])  # 7 x rows: the tile kernel
def test_out_of_range_rows_give_nan(m):
    w, s, b, bits, group, _, _ = _weights("q4g32", 8, 64)
    y = ops._ext.gather_matvec(mx.ones((m, 64)), w, s, b, mx.array([1, 8, -1, 2, 3], mx.int32), None, group, bits)
    got = np.array(y)
    assert np.all(np.isfinite(got[:, [0, 3, 4]])) and np.all(np.isnan(got[:, 1:3]))


@needs_ext
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_round_floats_as_mlx_astype(path, dtype):
    # the fused ops' intermediates: rounded to nearest even exactly as MLX stores them (halfway
    # cases, subnormals, overflow, infinities, NaN), on both paths
    rng = np.random.default_rng(0)
    halfway = np.array([1 + 2.0**-11, 1 + 3 * 2.0**-11, 1 + 2.0**-8, 1 + 3 * 2.0**-8], np.float32)
    special = np.array([0.0, -0.0, 65504.0, 65520.0, 1e6, 2.0**-24, 2.0**-25, 3 * 2.0**-26, 1e-40,
                        np.inf, -np.inf], np.float32)
    x = np.concatenate([halfway, -halfway, special, (rng.standard_normal(200) * 10.0**rng.uniform(-8, 5, 200))])
    x = x.astype(np.float32)
    got = np.array(ops._ext.round_floats(x.tolist(), dtype), np.float32)
    ref = _f32(mx.array(x).astype(dtype))
    assert np.array_equal(got, ref)
    nan = np.array(ops._ext.round_floats([float("nan")] * 9, dtype))
    assert np.all(np.isnan(nan))


@needs_ext
def test_strided_inputs_and_leading_dims(path):
    k, n = 128, 40
    big = _x((2 * n, k), mx.float16, seed=3)
    w = big[::2]  # row-strided weight view (a cache slice), read in place
    xs = _x((k, 6), mx.float32, seed=4).T[1:4]  # transposed, non-contiguous x
    ref = _f32(xs) @ _f32(w).T
    _assert_close(ops._ext.half_matvec(xs, w), ref, _bound(_f32(w), xs, k, mx.float32, ref))
    wq, s, b, deq, mag = _quantized(n, k, 4, 64, mx.float16)
    x3 = _x((2, 3, k), mx.bfloat16, seed=5)  # [..., K] with two leading dims
    y = ops._ext.quantized_matvec(x3, wq, s, b, 64, 4)
    assert y.shape == (2, 3, n)
    ref = (_f32(x3).reshape(-1, k) @ deq.T).reshape(2, 3, n)
    _assert_close(y, ref, _bound(mag, x3, k, y.dtype, ref))


@needs_ext
def test_kernels_are_lazy_and_compose():
    k, n = 64, 16
    wq, s, b, deq, mag = _quantized(n, k, 8, 32, mx.float16)
    x = mx.ones((1, k))
    fn = mx.compile(lambda a: mx.sum(ops._ext.quantized_matvec(a * 2, wq, s, b, 32, 8) + 1))
    ref = float(np.sum(2 * np.ones((1, k)) @ deq.T + 1))
    assert abs(fn(x).item() - ref) <= 1e-4 * max(1.0, abs(ref))


@needs_ext
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("sdtype", [mx.float32, mx.float16, mx.bfloat16])
def test_quantized_embedding_equals_mlx_dequantize(bits, group, sdtype):
    # The same arithmetic as MLX's dequantize (each multiply and add rounded to the scales' dtype),
    # so the rows are identical; any ids shape, int32 or uint32; ids outside the table give NaN rows.
    wq, s, b, _, _ = _quantized(40, 256, bits, group, sdtype)
    for ids in (mx.array([[3, 0, 39, 3]], mx.int32), mx.array([7, 1], mx.uint32)):
        y = ops.quantized_embedding(ids, wq, s, b, group, bits)
        ref = mx.dequantize(wq[ids], scales=s[ids], biases=b[ids], group_size=group, bits=bits)
        assert y.dtype == ref.dtype == sdtype and y.shape == ref.shape == (*ids.shape, 256)
        assert np.array_equal(_f32(y), _f32(ref))
    y = ops._ext.quantized_embedding(mx.array([40, -1, 2], mx.int32), wq, s, b, group, bits)
    assert np.isnan(_f32(y[:2])).all() and not np.isnan(_f32(y[2])).any()
    with pytest.raises(ValueError, match="ids must be int32 or uint32"):
        ops._ext.quantized_embedding(mx.array([1.0]), wq, s, b, group, bits)


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "mlx-twin"])
def test_quantized_embedding_leaves_lazy_ids_unevaluated(kernels):
    """mlx-lm's generate builds the next token's graph on the sampled id before evaluating it: the
    lookup must not evaluate its ids (a host sync there stalls that pipeline every token). The
    ids here come from a chain of matmuls that takes far longer to evaluate than a graph to build."""
    w, s, b = mx.quantize(mx.random.normal((16, 64), key=mx.random.key(0)), group_size=32, bits=4)
    a = mx.random.normal((768, 768), key=mx.random.key(3)) / 28
    mx.eval(a)
    was = ops.kernels_active()
    ops.set_kernels_enabled(kernels)
    try:
        h = a
        for _ in range(40):
            h = h @ a
        ids = (mx.argmax(h[:1], axis=-1) % 16).astype(mx.int32)
        t0 = time.perf_counter()
        y = ops.quantized_embedding(ids, w, s, b, 32, 4)
        built = time.perf_counter() - t0
        t0 = time.perf_counter()
        mx.eval(y)
        evaluated = time.perf_counter() - t0
    finally:
        ops.set_kernels_enabled(was)
    assert built < evaluated / 4, f"the lookup took {built:.3f} s (evaluating it then {evaluated:.3f} s)"


@needs_ext
def test_bad_arguments_raise():
    wq, s, b, _, _ = _quantized(8, 64, 4, 32, mx.float16)
    with pytest.raises(ValueError, match="last dimension"):
        ops._ext.quantized_matvec(mx.ones((1, 32)), wq, s, b, 32, 4)
    with pytest.raises(ValueError, match="bits"):
        ops._ext.quantized_matvec(mx.ones((1, 64)), wq, s, b, 32, 3)
    with pytest.raises(ValueError, match="exceeds"):
        ops._ext.gather_matvec(mx.ones((1, 64)), wq, s, b, None, 9, 32, 4)


# ------------------------------------------------------------------------------------------------
# int8 activations (opt-in): the kernels' integer dot products against the same rounding in numpy.
# Reference: W @ x_rounded, x rounded per 32-block to d * round_half_even(x / d), d = max|x| / 127.
# The integer sums are exact, so ours differs by float32 rounding only (bounded as for the exact
# kernels, with |x| and |s|*q + |b| as magnitudes; 8-bit rows compute s*(q-128) + (b+128s)).

def _q8_reference(x, wq, s, b, group, bits):
    xf = _f32(x)
    k = xf.shape[-1]
    blocks = xf.reshape(-1, k // 32, 32)
    d = np.abs(blocks).max(-1, keepdims=True) / np.float32(127)
    xq = np.where(d > 0, np.round(blocks / np.where(d > 0, d, 1)), 0)  # numpy rounds half to even
    xhat = (xq * d).reshape(xf.shape)
    s32, b32 = s.astype(mx.float32), b.astype(mx.float32)
    shift = 128 if bits == 8 else 0
    w = _f32(mx.dequantize(wq, s32, b32, group_size=group, bits=bits))
    mag = (np.abs(_f32(mx.dequantize(wq, mx.abs(s32), mx.zeros_like(b32) - shift * mx.abs(s32), group_size=group, bits=bits)))
           + np.abs(_f32(mx.dequantize(wq, mx.zeros_like(s32), b32 + shift * s32, group_size=group, bits=bits))))
    return xhat @ w.T, mag


@needs_ext
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_q8_activations_match_reference(path, bits, group):
    k = {32: 352, 64: 320, 128: 384}[group]  # 352 = 5.5 chunks of 64: the lone last 32-block too
    wq, s, b, _, _ = _quantized(37, k, bits, group, mx.float16)
    x = _x((3, k), mx.float32) * 4
    ref, mag = _q8_reference(x, wq, s, b, group, bits)
    y = ops._ext.quantized_matvec(x, wq, s, b, group, bits, q8_activations=True)
    _assert_close(y, ref, _bound(mag, x, k, mx.float32, ref))
    rows = mx.array([5, 0, 36, 5], mx.int32)
    yg = ops._ext.gather_matvec(x[:1], wq, s, b, rows, None, group, bits, q8_activations=True)
    _assert_close(yg, ref[:1][:, np.array(rows)], _bound(mag[np.array(rows)], x[:1], k, mx.float32, ref[:1][:, np.array(rows)]))
    # the rounding is real: a different answer from the exact kernel, but within a few int8 steps
    exact = _f32(ops._ext.quantized_matvec(x, wq, s, b, group, bits))
    assert 0 < np.max(np.abs(_f32(y) - exact)) < 0.05 * np.max(np.abs(exact))
    # prompts (6+ x rows) run the exact float tiles whatever the flag: the same values as without it
    xp = _x((7, k), mx.float32) * 4
    assert np.array_equal(_f32(ops._ext.quantized_matvec(xp, wq, s, b, group, bits, q8_activations=True)),
                          _f32(ops._ext.quantized_matvec(xp, wq, s, b, group, bits)))


@needs_ext
def test_q8_activations_switch():
    wq, s, b, _, _ = _quantized(8, 64, 4, 32, mx.float16)
    x = _x((1, 64), mx.float32)
    exact = _f32(ops.quantized_matvec(x, wq, s, b, 32, 4))
    try:
        ops.set_q8_activations(True)
        rounded = _f32(ops.quantized_matvec(x, wq, s, b, 32, 4))
    finally:
        ops.set_q8_activations(False)
    assert not np.array_equal(rounded, exact)
    assert np.array_equal(_f32(ops.quantized_matvec(x, wq, s, b, 32, 4)), exact)
    with pytest.raises(ValueError, match="q8_activations"):  # half weights have no int8 path
        ops._ext.gather_matvec(x, mx.zeros((8, 64), mx.float16), n=8, q8_activations=True)


@needs_ext
@pytest.mark.parametrize("vnni", [True, False])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("sdtype", [mx.float16, mx.bfloat16, mx.float32])
def test_q8_activations_avx512_equals_avx2(bits, group, sdtype, vnni):
    # On CPUs with AVX512_VNNI the int8-activation forward runs its avx512 kernel under MLX_FLASH_ISA
    # avx512 (vpdpbusd, 16 lanes), built to give the avx2 kernel's float32 sums bit for bit; both
    # within the rounding bound of the reference (and of the scalar kernel). K: 4-bit 128-element steps
    # with a last 64-chunk and / or a lone 32-block (96, 320, 352), 8-bit an odd number of 32-blocks,
    # and (4224, 4384) a last partial register of 16 block scales. x rows 1, 2, 4, 5; rows dense and
    # gathered with repeats and -1 / N. vnni False: the kernels act as on an avx512 CPU without
    # VNNI (set_vnni_allowed), whose int8 path runs the avx2 kernel under avx512, x prepared for it.
    if ops._ext.best_isa() != "avx512" or "avx512vnni" not in ops._ext.cpu_features():
        pytest.skip("this CPU has no AVX512_VNNI: the int8 path runs avx2 under avx512")
    n = 23
    sel = np.array([22, 0, 5, 5, -1, 3, n, 21])
    ok = (sel >= 0) & (sel < n)
    for k in sorted({3 * group, 352 if group == 32 else 5 * group, 4224, 4384 if group == 32 else 4224}):
        wq, s, b, _, _ = _quantized(n, k, bits, group, sdtype, seed=k)
        for m in (1, 2, 4, 5):
            x = _x((m, k), mx.float32, seed=m) * 4
            ref, mag = _q8_reference(x, wq, s, b, group, bits)
            out = {}
            for isa in ("scalar", "avx2", "avx512"):
                ops._ext.set_isa(isa)
                ops._ext.set_vnni_allowed(vnni)
                try:
                    out[isa] = (ops._ext.quantized_matvec(x, wq, s, b, group, bits, q8_activations=True),
                                ops._ext.gather_matvec(x, wq, s, b, mx.array(sel.astype(np.int32)), None, group,
                                                       bits, q8_activations=True))
                    mx.eval(*out[isa])  # under this ISA (MLX evaluates lazily)
                finally:
                    ops._ext.set_isa(ops._ext.best_isa())
                    ops._ext.set_vnni_allowed(True)
            for dense, gathered in out.values():
                _assert_close(dense, ref, _bound(mag, x, k, mx.float32, ref))
                assert np.all(np.isnan(_f32(gathered)[:, ~ok]))
                good = gathered[:, mx.array(np.flatnonzero(ok))]
                _assert_close(good, ref[:, sel[ok]], _bound(mag[sel[ok]], x, k, mx.float32, ref[:, sel[ok]]))
            assert np.array_equal(_f32(out["avx512"][0]), _f32(out["avx2"][0]))
            assert np.array_equal(_f32(out["avx512"][1]), _f32(out["avx2"][1]), equal_nan=True)
            _assert_close(out["avx512"][0], _f32(out["scalar"][0]), 2 * _bound(mag, x, k, mx.float32, ref))


# ------------------------------------------------------------------------------------------------
# Layer ops (RMSNorm, RoPE, attention) vs mx.fast on float32 copies of the same inputs.
# Ours computes in float32 and rounds each output once; the reference is MLX's float32 result, so
# the allowed error is the output's rounding (HALF_ULP * |ref|, or the float16 subnormal floor) plus
# a few float32 ulps of the terms summed (RMSNorm: |x| * 8u; attention: a softmax-weighted sum of
# |v|, 16u each). RoPE angles pos * inv_freq are float32 in both, but inv_freq may differ by an ulp
# (exp2 vs exp), so a rotated pair may differ by pos * 2^-22 radians times its magnitude.

def _layer_bound(ref, terms, dtype):
    return HALF_ULP[dtype] * np.abs(ref) + terms + HALF_TINY


@needs_ext
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("weight", [True, False])
def test_rms_norm_matches_mlx(path, dtype, weight):
    x = _x((2, 3, 100), dtype) * 3
    w = (_x((100,), dtype, seed=2) * 0.2 + 1).astype(dtype) if weight else None
    strided = _x((3, 2, 100), dtype).transpose(1, 0, 2)  # rows not contiguous
    for inp in (x, strided, x[:, :1]):
        y = ops.rms_norm(inp, w, 1e-5)
        ref = mx.fast.rms_norm(inp.astype(mx.float32), None if w is None else w.astype(mx.float32), 1e-5)
        assert y.dtype == mx.fast.rms_norm(inp, w, 1e-5).dtype == dtype
        # ours rounds x*rsqrt to dtype before the weight multiply (as MLX does): two roundings
        r = _f32(ref)
        _assert_close(y, r, _layer_bound(r, 2 * HALF_ULP[dtype] * np.abs(r) + 8 * U * np.abs(r), dtype))


@needs_ext
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("affine", ["none", "weight", "both"])
def test_layer_norm_matches_mlx(path, dtype, affine):
    x = _x((2, 3, 100), dtype) * 3 + 1  # an offset, so centring matters
    w = (_x((100,), dtype, seed=2) * 0.2 + 1).astype(dtype) if affine != "none" else None
    b = (_x((100,), dtype, seed=5) * 0.5).astype(dtype) if affine == "both" else None
    f32 = lambda a: None if a is None else a.astype(mx.float32)  # noqa: E731
    for inp in (x, _x((3, 2, 100), dtype).transpose(1, 0, 2)):
        y = ops.layer_norm(inp, w, b, 1e-5)
        r = _f32(mx.fast.layer_norm(inp.astype(mx.float32), f32(w), f32(b), 1e-5))
        assert y.dtype == mx.fast.layer_norm(inp, w, b, 1e-5).dtype == dtype
        # three roundings to dtype (normalised x, * weight, + bias), float32 sums of 100 terms
        mag = np.abs(r) + (np.abs(_f32(b)) if b is not None else 0)
        _assert_close(y, r, _layer_bound(r, 3 * HALF_ULP[dtype] * mag + 64 * U * mag, dtype))


@needs_ext
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("traditional", [False, True])
def test_rope_matches_mlx(path, dtype, traditional):
    q = _x((1, 5, 9, 64), dtype).transpose(0, 2, 1, 3)  # [B, H, L, D] view, as attention passes it
    cases = [dict(dims=64, base=10000.0, scale=1.0, offset=0), dict(dims=64, base=10000.0, scale=1.0, offset=777),
             dict(dims=32, base=500000.0, scale=0.25, offset=3),
             dict(dims=32, base=None, scale=1.0, offset=11, freqs=mx.exp(mx.arange(16) * 0.7))]
    for c in cases:
        y = ops.rope(q, c["dims"], traditional=traditional, base=c["base"], scale=c["scale"], offset=c["offset"],
                     freqs=c.get("freqs"))
        ref = _f32(mx.fast.rope(q.astype(mx.float32), c["dims"], traditional=traditional, base=c["base"],
                                scale=c["scale"], offset=c["offset"], freqs=c.get("freqs")))
        pos = (c["offset"] + q.shape[2]) * c["scale"]
        mag = np.abs(_f32(q)).max()
        assert y.dtype == dtype and y.shape == q.shape
        _assert_close(y, ref, _layer_bound(ref, 8 * U * mag + 2 * pos * 2.0**-22 * mag, dtype))


@needs_ext
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("lq,causal", [(1, False), (1, True), (3, True), (4, False), (33, False), (37, True)])  # 33, 37: blocks of 16 queries
@pytest.mark.parametrize("D,Dv", [(32, 48), (20, 13)])  # odd sizes: the SIMD loops' scalar tails
def test_attention_matches_mlx(path, dtype, lq, causal, D, Dv):
    B, Hq, Hkv, cap, Lk = 2, 6, 2, 64, max(37, lq)
    q = _x((B, lq, Hq, D), dtype).transpose(0, 2, 1, 3)
    k = _x((B, Hkv, cap, D), dtype, seed=3)[:, :, :Lk]  # a KV-cache slice of a larger buffer
    v = _x((B, Hkv, cap, Dv), dtype, seed=4)[:, :, :Lk]
    mask = "causal" if causal else None
    y = ops.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask=mask)
    ref = _f32(mx.fast.scaled_dot_product_attention(q.astype(mx.float32), k.astype(mx.float32),
                                                    v.astype(mx.float32), scale=D**-0.5, mask=mask))
    assert y.dtype == dtype and y.shape == (B, Hq, lq, Dv)
    vmax = np.abs(_f32(v)).max()
    _assert_close(y, ref, _layer_bound(ref, 16 * U * Lk * vmax, dtype))
    # heads_last: what mlx-lm's transpose(0, 2, 1, 3).reshape(B, L, -1) of the output gives, exactly
    last = ops._ext.attention(q, k, v, D**-0.5, causal, heads_last=True)
    assert last.shape == (B, lq, Hq * Dv)
    assert np.array_equal(_f32(last), _f32(y.transpose(0, 2, 1, 3).reshape(B, lq, -1)))
    # n_keys: the first Lk rows of the whole buffer are the keys (no slice op), exactly the same
    kb, vb = _x((B, Hkv, cap, D), dtype, seed=3), _x((B, Hkv, cap, Dv), dtype, seed=4)
    whole = ops._ext.attention(q, kb, vb, D**-0.5, causal, heads_last=True, n_keys=Lk)
    assert np.array_equal(_f32(whole), _f32(last))


@needs_ext
@pytest.mark.parametrize("lq,causal", [(1, False), (64, True)])
def test_attention_with_widely_spread_scores(path, lq, causal):
    # Score differences far beyond ln(FLT_MIN) ~ -87.3 (large logits, e.g. long prompt chunks of a
    # random model): exp must underflow to 0, not to -inf / NaN.
    q = _x((1, 4, lq, 16), mx.float32) * 40
    k = _x((1, 2, 64, 16), mx.float32, seed=3) * 40
    v = _x((1, 2, 64, 16), mx.float32, seed=4)
    mask = "causal" if causal else None
    y = _f32(ops.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask))
    ref = _f32(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask))
    assert np.isfinite(y).all()
    assert np.max(np.abs(y - ref)) <= 1e-4 * max(1.0, np.max(np.abs(ref)))


@needs_ext
def test_layer_ops_fall_back_where_the_kernel_does_not_apply():
    q, k = _x((1, 4, 2, 16), mx.float32), _x((1, 4, 5, 16), mx.float32, seed=2)
    mask = mx.array(np.tril(np.ones((2, 5), bool), 3))
    y = ops.scaled_dot_product_attention(q, k, k, scale=0.25, mask=mask)  # array masks: MLX's op
    assert np.array_equal(_f32(y), _f32(mx.fast.scaled_dot_product_attention(q, k, k, scale=0.25, mask=mask)))
    off = mx.array(3)  # array offsets (batched caches): MLX's op
    y = ops.rope(q, 16, traditional=False, base=1e4, scale=1.0, offset=off)
    assert np.array_equal(_f32(y), _f32(mx.fast.rope(q, 16, traditional=False, base=1e4, scale=1.0, offset=off)))
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        ops._ext.attention(_x((1, 3, 1, 16), mx.float32), k, k, 0.25)
    with pytest.raises(ValueError, match="n_keys must be in"):
        ops._ext.attention(q, k, k, 0.25, n_keys=6)
    with pytest.raises(ValueError, match="dims must be even"):
        ops._ext.rope(q, 15, False, 1e4, 1.0, 0)
    with pytest.raises(ValueError, match="weight must have shape"):
        ops._ext.rms_norm(q, mx.ones((3,)), 1e-5)


# ------------------------------------------------------------------------------------------------
# Public ops: the same answers with kernels on or off (fallback path tested without the extension)


@pytest.mark.parametrize("enabled", [True, False])
def test_public_ops_match_mlx(enabled):
    ops.set_kernels_enabled(enabled)
    k, n = 128, 24
    wq, s, b, deq, mag = _quantized(n, k, 4, 64, mx.float16)
    wh = _x((n, k), mx.bfloat16, seed=9)
    whf = _f32(wh)
    rows = mx.array([5, 1, 23, 1], mx.int32)
    sel = np.array([5, 1, 23, 1])
    for m in (1, 4, 20, ops.MAX_KERNEL_ROWS + 1):  # the last: above MAX_KERNEL_ROWS, MLX's ops
        x = _x((m, k), mx.float32, seed=m)
        xf = _f32(x)
        cases = [
            (ops.quantized_matvec(x, wq, s, b, 64, 4), xf @ deq.T, mag),
            (ops.half_matvec(x, wh), xf @ whf.T, whf),
            (ops.gather_matvec(x, wq, rows=rows, scales=s, biases=b, group_size=64, bits=4), xf @ deq[sel].T, mag[sel]),
            (ops.gather_matvec(x, wh, n=7), xf @ whf[:7].T, whf[:7]),
        ]
        for y, ref, wf in cases:
            _assert_close(y, ref, _bound(wf, x, k, mx.float32, ref) * 2)
        h = _x((m, 4), mx.float32, seed=m)
        y = ops.gather_matvec_t(h, wq, rows=rows, scales=s, biases=b, group_size=64, bits=4)
        ref = _f32(h) @ deq[sel]
        _assert_close(y, ref, _bound_t(h, mag[sel], mx.float32, ref) * 2)
        y = ops.gather_matvec_t(h[:, :0], wh, n=0)
        assert y.shape == (m, k) and not np.any(np.array(y))
        y = ops.gather_matvec(x, wh, rows=mx.array([], mx.int32))
        assert y.shape == (m, 0)
    with pytest.raises(ValueError):
        ops.gather_matvec(mx.ones((1, k)), wh)


@pytest.mark.parametrize("value,active", [("0", False), ("1", True)])
def test_environment_switch(value, active):
    # MLX_FLASH_KERNELS=0 python -m mlx_flash.generate ... runs MLX's own ops (nothing patched)
    import os
    import subprocess
    import sys
    import tempfile

    code = ("import mlx.core as mx, mlx.nn as nn; from mlx_flash.cpu import ops; "
            "from mlx_flash.cpu.patch import patch_layers; "
            "mx.set_default_device(mx.cpu); m = nn.QuantizedLinear(64, 8, group_size=32, bits=4); "
            "print(ops.kernels_active(), patch_layers(nn.Sequential(m)))")
    env = {**os.environ, "MLX_FLASH_KERNELS": value}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         cwd=tempfile.gettempdir())
    want = (active and ops.EXTENSION_AVAILABLE)
    assert out.stdout.split() == [str(want), str(int(want))]


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "mlx-twin"])
def test_out_of_range_ids_give_nan_rows_and_row_counts_are_refused_on_both_paths(kernels):
    """One behaviour for the kernel and its twin (MLX's gather does not check ids: the twin reads
    row 0 for them, then NaN; a negative n meant every row on the kernel and 3 on the twin)."""
    w, s, b = mx.quantize(mx.random.normal((16, 64), key=mx.random.key(0)), group_size=32, bits=4)
    half = mx.random.normal((8, 64), key=mx.random.key(1)).astype(mx.float16)
    x = mx.random.normal((1, 64), key=mx.random.key(2))
    table = mx.dequantize(w, s, b, group_size=32, bits=4)
    was = ops.kernels_active()
    ops.set_kernels_enabled(kernels)
    try:
        for ids in ([0, 16], [-1, 3], [2 ** 31 - 1, 15]):
            y = ops.quantized_embedding(mx.array(ids), w, s, b, 32, 4)
            inside = [0 <= i < 16 for i in ids]
            assert y.shape == (2, 64) and [bool(mx.isnan(r).all()) for r in y] == [not k for k in inside]
            for r, i, k in zip(y, ids, inside):
                assert not k or mx.array_equal(r, table[i]).item()
        with pytest.raises(ValueError, match="ids must be integers"):
            ops.quantized_embedding(mx.array([1.0]), w, s, b, 32, 4)
        for n in (-1, 9, 2.5, True):
            with pytest.raises(ValueError, match="must be an integer in 0..8"):
                ops.gather_matvec(x, half, n=n)
            with pytest.raises(ValueError, match="must be an integer in 0..8"):
                ops.gather_matvec_t(mx.ones((1, 8)), half, n=n)
        assert ops.gather_matvec(x, half, n=8).shape == (1, 8)
        assert ops.gather_matvec(x, half, n=0).shape == (1, 0)
    finally:
        ops.set_kernels_enabled(was)



# ---- the kernels' environment variables ---------------------------------------------------------

@pytest.mark.parametrize("environ", [{}, {"MLX_FLASH_ISA": ""}, {"MLX_FLASH_ISA": "scalar"},
                                     {"MLX_FLASH_ISA": "avx2"}, {"MLX_FLASH_ISA": "avx512"},
                                     {"MLX_FLASH_THREADS": "1"},
                                     {"MLX_FLASH_THREADS": "256"}, {"MLX_FLASH_THREADS": ""}])
def test_kernel_environment_accepts_valid_values(environ):
    ops.check_kernel_environment(environ)


@pytest.mark.parametrize("name,value", [("MLX_FLASH_ISA", "avx1024"), ("MLX_FLASH_ISA", "Scalar"),
                                        ("MLX_FLASH_ISA", " scalar"), ("MLX_FLASH_THREADS", "0"),
                                        ("MLX_FLASH_THREADS", "257"), ("MLX_FLASH_THREADS", "-4"),
                                        ("MLX_FLASH_THREADS", "4x"), ("MLX_FLASH_THREADS", "1e9")])
def test_kernel_environment_refuses_unknown_isa_and_unbounded_threads(name, value):
    from mlx_flash.errors import FlashError

    with pytest.raises(FlashError, match=f"^{name}=") as e:
        ops.check_kernel_environment({name: value})
    assert "\n" not in str(e.value)


def test_bad_kernel_environment_is_one_line_exit_2_in_a_cli():
    import os
    import subprocess
    import sys

    env = {**os.environ, "MLX_FLASH_ISA": "avx1024"}
    out = subprocess.run([sys.executable, "-m", "mlx_flash.generate", "--prompt", "Hi", "--max-tokens", "1"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip().startswith("error: MLX_FLASH_ISA='avx1024'")
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


# ------------------------------------------------------------------------------------------------
# MoE experts on a slot bank


def _expert_bank(slots, D, I, bits, down_bits, sdtype=mx.float32, seed=0):
    """(gate, up, down) banks [slots, rows, cols] of random experts in MLX's affine format (group 32)."""
    mx.random.seed(seed)

    def bank(n, k, b):
        w, s, z = mx.quantize(mx.random.normal((slots, n, k)) / k**0.5, group_size=32, bits=b)
        return w, s.astype(sdtype), z.astype(sdtype)
    return bank(I, D, bits), bank(I, D, bits), bank(D, I, down_bits)


def _experts(x, slots, banks, bits, down_bits):
    return ops.experts_swiglu(x, slots, *banks, 32, bits, 32, down_bits)


@needs_ext
@pytest.mark.parametrize("tokens", [1, 9])  # 9: several rows per expert, the tile kernels
@pytest.mark.parametrize("bits,down_bits,sdtype", [(4, 4, mx.float32), (8, 4, mx.float16)])
def test_experts_swiglu_matches_mlx_and_not_the_slot(path, tokens, bits, down_bits, sdtype):
    """One primitive for every (token, choice) pair equals SwitchGLU's gather_qmm calls up to
    summation order, and moving the experts to other slots changes no bit."""
    S, D, I, k = 6, 64, 96, 3
    banks = _expert_bank(S, D, I, bits, down_bits, sdtype)
    x = _x((tokens, D), mx.float32)
    rng = np.random.default_rng(tokens)
    slots = np.stack([rng.permutation(S)[:k] for _ in range(tokens)]).astype(np.uint32)
    got = _experts(x, mx.array(slots), banks, bits, down_bits)
    ops.set_kernels_enabled(False)
    want = _experts(x, mx.array(slots), banks, bits, down_bits)
    ops.set_kernels_enabled(True)
    assert got.shape == (tokens, k, D) and got.dtype == want.dtype
    g, w = _f32(got), _f32(want)
    assert np.linalg.norm(g - w) <= 1e-5 * np.linalg.norm(w)
    perm = rng.permutation(S)  # expert in slot s moves to slot perm[s]
    moved = [tuple(mx.array(np.array(a)[np.argsort(perm)]) for a in bank) for bank in banks]
    again = _experts(x, mx.array(perm[slots].astype(np.int32)), moved, bits, down_bits)
    np.testing.assert_array_equal(_f32(again), g)


@needs_ext
def test_experts_swiglu_long_prompt_batches_and_bad_slots():
    """More pairs than one batch of groups (1024): equal to MLX's ops, and bit-identical when the
    experts sit in other slots (the groups then fall into other batches); slots outside the bank
    give NaN rows and leave the others alone."""
    S, D, I, k, T = 8, 32, 32, 4, 300
    banks = _expert_bank(S, D, I, 4, 4)
    x = _x((T, D), mx.float32)
    # even tokens: experts 0, 2, 4, 6; odd ones 1, 3, 5, 7: 8 groups of 150 pairs
    slots = (np.arange(T)[:, None] % 2 + 2 * np.arange(k)[None, :]).astype(np.int32)
    got = _f32(_experts(x, mx.array(slots), banks, 4, 4))
    ops.set_kernels_enabled(False)
    want = _f32(_experts(x, mx.array(slots), banks, 4, 4))
    ops.set_kernels_enabled(True)
    assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want)
    perm = np.array([7, 0, 6, 1, 5, 2, 4, 3])  # expert in slot s moves to slot perm[s]
    moved = [tuple(mx.array(np.array(a)[np.argsort(perm)]) for a in bank) for bank in banks]
    np.testing.assert_array_equal(_f32(_experts(x, mx.array(perm[slots]), moved, 4, 4)), got)
    bad = slots[:2].copy()
    bad[0, 1], bad[1, 3] = S, -1
    y = _f32(_experts(x[:2], mx.array(bad), banks, 4, 4))
    assert np.isnan(y[0, 1]).all() and np.isnan(y[1, 3]).all()
    assert np.isfinite(y).all(axis=-1).sum() == 2 * k - 2
    with pytest.raises(ValueError, match="slots"):
        ops._ext.experts_swiglu(x, mx.array(slots[:3]), *[(*b, None) for b in banks], 32, 4, 32, 4)


# ------------------------------------------------------------------------------------------------
# A flash layer's FFN on its current rows (ops.sparse_ffn): the kernel against its twin op by op


def _row_sets(dtype, k=64, n_gate=48, seed=0):
    """Two row sets of an FFN layer: one carrying gate rows, one taking a resident gate's values at
    neuron ids, plus an empty one; rows large enough that many hidden values pass the thresholds."""
    keys = mx.random.split(mx.random.key(seed), 6)
    rows = [(mx.random.normal((r, k), key=keys[i]) * 0.3).astype(dtype) for i, r in enumerate((40, 40, 40, 16, 16))]
    ids = mx.array(np.random.default_rng(seed).permutation(n_gate)[:10].astype(np.int32))
    gate_values = lambda lead: (mx.random.normal((*lead, n_gate), key=keys[5]) * 2).astype(dtype)  # noqa: E731
    sets = [(rows[0], rows[1], rows[2], 30, None), (rows[3], None, rows[4], 10, ids), (rows[3], None, rows[4], 0, None)]
    return sets, gate_values


@needs_ext
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("act, threshold", [("silu", 0.0), ("silu", 0.3), ("relu_gated", 0.0), ("relu_gated", 0.5),
                                            ("product", 0.0), ("product", 0.5)])
@pytest.mark.parametrize("m", [1, 7])  # a decode token, a prompt chunk (the tile kernels)
def test_sparse_ffn_equals_its_ops_bit_for_bit(path, dtype, act, threshold, m):
    sets, gate_values = _row_sets(dtype)
    x = _x((1, m, 64), dtype, seed=m)
    g = gate_values((1, m))
    for add in (None, _x((1, m, 64), dtype, seed=99)):
        y = ops.sparse_ffn(x, sets, g, act, threshold, add)
        want = ops.sparse_ffn_ops(x, sets, g, act, threshold, add)
        assert y.dtype == want.dtype == dtype and y.shape == (1, m, 64)
        assert mx.array_equal(y, want).item(), f"max diff {mx.abs(y - want).max()}"
    up, _, down, _, _ = sets[0]
    relu = [(up, None, down, 30, None)]
    assert mx.array_equal(ops.sparse_ffn(x, relu, act="relu", threshold=threshold),
                          ops.sparse_ffn_ops(x, relu, act="relu", threshold=threshold)).item()


@needs_ext
@pytest.mark.parametrize("act, threshold", [("silu", 0.9), ("relu_gated", 1.6)])
@pytest.mark.parametrize("m", [1, 3, 7])  # decode, a few tokens (any token's neuron is computed), the tiles
def test_sparse_ffn_on_few_active_rows_equals_its_ops_bit_for_bit(path, act, threshold, m):
    """A resident gate's values known first: the kernel multiplies only the rows some token
    activates (~10% here, as in a CATS layer); the logits must not move, nor with no row active."""
    k, n_gate = 64, 512
    keys = mx.random.split(mx.random.key(5), 4)
    up, down = ((mx.random.normal((n_gate, k), key=keys[i]) * 0.3).astype(mx.float16) for i in (0, 1))
    g = (mx.random.normal((1, m, n_gate), key=keys[2]) * 0.8).astype(mx.float16)
    ids = mx.array(np.random.default_rng(1).permutation(n_gate)[:300].astype(np.int32))
    x, add = _x((1, m, k), mx.float16, seed=m), _x((1, m, k), mx.float16, seed=11)
    share = float(mx.mean(mx.abs(nn.silu(g) if act == "silu" else g) > threshold).item())
    assert 0.02 < share < 0.25
    for sets in ([(up, None, down, n_gate, None)], [(up, None, down, 300, ids), (up, None, down, 200, None)]):
        for a in (None, add):
            y = ops.sparse_ffn(x, sets, g, act, threshold, a)
            assert mx.array_equal(y, ops.sparse_ffn_ops(x, sets, g, act, threshold, a)).item()
    none_active = [(up, None, down, n_gate, None)]
    assert mx.array_equal(ops.sparse_ffn(x, none_active, g, act, 100.0, add), add).item()
    assert not ops.sparse_ffn(x, none_active, g, act, 100.0).any().item()


@needs_ext
@pytest.mark.parametrize("isa", ["scalar", "best"])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_sparse_ffn_silu_is_mlx_silu_for_every_value(dtype, isa):
    # every finite value of the dtype as a gate output, up = 1: h is silu(g) as nn.silu rounds it, on
    # the scalar exp and on the SIMD one (13 values a call: an 8-lane body and a 5-value tail)
    v = np.arange(65536, dtype=np.uint16)
    values = mx.array(v).view(dtype)
    values = values[mx.array(np.nonzero(np.isfinite(_f32(values)))[0])]
    k = 13
    x = mx.zeros((1, k), dtype).at[0, 0].add(1)
    up = mx.zeros((k, k), dtype).at[:, 0].add(1)
    bad = 0
    ops._ext.set_isa(ops._ext.best_isa() if isa == "best" else isa)
    try:
        for start in range(0, values.size, k):
            g = values[start: start + k][None]
            n = g.shape[1]
            y = ops.sparse_ffn(x, [(up[:n], None, mx.eye(k, dtype=dtype)[:n], n, None)], g, "silu", 0.0)[:, :n]
            want = nn.silu(g)
            bad += int((~mx.logical_or(y == want, mx.isnan(y) & mx.isnan(want))).sum().item())
    finally:
        ops._ext.set_isa(ops._ext.best_isa())
    assert bad == 0


@needs_ext
def test_sparse_ffn_follows_mlx_ops_without_the_kernels():
    sets, gate_values = _row_sets(mx.float16)
    x, g = _x((1, 1, 64), mx.float16, seed=3), gate_values((1, 1))
    y = ops.sparse_ffn(x, sets, g, "silu", 0.2)
    ops.set_kernels_enabled(False)
    want = ops.sparse_ffn(x, sets, g, "silu", 0.2)
    ops.set_kernels_enabled(True)
    # the matvecs sum in other orders: float16 rounding of the parts and of their sum
    assert mx.allclose(y, want, rtol=4 * 2.0**-10, atol=4 * 2.0**-10 * mx.abs(want).max().item()).item()


@needs_ext
def test_sparse_ffn_bad_arguments_raise():
    sets, gate_values = _row_sets(mx.float16)
    x = mx.ones((1, 64), mx.float16)
    with pytest.raises(ValueError, match="needs gate_values"):
        ops._ext.sparse_ffn(x, [(u, g, d, n, i) for u, g, d, n, i in sets[1:2]], None, 0, 0.0, None)
    with pytest.raises(ValueError, match="n=41"):
        ops._ext.sparse_ffn(x, [(sets[0][0], sets[0][1], sets[0][2], 41, None)], None, 0, 0.0, None)
    with pytest.raises(ValueError, match="rows must be 2-D"):
        ops._ext.sparse_ffn(mx.ones((1, 32), mx.float16), [(sets[0][0], None, sets[0][2], 3, None)], None, 2, 0.0, None)
    with pytest.raises(ValueError, match="act"):
        ops.sparse_ffn(x, sets, None, "gelu")


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("activation, threshold", [("silu", 0.33266374), ("relu", 0.1), ("fatrelu:0.2713", 0.0)])
def test_active_mask_twin_is_the_predictors_mask_for_every_value(dtype, activation, threshold):
    # the MLX twin (kernels off) keeps exactly what a gate-threshold predictor keeps, for every
    # finite gate value, and any over a prompt's rows
    from mlx_flash.sparse.predictor import LayerPredictor

    v = mx.array(np.arange(65536, dtype=np.uint16)).view(dtype)
    g = v[mx.array(np.nonzero(np.isfinite(_f32(v)))[0])][None]
    rows = g[:, : 64 * 7].reshape(1, 7, 64)
    ops.set_kernels_enabled(False)
    try:
        got, got_rows = ops.active_mask(g, activation, threshold), ops.active_mask(rows, activation, threshold)
    finally:
        ops.set_kernels_enabled(True)
    predictor = LayerPredictor(0, "gate-threshold", g.shape[1], threshold=threshold, activation=activation)
    assert mx.array_equal(got, predictor.mask_from_gate(g)[0]).item()
    assert mx.array_equal(got_rows, predictor.mask_from_gate(rows).reshape(7, 64).any(axis=0)).item()


@needs_ext
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("activation, threshold", [("silu", 0.33266374), ("relu", 0.1), ("fatrelu:0.2713", 0.0)])
def test_active_mask_is_the_predictors_mask_for_every_value(dtype, activation, threshold):
    # every finite value of the dtype as a gate output: the kernel keeps what MLX's activation,
    # abs and compare keep (thresholds that float16 / bfloat16 round), one row and several
    from mlx_flash.sparse.predictor import activation_fn

    v = mx.array(np.arange(65536, dtype=np.uint16)).view(dtype)
    g = v[mx.array(np.nonzero(np.isfinite(_f32(v)))[0])][None]
    want = mx.abs(activation_fn(activation)(g)) > threshold
    got = ops.active_mask(g, activation, threshold)
    assert got.dtype == mx.bool_ and got.shape == (g.shape[1],)
    assert mx.array_equal(got, want[0]).item()
    rows = g[:, : 64 * 7].reshape(1, 7, 64)  # any over a prompt's rows
    assert mx.array_equal(ops.active_mask(rows, activation, threshold),
                          (mx.abs(activation_fn(activation)(rows)) > threshold).reshape(7, 64).any(axis=0)).item()
    ops.set_kernels_enabled(False)
    assert mx.array_equal(ops.active_mask(g, activation, threshold), got).item()  # the MLX twin
    ops.set_kernels_enabled(True)
    with pytest.raises(ValueError, match="gelu"):
        ops.active_mask(g, "gelu", threshold)
