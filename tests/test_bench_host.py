"""bench host: runs end to end on a tiny synthetic flash pack (speed is never asserted here)."""

import json

import mlx.core as mx
import pytest

from mlx_flash.bench.__main__ import main
from mlx_flash.convert import main as convert_main
from mlx_flash.pack import read_manifest
from mlx_flash.sparse.budget import pack_bytes


@pytest.fixture(scope="module")
def tiny_pack(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_host") / "opt-tiny"
    assert convert_main(["--synthetic", "opt-tiny", "--out", str(out), "--sparsity", "0.9"]) == 0
    return out


def test_host_splits_a_flash_token_into_evals_read_waits_and_host(tiny_pack, tmp_path, capsys):
    out = tmp_path / "host.json"
    budget = str(int(pack_bytes(read_manifest(tiny_pack)) * 1.05))  # every FFN layer sparse
    real_eval = mx.eval
    assert main(["host", "--model", str(tiny_pack), "--mode", "flash", "--memory-budget", budget,
                 "--prompt-tokens", "16", "--warmup", "1", "--tokens", "3", "--json", str(out)]) == 0
    assert mx.eval is real_eval  # every wrapped function restored
    r = json.loads(out.read_text())
    spans = {s["span"]: s for s in r["spans"]}
    layers = len(read_manifest(tiny_pack).bundles)
    assert spans["FlashFFN.__call__"]["calls"] == layers
    assert spans["NeuronCache.update"]["calls"] == spans["FlashFFN._sparse"]["calls"] > 0
    assert any(k.startswith("mx.eval at _sparse") for k in spans)
    assert r["wall_ms"] == pytest.approx(r["eval_ms"] + r["read_wait_ms"] + r["host_ms"])
    assert 0 < r["host_ms"] < r["wall_ms"] and r["main_cpu_ms"] > 0
    printed = capsys.readouterr().out
    assert "python -m mlx_flash.bench host --model" in printed and "| NeuronCache.update |" in printed


def test_host_checks_its_flags(tiny_pack, capsys):
    for argv, flag in ((["--mode", "fast"], "--mode fast"), (["--tokens", "0"], "--tokens")):
        with pytest.raises(SystemExit) as exit_:
            main(["host", "--model", str(tiny_pack), *argv])
        assert exit_.value.code == 2 and flag in capsys.readouterr().err
