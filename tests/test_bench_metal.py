"""`python -m mlx_flash.bench kernels --metal` (mlx_flash/bench/metal.py) off a Mac: says so, no figure."""

import sys

import mlx.core as mx
import pytest

from mlx_flash.bench.__main__ import main


@pytest.mark.skipif(sys.platform == "darwin" and mx.metal.is_available(), reason="measures for minutes on a Mac")
def test_metal_bench_needs_a_mac(capsys):
    assert main(["kernels", "--metal"]) == 0
    out = capsys.readouterr().out
    assert "needs a Mac (Apple Silicon GPU)" in out
    assert "ms" not in out and "speedup" not in out


def test_endor_bench_calls_agree():
    """The ENDOR rows' four calls on a small layer (the kernels through the Metal emulator on Linux):
    ours, the twin and the sparse kernels on decoded rows give the same FFN; the CPU decode fills
    the rows those use."""
    from mlx_flash.bench.metal import ENDOR_KINDS, endor_calls
    from mlx_flash.metal import emulator as em

    on_mac = sys.platform == "darwin" and mx.metal.is_available()
    if not on_mac and em.compiler() is None:
        pytest.skip("the Metal emulator needs g++")
    run = {} if on_mac else dict(metal_kernel=em.metal_kernel)
    calls = endor_calls(ENDOR_KINDS["q4g64"], 40, 160, **run)
    ours, twin, decoded = (calls[k]().astype(mx.float32) for k in ("ours", "twin", "decoded"))
    scale = mx.abs(twin).max().item()
    assert scale > 0 and ours.shape == (1, 160)
    assert mx.abs(ours - twin).max().item() <= 2e-2 * scale and mx.abs(decoded - twin).max().item() <= 2e-2 * scale
    assert calls["cpu decode"]().size == 0


def test_moe_bench_calls_agree():
    """gather_qmm over bank slots and quantized_matmul over the same experts stacked: same product
    (checked here on the CPU; the bench times them on a Mac's GPU)."""
    from mlx_flash.bench.metal import moe_calls

    calls = moe_calls(slots=6, top_k=3, hidden=128, inter=64)
    bank, stacked = calls["bank"](), calls["stacked"]()
    assert bank.shape == (3, 1, 64) and mx.array_equal(bank, stacked)
