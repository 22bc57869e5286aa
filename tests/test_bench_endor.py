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
        if extra:  # the runtime's path too: the loader reads the same bytes as the plain reads
            assert t["endor-loader"]["decode_ms"] > 0 and t["dense-loader"]["decode_ms"] == 0
            assert t["endor-loader"]["bytes"] >= t["endor"]["bytes"] and r["summary"]["loader_speedup"] > 0
    assert "| all | endor |" in capsys.readouterr().out
    assert not list(endor.glob(".endor-bench-*"))  # scratch files removed


def test_isa_rows_decode_with_their_instruction_set(tiny_llama, tmp_path, monkeypatch):
    """--isa: one more ENDOR row per other instruction set, each decoded (plain and through the
    loader) with that ISA while `endor` keeps the active one."""
    from test_calibration_prune import pruned_model

    from mlx_flash import _ext
    from mlx_flash.pack import bitmap

    src, _ = pruned_model(tiny_llama, tmp_path, intermediate=256)
    dense = write_pack(src, tmp_path / "dense", progress=False)
    endor = write_pack(src, tmp_path / "endor", encoding="endor", progress=False)
    seen, decode_into = [], bitmap.decode_into

    def spy(*args, **kwargs):
        seen.append((kwargs.get("isa"), _ext.isa()))
        return decode_into(*args, **kwargs)

    monkeypatch.setattr(bitmap, "decode_into", spy)
    out = tmp_path / "r.json"
    active = _ext.isa()
    assert main(["endor", "--pack", str(endor), "--dense", str(dense), "--repeats", "1", "--isa",
                 f"scalar,{active}", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["isa"] == active and set(r["total"]) >= {"endor", "endor@scalar", "endor-loader@scalar"}
    assert set(r["summary"]["decode_over_saved_by_row"]) == {"endor", "endor-loader", "endor@scalar",
                                                             "endor-loader@scalar"}
    assert (None, active) in seen and ("scalar", active) in seen  # the plain rows: isa= per call
    assert (None, "scalar") in seen  # the loader row: the kernels' ISA switched for its read
    assert _ext.isa() == active


def test_ffn_compares_decode_then_matvec_with_the_decode_matvec(tiny_llama, tmp_path, capsys):
    from test_calibration_prune import pruned_model

    src, _ = pruned_model(tiny_llama, tmp_path, intermediate=256)
    endor = write_pack(src, tmp_path / "endor", encoding="endor", progress=False)
    out = tmp_path / "r.json"
    assert main(["endor", "--pack", str(endor), "--ffn", "--repeats", "2", "--json", str(out)]) == 0
    r = json.loads(out.read_text())["layers"]
    assert sorted(r) == ["0", "1"]
    for row in r.values():
        assert row["decode+matvec"] > 0 and row["decode-matvec"] > 0 and row["max_rel_diff"] < 1e-3
    assert "| all |" in capsys.readouterr().out


def test_warm_decode_speed_per_isa(tiny_llama, tmp_path, capsys, monkeypatch):
    from mlx_flash.pack import bitmap

    endor = write_pack(tiny_llama("src"), tmp_path / "endor", encoding="endor", progress=False)
    seen, decode_into = set(), bitmap.decode_into

    def spy(*args, **kwargs):
        seen.add((kwargs["isa"], kwargs["parallel"], kwargs["crcs"] is not None))
        return decode_into(*args, **kwargs)

    monkeypatch.setattr(bitmap, "decode_into", spy)
    out = tmp_path / "r.json"
    assert main(["endor", "--pack", str(endor), "--warm", "--isa", "scalar", "--repeats", "1", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert set(r["ms"]) == {"scalar/one", "scalar/pool", "scalar/one/cpu"} and all(v > 0 for v in r["ms"].values())
    assert seen == {("scalar", False, True), ("scalar", True, True)}  # crc32 checked, as reads are
    assert "| scalar | one core |" in capsys.readouterr().out


def test_bad_input(tiny_llama, tmp_path, capsys):
    dense = write_pack(tiny_llama("src"), tmp_path / "dense", progress=False)
    with pytest.raises(SystemExit) as e:
        main(["endor", "--pack", str(dense)])
    assert e.value.code == 2 and "no ENDOR-encoded layers" in capsys.readouterr().err
    endor = write_pack(tiny_llama("src"), tmp_path / "endor", encoding="endor", progress=False)
    with pytest.raises(SystemExit) as e:
        main(["endor", "--pack", str(endor), "--isa", "sse4"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.startswith("error: --isa 'sse4': unknown instruction set") and "\n" not in err


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


def test_bench_run_encoding_rows(tmp_path, capsys):
    """bench run --encoding: each mode on the dense and the ENDOR pack of one model, same budget
    in bytes, bytes accounted on both; the ENDOR table lists them."""
    from mlx_flash.convert import main as convert_main

    packs = {}
    for name, extra in (("dense", []), ("endor", ["--encoding", "endor"])):
        packs[name] = tmp_path / name
        assert convert_main(["--synthetic", "opt-tiny", "--weight-sparsity", "0.5", "--sparsity", "0.9",
                             "--out", str(packs[name]), *extra]) == 0
    text = tmp_path / "t.txt"
    text.write_text("Pruned weights are streamed as a bitmap and their non-zeros. " * 30)
    from mlx_flash.sparse.budget import layer_bytes, resident_bytes, stream_bytes

    m = read_manifest(packs["dense"])
    budget = resident_bytes(m) + stream_bytes(m) + layer_bytes(m.bundles[0]) // 2
    out = tmp_path / "run"
    assert main(["run", "--model", str(packs["dense"]), "--encoding", str(packs["endor"]),
                 "--modes", "naive", "--memory-budget", str(budget), "--repeats", "1",
                 "--prompt-tokens", "8", "--gen-tokens", "2", "--peers", "none", "--text", str(text),
                 "--out", str(out)]) == 0
    r = json.loads((out / "results.json").read_text())
    assert set(r["modes"]) == {"naive", "naive+endor"}
    assert all(row["accounting_ok"] for row in r["modes"].values())
    assert r["modes"]["naive+endor"]["budget_bytes"] == r["modes"]["naive"]["budget_bytes"]
    rows = {row["mode"]: row for row in r["encoding"]["rows"]}
    # single tokens read whole layers as stored (the CPU decode-matvec) in 4 KiB-aligned covering
    # ranges: on opt-tiny's 47 KB layers that adds up to 8 KB each (0.56 of dense on real layers)
    assert rows["naive"]["ok"] and 0.5 < rows["naive"]["bytes_ratio"] < 0.8
    assert rows["naive"]["endor_decode_ms"] > 0
    assert "## ENDOR rows" in (out / "report.md").read_text() and "| naive |" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["run", "--model", str(packs["dense"]), "--encoding", str(packs["dense"]), "--peers", "none",
              "--text", str(text), "--out", str(out)])
    assert e.value.code == 2 and "no ENDOR-encoded layers" in capsys.readouterr().err
