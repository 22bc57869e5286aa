"""bench run end to end on a tiny synthetic pack (speed is never asserted here)."""

import json
import shutil

import pytest

from mlx_flash.bench.__main__ import main as bench_main
from mlx_flash.convert import main as convert_main
from mlx_flash.pack import read_manifest


@pytest.fixture(scope="module")
def tiny_pack(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_run") / "opt-tiny"
    assert convert_main(["--synthetic", "opt-tiny", "--out", str(out), "--sparsity", "0.9"]) == 0
    return out


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    # Real text (this repository's design notes would do too); the runner tokenizes it.
    path = tmp_path_factory.mktemp("text") / "prompt.txt"
    path.write_text(("The flash loader reads bundles of neurons straight into the neuron cache. "
                     "Each layer keeps the neurons of the last few tokens in memory. ") * 20)
    return path


def _budget(pack):
    # a little more than the pack: flash also holds predictors and a streaming buffer (a budget
    # that holds every FFN: flash runs every layer sparse, see sparse/budget.py)
    from mlx_flash.sparse.budget import pack_bytes

    return str(int(pack_bytes(read_manifest(pack)) * 1.05))


def _row_bytes(pack):
    return {b["layer"]: sum(c["length"] for c in b["components"]) for b in read_manifest(pack)["bundles"]}


def test_tiny_end_to_end_report_and_byte_accounting(tiny_pack, text_file, tmp_path, small_fio):
    out = tmp_path / "bench"
    argv = ["run", "--model", str(tiny_pack), "--modes", "naive,flash", "--memory-budget", _budget(tiny_pack),
            "--prompt-tokens", "12", "--gen-tokens", "6", "--repeats", "1", "--peers", "none",
            "--text", str(text_file), "--out", str(out)]
    assert bench_main(argv) == 0
    result = json.loads((out / "results.json").read_text())
    for key in ("command", "machine", "packages", "model", "protocol", "modes", "table3", "runs"):
        assert key in result
    assert "bench run" in result["command"] and result["packages"]["mlx"]
    assert result["read_cost_profile"].startswith("read-cost profile ")
    assert result["model"]["synthetic"]["arch"] == "opt-tiny"
    proto = result["protocol"]
    assert proto["prompt_tokens"] == 12 and proto["gen_tokens"] == 6
    assert any(m.startswith(("posix_fadvise", "drop_caches", "purge", "F_NOCACHE"))
               for m in proto["eviction"])
    assert proto["prompts"][0]["source"] == str(text_file)
    rows = {r["method"]: r for r in result["table3"]}
    assert set(rows) == {"naive", "flash"} and all(r["ok"] for r in rows.values())
    for r in rows.values():
        assert r["total_ms"] == pytest.approx(r["io_ms"] + r["mem_ms"] + r["compute_ms"], rel=1e-6)
    # naive reads every neuron of every layer each token; flash reads far fewer
    assert rows["flash"]["bytes_read"] < rows["naive"]["bytes_read"]
    assert result["speedups"]["flash_vs_naive"] > 0

    row_bytes = _row_bytes(tiny_pack)
    runs = {r["label"]: r["value"] for r in result["runs"]}
    naive = runs["naive"]
    assert naive["summary"]["neurons_loaded"] == sum(
        read_manifest(tiny_pack)["bundles"][i]["count"] for i in range(len(row_bytes)))
    flash = runs["flash"]
    acc, s = flash["accounting"], flash["summary"]
    # bytes counted per token are the bytes the loader read, in every decode step
    assert s["bytes_read"] * s["tokens"] == pytest.approx(acc["decode_bytes_loader"])
    assert sum(flash["steps"]["bytes_read"]) == acc["decode_bytes_loader"] == acc["decode_bytes_stats"]
    # ... and the neuron caches' own counters agree with the reads that landed in them (directly,
    # or in the streaming buffer with their layer's overflow, then copied into their rows)
    assert acc["cache_rows_loaded"] == acc["cache_rows_logged"] + acc["cache_rows_from_stream"]
    assert acc["cache_rows_logged"] > 0 and acc["cache_rows_from_stream"] > 0
    assert acc["useful_bytes_loader"] == acc["useful_bytes_expected"]
    assert acc["neurons_loaded_stats"] == acc["neurons_read_loader"]
    assert result["modes"]["flash"]["accounting_ok"] and result["modes"]["naive"]["accounting_ok"]

    report = (out / "report.md").read_text()
    assert "SYNTHETIC" in report and "Table 3" in report and "| flash |" in report
    assert f"- Reads priced by the {result['read_cost_profile']}\n" in report
    assert "Byte accounting" in report and "equal the bytes the loader read" in report
    # the flash row's per-layer profile: its layers' bytes add up to the row's
    per_layer = result["modes"]["flash"]["layers"]
    assert sum(r["mb_read"] for r in per_layer.values()) * 1e6 == pytest.approx(rows["flash"]["bytes_read"])
    assert "Flash per layer" in report and "plan I/O ms" in report
    assert report.count("| sparse |") + report.count("| resident |") \
        + report.count("| streamed |") >= len(per_layer)
    # the flash row's I/O reference: fio at its decode read sizes (whole bytes, 4 KiB units)
    sizes = {int(k): v for k, v in acc["decode_read_sizes"].items()}
    assert sizes and all(k % 4096 == 0 for k in sizes) and acc["decode_reads_per_call"] >= 1
    flash_row = result["modes"]["flash"]
    assert "fio" not in result["modes"]["naive"]
    if shutil.which("fio"):
        assert {int(k): v for k, v in flash_row["read_sizes"].items()} == sizes and flash_row["fio"]["gbps"] > 0
        assert flash_row["fio"]["gbps"] == sorted(flash_row["fio"]["gbps_runs"])[1]  # median of 3
        assert flash_row["fio_ms"] == pytest.approx(flash_row["bytes_read"] / (flash_row["fio"]["gbps"] * 1e9) * 1e3)
        assert flash_row["io_over_fio"] == pytest.approx(flash_row["io_ms"] / flash_row["fio_ms"])
        assert "I/O vs fio" in report and "--rw=randread" in flash_row["fio"]["command"]


@pytest.mark.slow
def test_header_line_names_the_stored_profiles_date_and_load(tiny_pack, tmp_path, monkeypatch):
    from mlx_flash.bench.run import stored_profile_line
    from mlx_flash.io.planner import save_cost
    from mlx_flash.io.read_cost import ReadCostCurve

    monkeypatch.setenv("MLX_FLASH_HOME", str(tmp_path / "home"))
    assert "none stored" in stored_profile_line(tiny_pack, 32)
    loaded = {"other_cpu_share": 0.62, "cpus": 2, "seconds": 5.0, "source": "proc_stat"}
    first = tiny_pack / read_manifest(tiny_pack)["bundles"][0]["file"]
    for engine in ("threads", "aio"):
        save_cost(first, 32, ReadCostCurve([4096, 65536], [1, 32], [[6e-5, 1e-4], [2e-5, 4e-5]], load=loaded,
                                           measured="2026-11-26T05:19:00"), engine)
    line = stored_profile_line(tiny_pack, 32)
    assert str(tmp_path / "home" / "io_profile.json") in line
    assert "measured 2026-11-26T05:19:00" in line and "62% of 2 CPU(s)" in line and "LOADED" in line


def test_ablation_sweeps_and_mlx_lm_peer(tiny_pack, text_file, tmp_path, small_fio):
    # 11 child processes (each imports mlx-lm: ~3.5 s on one core)
    out = tmp_path / "bench"
    argv = ["run", "--model", str(tiny_pack), "--modes", "naive,hybrid,flash", "--memory-budget",
            _budget(tiny_pack), "--prompt-tokens", "12", "--gen-tokens", "6", "--repeats", "1", "--ablation",
            "--sweeps", "window,length", "--sweep-windows", "1,4", "--sweep-length", "20",
            "--sweep-gen-tokens", "4", "--peers", "mlx-lm", "--cap", "--text", str(text_file),
            "--out", str(out)]
    assert bench_main(argv) == 0
    result = json.loads((out / "results.json").read_text())
    assert [r["row"] for r in result["table2"]] == ["Naive", "Hybrid", "+Predictor", "+Windowing",
                                                    "+Bundling"]
    assert all(r["ok"] for r in result["table2"])
    t2 = {r["row"]: r for r in result["table2"]}
    # the window lets neurons be reused: fewer bytes than re-reading every predicted neuron
    assert t2["+Windowing"]["flash_to_dram_mb"] < t2["+Predictor"]["flash_to_dram_mb"]
    assert set(result["sweeps"]) == {"window", "length"}
    assert len(result["length_steps"]["greedy"]["io_ms"]) >= 20
    for name in ("window", "length"):
        assert (out / result["plots"][name]).stat().st_size > 1000
    assert result["peers"]["mlx-lm"]["ok"], result["peers"]["mlx-lm"]
    assert not (out / "unbundled-copy").exists()  # removed after the ablation


def _error(capsys, argv):
    with pytest.raises(SystemExit) as e:
        bench_main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_bad_arguments(tiny_pack, tmp_path, capsys):
    err = _error(capsys, ["run", "--model", str(tiny_pack), "--modes", "turbo",
                          "--out", str(tmp_path / "a")])
    assert err.startswith("error: --modes turbo: unknown mode")
    err = _error(capsys, ["run", "--model", str(tiny_pack), "--modes", "naive", "--peers", "none",
                          "--text", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "b")])
    assert "--text" in err and "no such file" in err
    err = _error(capsys, ["run", "--model", str(tiny_pack), "--peers", "gpt",
                          "--out", str(tmp_path / "c")])
    assert "--peers gpt: unknown peer" in err


@pytest.mark.parametrize("temp", [0.0, 0.8])
def test_temp_samples_every_row_with_the_repeats_seed(tiny_pack, temp):
    from types import SimpleNamespace

    from mlx_flash.bench.run import Suite

    suite = object.__new__(Suite)  # only what flash_run reads
    suite.args = SimpleNamespace(memory_budget="0.5", gen_tokens=4, window=5, threads=4, temp=temp)
    suite.pack, suite.manifest, suite.extra_paths = tiny_pack, read_manifest(tiny_pack), []
    calls = []
    suite.child = lambda group, label, function, kwargs, **kw: calls.append(kwargs)
    for mode in ("naive", "flash"):
        suite.flash_run("modes", mode, mode, {"ids": [1, 2, 3], "source": "x"}, repeat=2)
    if temp:
        assert all(c["temp"] == temp and c["seed"] == 2 for c in calls)
    else:
        assert all("temp" not in c for c in calls)  # greedy: generate_flash's default
