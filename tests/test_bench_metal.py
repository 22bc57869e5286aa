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
