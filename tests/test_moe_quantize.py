"""moe/quantize.py: expert quantizers that write MLX's affine format."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_flash.errors import FlashError
from mlx_flash.moe.quantize import dequantize_experts, pack_bits, quantize_experts


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_pack_bits_is_mlx_packing(bits):
    w = mx.random.normal((2, 3, 64), key=mx.random.key(bits))
    packed, s, b = mx.quantize(w, group_size=32, bits=bits)
    deq = np.array(mx.dequantize(packed, s, b, group_size=32, bits=bits))
    q = np.round((deq - np.repeat(np.array(b), 32, -1)) / np.repeat(np.array(s), 32, -1))
    assert np.array_equal(pack_bits(q.astype(np.int64), bits), np.array(packed))


def test_minmax_keeps_a_weight_already_on_a_q4_1_grid_exactly():
    # gate/up rows of the derived MoE are SmolLM2's Q4_1 blocks: d * q + m per 32 inputs
    rng = np.random.default_rng(0)
    q = rng.integers(0, 16, (3, 8, 64))
    q[..., ::32], q[..., 1::32] = 0, 15  # every block spans its whole range, as Q4_1 blocks do
    d = rng.uniform(0.01, 0.05, (3, 8, 2)).repeat(32, -1)
    m = rng.uniform(-0.3, -0.1, (3, 8, 2)).repeat(32, -1)
    w = mx.array((d * q + m).astype(np.float32))
    ours = dequantize_experts(*quantize_experts(w, 4, 32, "minmax"), 4, 32)
    assert float(mx.abs(ours - w).max()) < 1e-6
    theirs = dequantize_experts(*quantize_experts(w, 4, 32, "mlx"), 4, 32)
    assert float(mx.abs(theirs - w).max()) > 1e-3  # mx.quantize's zero snap moves the grid


@pytest.mark.parametrize("bits", [2, 3])
def test_gptq_and_clip_cut_the_output_error_on_the_calibration_inputs(bits):
    rng = np.random.default_rng(bits)
    n_in, out, e = 64, 16, 2
    mix = rng.normal(size=(n_in, n_in)) * rng.uniform(0.05, 2.0, n_in)  # correlated, uneven inputs
    x = rng.normal(size=(e, 256, n_in)) @ mix
    h = np.einsum("eti,etj->eij", x, x)
    w = mx.array(rng.normal(size=(e, out, n_in)).astype(np.float32))

    def output_error(method):
        wq = np.array(dequantize_experts(*quantize_experts(w, bits, 32, method, h), bits, 32))
        return float(np.sum(np.einsum("eti,eoi->eto", x, wq - np.array(w)) ** 2))

    minmax, clip, gptq = output_error("minmax"), output_error("clip"), output_error("gptq")
    assert clip < minmax and gptq < 0.8 * clip, (minmax, clip, gptq)
    assert output_error("gptq-fit") < 0.97 * gptq
    assert output_error("gptq-cd") < 0.97 * output_error("gptq-fit")


def test_bad_method_and_gptq_without_statistics_fail_with_the_flag():
    w = mx.zeros((1, 4, 32))
    with pytest.raises(FlashError, match="--expert-quantizer best"):
        quantize_experts(w, 3, 32, "best")
    with pytest.raises(FlashError, match="gptq: needs calibration text"):
        quantize_experts(w, 3, 32, "gptq")
    with pytest.raises(FlashError, match="gptq-fit: needs calibration text"):
        quantize_experts(w, 3, 32, "gptq-fit", factor={})
    with pytest.raises(FlashError, match="gptq-cd: needs calibration text"):
        quantize_experts(w, 3, 32, "gptq-cd", factor={})


def test_refit_scales_biases_lowers_the_weighted_error_and_keeps_an_exact_grid():
    from mlx_flash.moe.quantize import gptq, gptq_factor, refit_scales_biases

    rng = np.random.default_rng(7)
    n_in, out, e = 64, 8, 2
    x = rng.normal(size=(e, 128, n_in)) @ (rng.normal(size=(n_in, n_in)) * rng.uniform(0.1, 2, n_in))
    h = np.einsum("eti,etj->eij", x, x)
    w = rng.normal(size=(e, out, n_in))

    def error(q, s, b):
        d = np.repeat(s, 32, -1) * q + np.repeat(b, 32, -1) - w
        return float(np.einsum("eoi,eij,eoj->", d, h, d))

    q, s, b = gptq(w, gptq_factor(h), 2, 32)
    s2, b2 = refit_scales_biases(w, q, s, b, h, 32)
    assert error(q, s2, b2) < 0.97 * error(q, s, b)
    # the optimum: no small move of any one scale or bias lowers the error
    for arr in (s2, b2):
        for sign in (1, -1):
            moved = arr.copy()
            moved[1, 3, 1] += sign * 1e-3 * abs(moved[1, 3, 1])
            args = (moved, b2) if arr is s2 else (s2, moved)
            assert error(q, *args) >= error(q, s2, b2)
    # weights already on the grid come back unchanged
    exact = np.repeat(s, 32, -1) * q + np.repeat(b, 32, -1)
    s3, b3 = refit_scales_biases(exact, q, s, b, h, 32)
    assert np.allclose(s3, s, rtol=1e-6) and np.allclose(b3, b, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("bits", [2, 4])
def test_descend_integers_reaches_a_point_no_single_step_improves(bits):
    from mlx_flash.moe.quantize import descend_integers, gptq, gptq_factor, refit_scales_biases

    rng = np.random.default_rng(bits)
    n_in, out, e = 64, 6, 2
    x = rng.normal(size=(e, 96, n_in)) @ (rng.normal(size=(n_in, n_in)) * rng.uniform(0.1, 2, n_in))
    h = np.einsum("eti,etj->eij", x, x)
    h[1, :, 5] = h[1, 5, :] = 0.0  # an input no token of expert 1 uses
    w = rng.normal(size=(e, out, n_in))
    maxq = 2 ** bits - 1

    def error(q, s, b):
        d = np.repeat(s, 32, -1) * q + np.repeat(b, 32, -1) - w
        return np.einsum("eoi,eij,eoj->eo", d, h, d)

    q, s, b = gptq(w, gptq_factor(h), bits, 32)
    s, b = refit_scales_biases(w, q, s, b, h, 32)
    q2, moves = descend_integers(w, q, s, b, h, bits, 32, sweeps=50)
    assert moves > 0 and q2.min() >= 0 and q2.max() <= maxq
    before, after = error(q, s, b), error(q2, s, b)
    assert np.all(after <= before + 1e-9 * before) and after.sum() < 0.99 * before.sum()
    assert np.array_equal(q2[1, :, 5], q[1, :, 5])  # an unused input's weight never moves
    # a local optimum: no weight's single step up or down lowers its row's error
    for i, o, j in [(0, 0, 3), (1, 5, 40), (0, 2, 63), (1, 1, 0)]:
        for d in (-1, 1):
            if 0 <= q2[i, o, j] + d <= maxq:
                moved = q2.copy()
                moved[i, o, j] += d
                assert error(moved, s, b)[i, o] >= after[i, o] - 1e-9 * after[i, o]
