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


def _bundles(dtype, gated, seed=0, count=COUNT, up_bias=None):
    """(flat uint8, byte offsets [count + 1], float64 rows [gate,] up, down) of ~50% zero rows;
    up_bias (float16 [count]): stored raw after each down block, padded to 4 bytes (OPT's)."""
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
    if up_bias is not None:
        blocks = [np.concatenate([b, np.frombuffer(up_bias[j: j + 1].tobytes() + bytes(2), np.uint8)])
                  for j, b in enumerate(blocks)]
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


@pytest.mark.parametrize("isa", ISAS)
def test_up_bias_after_the_down_block(isa):
    """OPT's bundles: up row, down column, then the up row's bias raw: relu(up . x + b) * down."""
    bias = np.random.default_rng(8).normal(size=COUNT).astype(np.float16)
    flat, offsets, rows = _bundles("float16", False, seed=6, up_bias=bias)
    x = np.random.default_rng(9).normal(size=HIDDEN).astype(np.float32)
    want = np.maximum(rows[0] @ x.astype(np.float64) + bias.astype(np.float64), 0) @ rows[1]
    y = M.endor_ffn_cpu(mx.array(x), flat, offsets, columns=HIDDEN, down_columns=DOWN,
                        payload={"dtype": "float16"}, act="relu", up_bias=True, isa=isa)
    np.testing.assert_allclose(np.array(y), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    with pytest.raises(FlashError, match="bundle 0 "):  # read without its bias: lengths disagree
        M.endor_ffn_cpu(mx.array(x), flat, offsets, columns=HIDDEN, down_columns=DOWN,
                        payload={"dtype": "float16"}, act="relu", isa=isa)


def test_bundle_layout_names_what_the_kernel_takes():
    from types import SimpleNamespace as NS

    f16 = {"dtype": "float16"}

    def entry(*comps, encoding="endor"):
        return NS(encoding=encoding, components=[NS(name=n, endor=p, dtype=d, shape=s) for n, p, d, s in comps])

    gate, up, down = (("gate.weight", f16, "float16", (8,)), ("up.weight", f16, "float16", (8,)),
                      ("down_t.weight", f16, "float16", (8,)))
    bias = ("up.bias", None, "float16", ())
    assert M.bundle_layout(entry(gate, up, down)) == {"gated": True, "up_bias": False, "payload": f16}
    assert M.bundle_layout(entry(up, down)) == {"gated": False, "up_bias": False, "payload": f16}
    assert M.bundle_layout(entry(up, down, bias)) == {"gated": False, "up_bias": True, "payload": f16}
    assert M.bundle_layout(entry(up, down, ("up.bias", None, "float32", ()))) is None
    assert M.bundle_layout(entry(gate, up, down, encoding=None)) is None
    q4 = {"bits": 4, "group_size": 64}
    assert M.bundle_layout(entry(*[(n, q4, d, s) for n, _, d, s in (gate, up, down)]))["payload"] == q4
    assert M.bundle_layout(entry(("up.weight", q4, "float16", (8,)), down)) is None  # two payloads


def test_matches_the_mlx_op_twin():
    flat, offsets, rows = _bundles("float16", True, seed=3)
    x = mx.random.normal((1, HIDDEN), key=mx.random.key(2)).astype(mx.float16)
    words = mx.array(np.concatenate([flat, np.zeros(-len(flat) % 4, np.uint8)]).view(np.uint32))
    want, ok = E.endor_ffn_twin(x, words, E.word_bounds(offsets), columns=HIDDEN, down_columns=DOWN,
                                payload={"dtype": "float16"}, act="silu")
    ys = [M.endor_ffn_cpu(x, words, offsets, columns=HIDDEN, down_columns=DOWN, payload={"dtype": "float16"})
          for _ in range(2)]
    assert ok.all().item() and ys[0].dtype == mx.float16
    y, want = (np.array(a.astype(mx.float32))[0] for a in (ys[0], want))
    assert np.array_equal(y, np.array(ys[1].astype(mx.float32))[0])  # no first-call difference
    _, h = _activations(np.array(x.astype(mx.float32), np.float64)[0], rows, "silu")
    ref = h @ rows[2]
    # the kernel sums in float32 and rounds to float16 once: within one float16 step of each output
    # (plus float32 sums' error near zero); the twin also rounds gate x, up x and the hidden values
    # to float16, which costs it up to one float16 step at the outputs' scale (2^-5 at |y| ~ 37)
    step = np.spacing(np.abs(ref).astype(np.float16)).astype(np.float64)
    assert (np.abs(y - ref) <= step + 1e-6 * np.abs(ref).max()).all(), np.abs(y - ref).max()
    assert np.abs(y - want).max() <= np.spacing(np.float16(np.abs(ref).max())), np.abs(y - want).max()


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


def test_takes_one_token_of_half_or_quantized_payloads():
    assert M.takes({"dtype": "float16"}, 1) and M.takes({"dtype": "bfloat16"}, 1)
    assert M.takes({"bits": 4, "group_size": 64}, 1) and M.takes({"bits": 8, "group_size": 32}, 1)
    assert not M.takes({"dtype": "float16"}, 2) and not M.takes({"dtype": "float32"}, 1)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("payload", [{"bits": 4, "group_size": 64}, {"bits": 8, "group_size": 32},
                                     {"bits": 4, "group_size": 24}], ids=str)
def test_quantized_payloads_match_their_decoded_rows(isa, payload):
    """8 / 4-bit non-zeros: the codes dequantized as the decode does, then the same FFN (silu)."""
    rng = np.random.default_rng(12)
    mats = []
    for width in (HIDDEN, HIDDEN, DOWN):
        w = rng.normal(size=(COUNT, width)).astype(np.float32) * 0.3
        w[rng.random((COUNT, width)) < 0.5] = 0
        mats.append(w.astype(np.float16))
    blocks = [np.concatenate([B.encode_row(m[j], payload) for m in mats]) for j in range(COUNT)]
    offsets = np.concatenate([[0], np.cumsum([len(b) for b in blocks])]).astype(np.int64)
    flat = np.concatenate(blocks)
    dests = [np.zeros((COUNT, m.shape[1] * 2), np.uint8) for m in mats]
    B.decode_bundles(flat, offsets[:-1], np.diff(offsets), np.arange(COUNT),
                     [(d, m.shape[1], payload) for d, m in zip(dests, mats)])
    rows = [d.view(np.float16).astype(np.float64) for d in dests]
    x = np.random.default_rng(13).normal(size=HIDDEN).astype(np.float32)
    g, u = rows[0] @ x, rows[1] @ x
    want = (g / (1 + np.exp(-g)) * u) @ rows[2]
    y = M.endor_ffn_cpu(mx.array(x), flat, offsets, columns=HIDDEN, down_columns=DOWN, payload=payload, isa=isa)
    np.testing.assert_allclose(np.array(y), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_flash_ffn_runs_opt_bundles_on_the_decode_matvec(tmp_path):
    """OPT's ENDOR bundles (up, down, up bias) streamed in naive mode: single tokens run the CPU
    decode-matvec after the first call agreed with the row path; the logits match the dense mode's
    (rows decoded at load) within float16 rounding, the prompt's exactly. (Held layers run the
    same kernel call: test_models_flash's hybrid case.)"""
    from flash_runs import assert_identical, run_steps

    from mlx_flash.config import FlashConfig
    from mlx_flash.convert import main as convert_main
    from mlx_flash.models.flash import build_flash_model
    from mlx_flash.pack import read_manifest
    from mlx_flash.sparse.ffn import FlashFFN

    pack = tmp_path / "opt-endor"
    assert convert_main(["--synthetic", "opt-tiny", "--weight-sparsity", "0.5", "--encoding", "endor",
                         "--out", str(pack)]) == 0
    m = read_manifest(pack)
    assert M.bundle_layout(m.bundles[0])["up_bias"]
    dense = run_steps(build_flash_model(pack, FlashConfig("dense")))
    model = build_flash_model(pack, FlashConfig("naive"))
    got = run_steps(model)
    ran = [f._endor_cpu for _, f in model.named_modules() if isinstance(f, FlashFFN)]
    assert len(ran) == 2 and all(r is True for r in ran), ran
    steps = model.flash_stats.steps  # the first token's check decodes the bytes it read: no second read
    assert steps[1].bytes_read == steps[2].bytes_read > 0 and steps[1].decode_s > 0 == steps[2].decode_s
    assert_identical(got[:1], dense[:1])
    for x, y in zip(got[1:], dense[1:]):
        assert mx.abs(x - y).max().item() <= 0.01 * mx.abs(y).max().item()
