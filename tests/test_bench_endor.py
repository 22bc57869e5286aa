"""python -m mlx_flash.bench endor: the per-layer dense / ENDOR / zstd table on a tiny pack."""

import json

import pytest

from mlx_flash.bench.__main__ import main
from mlx_flash.pack import write_pack

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
