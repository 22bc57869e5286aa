"""python -m mlx_flash.bench endor: the per-layer dense / ENDOR / zstd table on a tiny pack."""

import json

import pytest

from mlx_flash.bench.__main__ import main
from mlx_flash.pack import read_manifest, write_pack

pytest.importorskip("zstandard")


def test_table_and_json(tiny_llama, tmp_path, capsys):
    from test_calibration_prune import pruned_model

    src, _ = pruned_model(tiny_llama, tmp_path, intermediate=256)
    dense = write_pack(src, tmp_path / "dense", progress=False)
    endor = write_pack(src, tmp_path / "endor", encoding="endor", progress=False)
    out = tmp_path / "r.json"
    for extra in ([], ["--dense", str(dense)]):
        assert main(["endor", "--pack", str(endor), "--repeats", "1", "--json", str(out), *extra]) == 0
        r = json.loads(out.read_text())
        assert sorted(r["layers"]) == ["0", "1"]
        t = r["total"]
        assert t["dense"]["bytes"] == 2 * 256 * 3 * 64 * 2  # float16 gate, up, down rows
        assert 0.5 < r["summary"]["endor_bytes_ratio"] < 0.6
        assert t["endor"]["decode_ms"] > 0 and t["zstd"]["decode_ms"] > 0
    assert "| all | endor |" in capsys.readouterr().out
    assert not list(endor.glob(".endor-bench-*"))  # scratch files removed


def test_bad_input(tiny_llama, tmp_path, capsys):
    dense = write_pack(tiny_llama("src"), tmp_path / "dense", progress=False)
    with pytest.raises(SystemExit) as e:
        main(["endor", "--pack", str(dense)])
    assert e.value.code == 2 and "no ENDOR-encoded layers" in capsys.readouterr().err


def test_compare_runs(tmp_path, capsys):
    def results(name, total_ms, io_ms, mb):
        d = tmp_path / name
        d.mkdir()
        row = {"ok_runs": 1, "total_ms": total_ms, "io_ms": io_ms, "bytes_read": mb * 1e6}
        (d / "results.json").write_text(json.dumps({"command": f"bench run {name}",
                                                    "modes": {"naive": row, "hybrid": {"ok_runs": 0}}}))
        return str(d)

    assert main(["endor", "--compare-runs", results("d", 400.0, 300.0, 160.0),
                 results("e", 250.0, 150.0, 90.0)]) == 0
    out = capsys.readouterr().out
    assert "| naive | 2.50 | 4.00 | 1.60x | 300 | 150 | 160.0 | 90.0 | 0.562 |" in out
    assert "| hybrid" not in out  # a mode without successful runs is left out


def test_measured_run_accounts_endor_bytes_and_decode_time(tmp_path):
    """A benchmark child on an ENDOR pack: the loader's useful bytes equal the bundles' lengths in
    the layer index (not neurons x decoded row bytes), and the check + decode time is reported."""
    from mlx_flash.bench.measure import generate_flash
    from mlx_flash.convert import main as convert_main

    pack = tmp_path / "opt-endor"
    assert convert_main(["--synthetic", "opt-tiny", "--weight-sparsity", "0.5", "--encoding", "endor",
                         "--out", str(pack)]) == 0
    r = generate_flash(str(pack), "naive", [1, 2, 3, 4], 3, keep_steps=False)
    a = r["accounting"]
    row = sum(c.length for c in read_manifest(pack).bundles[0].components)
    assert a["useful_bytes_loader"] == a["useful_bytes_expected"] > 0
    assert a["useful_bytes_expected"] < 0.6 * a["neurons_read_loader"] * row
    assert 0 < r["summary"]["decode_ms"] <= r["summary"]["io_ms"]
