"""mlx_flash.cpu.endor: the CPU decode-matvec FFN from ENDOR bundles, on every instruction set
this CPU runs, against a float64 numpy reference and the MLX-op twin (metal.endor.endor_ffn_twin)."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_flash.cpu.ops import KERNEL_ISAS
from mlx_flash.cpu import endor as M
from mlx_flash.errors import FlashError
from mlx_flash.metal import endor as E
from mlx_flash.pack import bitmap as B

_ext = M._extension()
pytestmark = pytest.mark.skipif(_ext is None, reason="mlx_flash._ext not built")
BEST_ISA = _ext.best_isa() if _ext is not None else "scalar"
ISAS = [pytest.param(isa, marks=pytest.mark.skipif(
    KERNEL_ISAS.index(isa) > KERNEL_ISAS.index(BEST_ISA), reason=f"this CPU lacks {isa} (best: {BEST_ISA})"))
    for isa in KERNEL_ISAS]
HIDDEN, DOWN, COUNT = 100, 203, 300  # widths not multiples of 32 or 64


def _bundles(dtype, gated, seed=0, count=COUNT):
    """(flat uint8, byte offsets [count + 1], float64 rows [gate,] up, down) of ~50% zero rows."""
    rng = np.random.default_rng(seed)
    mats = []
    for width in ([HIDDEN] if gated else []) + [HIDDEN, DOWN]:
        w = rng.normal(size=(count, width)).astype(np.float32) * 0.3
        w[rng.random((count, width)) < 0.5] = 0
        w[0] = 0  # an all-zero row
        if dtype == "bfloat16":
            w = np.array(mx.array(w).astype(mx.bfloat16).view(mx.uint16))
        else:
            w = w.astype(np.float16)
        mats.append(w)
    blocks = [np.concatenate([B.encode_row(m[j], {"dtype": dtype}) for m in mats]) for j in range(count)]
    offsets = np.concatenate([[0], np.cumsum([len(b) for b in blocks])]).astype(np.int64)
    if dtype == "bfloat16":
        rows = [np.array(mx.array(m).view(mx.bfloat16).astype(mx.float32), np.float64) for m in mats]
    else:
        rows = [m.astype(np.float64) for m in mats]
    return np.concatenate(blocks), offsets, rows


def _activations(x, rows, act):
    """(a, value): the activation whose magnitude the threshold masks, and what multiplies down."""
    u = rows[-2] @ x
    if act == "relu":
        a = np.maximum(u, 0)
        return a, a
    g = rows[0] @ x
    a = g / (1 + np.exp(-g)) if act == "silu" else np.maximum(g, 0)
    return a, a * u


def _gap_threshold(a):
    """A threshold in the widest gap of the middle third of |a|: no activation within rounding of it."""
    mags = np.sort(np.abs(a))
    k = len(mags) // 3 + int(np.argmax(np.diff(mags[len(mags) // 3: 2 * len(mags) // 3])))
    return float(mags[k] + mags[k + 1]) / 2


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("act", ["silu", "relu_gated", "relu"])
@pytest.mark.parametrize("parallel", [False, True], ids=["one-thread", "pool"])
def test_matches_float64_reference(isa, dtype, act, parallel):
    flat, offsets, rows = _bundles(dtype, act != "relu", seed=len(act))
    x = np.random.default_rng(7).normal(size=HIDDEN).astype(np.float32)
    a, value = _activations(x.astype(np.float64), rows, act)
    for threshold in (0.0, _gap_threshold(a)):
        want = (value * (np.abs(a) > threshold)) @ rows[-1]
        y = M.endor_ffn_cpu(mx.array(x)[None], flat, offsets, columns=HIDDEN, down_columns=DOWN,
                            payload={"dtype": dtype}, act=act, threshold=threshold, isa=isa, parallel=parallel)
        assert y.shape == (1, DOWN) and y.dtype == mx.float32
        np.testing.assert_allclose(np.array(y)[0], want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_matches_the_mlx_op_twin():
    flat, offsets, _ = _bundles("float16", True, seed=3)
    x = mx.random.normal((1, HIDDEN), key=mx.random.key(2)).astype(mx.float16)
    words = mx.array(np.concatenate([flat, np.zeros(-len(flat) % 4, np.uint8)]).view(np.uint32))
    want, ok = E.endor_ffn_twin(x, words, E.word_bounds(offsets), columns=HIDDEN, down_columns=DOWN,
                                payload={"dtype": "float16"}, act="silu")
    y = M.endor_ffn_cpu(x, words, offsets, columns=HIDDEN, down_columns=DOWN, payload={"dtype": "float16"})
    assert ok.all().item() and y.dtype == mx.float16
    np.testing.assert_allclose(np.array(y.astype(mx.float32)), np.array(want.astype(mx.float32)),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("isa", ISAS)
def test_bad_bundles_are_named(isa):
    flat, offsets, _ = _bundles("float16", True, seed=4)
    x = mx.ones((1, HIDDEN))
    run = dict(columns=HIDDEN, down_columns=DOWN, payload={"dtype": "float16"}, where="layer_003.bin", isa=isa)
    bad = flat.copy()
    bits = np.unpackbits(bad[offsets[211]: offsets[211] + 8], bitorder="little")
    bits[np.flatnonzero(bits == 0)[:2]] = 1  # two more values in the gate bitmap than are stored
    bad[offsets[211]: offsets[211] + 8] = np.packbits(bits, bitorder="little")
    with pytest.raises(FlashError, match=r"^layer_003\.bin: bundle 211 \(offset \d+\): its bitmaps' popcount"):
        M.endor_ffn_cpu(x, bad, offsets, **run)
    short = offsets.copy()
    short[-1] -= 4  # the last bundle truncated
    with pytest.raises(FlashError, match=rf"bundle {COUNT - 1} "):
        M.endor_ffn_cpu(x, flat, short, **run)


def test_takes_only_one_token_of_half_payloads():
    assert M.takes({"dtype": "float16"}, 1) and M.takes({"dtype": "bfloat16"}, 1)
    assert not M.takes({"dtype": "float16"}, 2) and not M.takes({"bits": 4, "group_size": 64}, 1)
    assert not M.takes({"dtype": "float32"}, 1)
