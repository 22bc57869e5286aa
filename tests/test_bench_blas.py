"""bench blas: runs end to end on a tiny size (speed is never asserted here)."""

import json

from mlx_flash.bench.__main__ import main


def test_blas_bench_reports(tmp_path):
    out = tmp_path / "blas.json"
    assert main(["blas", "--size", "64", "--repeats", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["matmul_gflops"] > 0 and result["matvec_gb_per_s"] > 0 and result["blas"]
