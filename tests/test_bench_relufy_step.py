"""bench relufy_step: runs end to end on a tiny llama (speed is never asserted here)."""

import json

import pytest

from calibration_packs import write_byte_tokenizer
from mlx_flash.bench.__main__ import main
from mlx_flash.bench.relufy_step import parse_cases
from mlx_flash.errors import FlashError


def test_relufy_step_bench_times_every_case_the_same_number_of_steps(tiny_llama, tmp_path, capsys):
    src = tiny_llama("src", vocab=256, intermediate=96)
    write_byte_tokenizer(src)
    out = tmp_path / "steps.json"
    assert main(["relufy_step", "--model", str(src), "--cases", "eager@1x16,compiled+fused@2x16",
                 "--repeats", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["variant"], r["shape"]) for r in rows] == [("eager", "1x16"), ("compiled+fused", "2x16")]
    for r in rows:
        assert len(r["seconds"]) == 2 and r["tokens_per_s"] == pytest.approx(
            int(r["shape"].split("x")[0]) * 16 / r["median_s"])
    assert rows[0]["vs_first"] == 1.0
    assert "python -m mlx_flash.bench relufy_step --model" in capsys.readouterr().out


def test_relufy_step_cases_are_checked():
    assert parse_cases("eager@1x256,compiled+fused+hidden@2x128") == [
        ("eager", 1, 256), ("compiled+fused+hidden", 2, 128)]
    for bad in ("eager", "fast@1x256", "eager@1x", "eager@0x256"):
        with pytest.raises(FlashError, match="--cases"):
            parse_cases(bad)
