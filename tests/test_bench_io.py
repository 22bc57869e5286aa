"""bench io: runs end to end on a tiny pack (speed is never asserted here)."""

import json

import numpy as np
import pytest

from mlx_flash.bench.__main__ import main


def test_io_bench_reports(tiny_llama, tmp_path, monkeypatch):
    import pytest

    from mlx_flash.io import ReadCost
    from mlx_flash.io.planner import save_cost
    from mlx_flash.pack import read_manifest, write_pack

    monkeypatch.setenv("MLX_FLASH_HOME", str(tmp_path / "home"))
    pack = write_pack(tiny_llama("src", dtype="float16", intermediate=256), tmp_path / "pack",
                      progress=False)
    first = pack / read_manifest(pack)["bundles"][0]["file"]
    for engine in ("threads", "aio"):  # a stored cost model: no calibration in the test
        save_cost(first, 2, ReadCost(1e-4, 1e9), engine)
    out, png = tmp_path / "io.json", tmp_path / "io.png"
    assert main(["io", "--pack", str(pack), "--threads", "1,2", "--chunks", "1,4", "--repeat", "1",
                 "--no-fio", "--json", str(out), "--plot", str(png)]) == 0
    r = json.loads(out.read_text())
    assert r["evict_method"] and r["sequential"]["gbps"] > 0 and "io --pack" in r["command"]
    # the machine and packages as bench run records them (bench.report.machine_info)
    assert {"platform", "python", "machine", "cpus", "load_average"} <= set(r["machine"]) and r["packages"]["mlx"]
    assert {(p["chunk_bundles"], p["threads"]) for p in r["chunk_sweep"]} == {(1, 1), (1, 2), (4, 1), (4, 2)}
    assert [c["fraction"] for c in r["bundled_vs_unbundled"]] == [0.05, 0.1, 0.25]
    for c in r["bundled_vs_unbundled"]:
        # the same neurons either way: bundled reads fetch every useful byte in fewer requests
        assert c["bundled"]["bytes_useful"] == c["unbundled"]["bytes_useful"] > 0
        assert c["bundled"]["reads"] <= c["unbundled"]["reads"]
        assert c["bundled_planned"]["reads"] <= c["bundled"]["reads"]
    assert r["fio"] == {} and png.stat().st_size > 0 and not list(tmp_path.glob("pack.unbundled*"))
    assert r["parts"] == ["sweep", "compare", "large", "experts"] and r["expert_reads"] is None
    assert {row["size"] for row in r["large_reads"]} == {64 << 10, 128 << 10, 256 << 10, 512 << 10,
                                                        1 << 20, 2 << 20, 4 << 20}
    # one section only: no sweep, no unbundled copy, no plot
    out2, png2 = tmp_path / "io2.json", tmp_path / "io2.png"
    assert main(["io", "--pack", str(pack), "--threads", "2", "--repeat", "1", "--no-fio",
                 "--parts", "large", "--large-sizes", "8K", "--large-mb", "1", "--json", str(out2),
                 "--plot", str(png2)]) == 0
    r2 = json.loads(out2.read_text())
    assert r2["parts"] == ["large"] and "chunk_sweep" not in r2 and not png2.exists()
    assert r2["large_reads"][0]["fio"] == "skipped (--no-fio)"
    with pytest.raises(SystemExit) as bad:
        main(["io", "--pack", str(pack), "--parts", "large,fast"])
    assert bad.value.code == 2


def test_profile_part_shows_the_stored_profile_and_calibrate_remeasures_its_entry_alone(
        tiny_llama, tmp_path, monkeypatch, capsys):
    from mlx_flash.bench import io as bench_io
    from mlx_flash.io import FlashLoader
    from mlx_flash.io.planner import _curve_key, calibrate, profile_file, save_cost
    from mlx_flash.io.read_cost import ReadCostCurve
    from mlx_flash.pack import read_manifest, write_pack

    monkeypatch.setenv("MLX_FLASH_HOME", str(tmp_path / "home"))
    pack = write_pack(tiny_llama("src", dtype="float16", intermediate=256), tmp_path / "pack",
                      progress=False)
    first = pack / read_manifest(pack)["bundles"][0]["file"]
    loaded = {"other_cpu_share": 0.62, "cpus": 2, "seconds": 5.0, "source": "proc_stat"}
    old = ReadCostCurve([4096, 65536], [1, 32], [[6e-5, 1e-4], [2e-5, 4e-5]], load=loaded,
                        measured="2026-11-26T05:19:00")
    for engine in ("threads", "aio"):
        save_cost(first, 2, old, engine)
    stored = json.loads(profile_file().read_text())
    stored["dev1-aio-curve"] = {**old.to_dict(), "note": "another device"}
    profile_file().write_text(json.dumps(stored))
    calls = []

    def measure(paths, depth, kind):  # the real calibration, small: this device, this engine
        calls.append(kind)
        return calibrate(tmp_path, threads=depth, sizes=(4096, 65536), depths=(1,), file_bytes=2 << 20,
                         repeats=1, max_reads=32, key_path=paths[0], engine=kind)

    monkeypatch.setattr(bench_io, "measure_cost", measure)
    out = tmp_path / "p.json"
    assert main(["io", "--pack", str(pack), "--parts", "profile", "--threads", "2", "--json", str(out)]) == 0
    r = json.loads(out.read_text())["profile"]
    assert calls == [] and r["measured"] == "2026-11-26T05:19:00" and r["load"] == loaded
    assert r["engine"] == FlashLoader(pack, threads=2, plan=False).cost_engine()  # the entry's, as stored
    assert "measured 2026-11-26T05:19:00" in r["description"] and "LOADED" in r["description"]
    assert r["description"] in capsys.readouterr().out
    # --calibrate: measured once for the run (profile and large both price reads), that entry only
    assert main(["io", "--pack", str(pack), "--parts", "profile,large", "--large-sizes", "8K",
                 "--large-mb", "1", "--repeat", "1", "--no-fio", "--threads", "2", "--calibrate",
                 "--json", str(out)]) == 0
    r = json.loads(out.read_text())["profile"]
    assert len(calls) == 1 and r["measured"] != "2026-11-26T05:19:00"
    after = json.loads(profile_file().read_text())
    key = _curve_key(first, calls[0])
    other = _curve_key(first, "aio" if calls[0] == "threads" else "threads")
    assert after[key]["measured"] == r["measured"] and after[key]["sizes"] == [4096, 65536]
    assert after[other] == stored[other] and after["dev1-aio-curve"] == stored["dev1-aio-curve"]


def test_large_reads_against_fio(tiny_llama, tmp_path, monkeypatch):
    import argparse
    import shutil

    import pytest

    from mlx_flash.bench import io as bench_io
    from mlx_flash.errors import FlashError
    from mlx_flash.io import aio
    from mlx_flash.io.files import aligned_buffer
    from mlx_flash.pack import read_manifest, write_pack

    pack = write_pack(tiny_llama("src", dtype="float16", intermediate=256), tmp_path / "pack",
                      progress=False)
    stride = read_manifest(pack)["bundles"][0]["stride"]
    parser = argparse.ArgumentParser()
    bench_io.add_arguments(parser)
    bench = bench_io.Bench(parser.parse_args(["--pack", str(pack), "--repeat", "1"]))
    sizes = [bench_io.parse_size(s) for s in ("16K", "64", "1M")]
    assert sizes == [16384, 64, 1 << 20]
    with pytest.raises(FlashError, match="--large-sizes: '4Q' is not a size"):
        bench_io.parse_size("4Q")

    buffers = []  # sizes of the engine-alone runs' buffers
    monkeypatch.setattr(bench_io, "aligned_buffer", lambda n: buffers.append(n) or aligned_buffer(n))

    def check(rows):
        ok, small, few = rows
        assert ok["bundles_per_read"] == round(16384 / stride) and ok["reads"] >= 8
        if aio.available():  # fio's footprint (depth 2), then one buffer per read
            assert buffers[-2:] == [2 * ok["read_bytes"], ok["reads"] * ok["read_bytes"]]
        assert ok["read_bytes"] >= ok["bundles_per_read"] * stride and ok["device_gbps"] > 0
        assert ok["aio_ring_gbps"] > 0 or not aio.available()  # the engine alone, fio's footprint
        assert ok["aio_dest_gbps"] > 0 or not aio.available()  # ... and the loader's footprint
        # the device profile's terms that chose zero copy or staging (io.read_cost)
        assert ok["segment_s"] >= 0 and ok["copy_bandwidth"] >= 0
        assert small == {"size": 64, "skipped": f"bundles are {stride} bytes"}
        assert few["skipped"].startswith("bundle files hold fewer than")
        return ok

    if shutil.which("fio"):  # fio reads the same files at the loader's read size and depth
        ok = check(bench_io.large_reads(bench, sizes, 2, 1 << 20, with_fio=True))
        assert ok["fio_gbps"] > 0 and f"--bs={ok['read_bytes']}" in ok["fio_command"]
        assert ok["loader_over_fio"] == ok["device_gbps"] / ok["fio_gbps"]
    monkeypatch.setattr(shutil, "which", lambda name: None)
    ok = check(bench_io.large_reads(bench, sizes, 2, 1 << 20, with_fio=True))
    assert ok["fio"] == "fio not installed" and "fio_gbps" not in ok and ok["verify"] is False
    checked = []  # --large-verify: the loaders check crc32s as a runtime does (after the reads,
    # or, for calls the kernels' AIO loop reads at once, as each read lands)
    real, real_landed = bench_io.FlashLoader._check, bench_io.FlashLoader._landed_crcs

    def landed(*a):
        crcs = real_landed(*a)
        if crcs is not None:
            checked.append(1)
        return crcs

    monkeypatch.setattr(bench_io.FlashLoader, "_check", lambda *a: checked.append(1) or real(*a))
    monkeypatch.setattr(bench_io.FlashLoader, "_landed_crcs", landed)
    ok = check(bench_io.large_reads(bench, sizes, 2, 1 << 20, with_fio=False, verify=True))
    assert ok["verify"] is True and checked
    assert bench_io.fio_throughput(bench.paths(), {4096: 1}, 2, 1 << 20) is None


def test_expert_fio_reference(tiny_llama, tmp_path, monkeypatch):
    import shutil

    import pytest

    from conftest import write_tiny_moe
    from mlx_flash.bench import io as bench_io
    from mlx_flash.errors import FlashError
    from mlx_flash.pack import read_manifest, write_pack

    pack = write_pack(write_tiny_moe(tmp_path / "moe", "olmoe", layers=2), tmp_path / "moe.pack",
                      progress=False)
    experts = [b for b in read_manifest(pack).bundles if b.kind == "experts"]
    assert len(experts) == 2 and len({(b.stride, b.count) for b in experts}) == 1
    if shutil.which("fio"):  # one read per expert block, at the depth asked for, on both files
        ref = bench_io.expert_fio_reference(pack, depth=3, total_bytes=1 << 20)
        assert ref["read_sizes"] == {experts[0].stride: 2 * experts[0].count} and ref["depth"] == 3
        assert ref["gbps"] > 0 and f"--bs={experts[0].stride}" in ref["command"]
        assert "--iodepth=3" in ref["command"] and all(b.file in ref["command"] for b in experts)
        assert bench_io.fio_ms(2e9, ref) == pytest.approx(2e3 / ref["gbps"])
    dense = write_pack(tiny_llama("src"), tmp_path / "dense.pack", progress=False)
    with pytest.raises(FlashError, match="no expert bundles"):
        bench_io.expert_fio_reference(dense, depth=3)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert bench_io.expert_fio_reference(pack, depth=3) is None


def test_expert_reads_against_fio(tiny_llama, tmp_path, monkeypatch):
    import argparse
    import shutil

    import pytest

    from conftest import write_tiny_moe
    from mlx_flash.bench import io as bench_io
    from mlx_flash.pack import read_manifest, write_pack

    def bench_of(pack):
        parser = argparse.ArgumentParser()
        bench_io.add_arguments(parser)
        return bench_io.Bench(parser.parse_args(["--pack", str(pack), "--repeat", "1"]))

    pack = write_pack(write_tiny_moe(tmp_path / "moe", "olmoe", layers=2, top_k=2),
                      tmp_path / "moe.pack", progress=False)
    stride = next(b.stride for b in read_manifest(pack).bundles if b.kind == "experts")
    bench = bench_of(pack)
    if shutil.which("fio"):
        row = bench_io.expert_reads(bench, 1 << 20, with_fio=True)
        assert row["top_k"] == 2 and row["block_bytes"] == stride and row["calls"] >= 4
        assert row["ms_per_call"] > 0 and row["device_gbps"] > 0
        assert row["fio_ms_per_call"] == pytest.approx(2 * stride / row["fio_gbps"] / 1e6)
        assert row["over_fio"] == pytest.approx(row["ms_per_call"] / row["fio_ms_per_call"])
        assert f"--bs={stride}" in row["fio_command"] and "--iodepth=2" in row["fio_command"]
        one = bench_io.expert_reads(bench, 1 << 20, with_fio=True, per_call=1)  # a cached runtime's miss
        assert one["top_k"] == 1 and "--iodepth=1" in one["fio_command"] and one["calls"] >= 4
    monkeypatch.setattr(shutil, "which", lambda name: None)
    row = bench_io.expert_reads(bench, 1 << 20, with_fio=True)
    assert row["fio"] == "fio not installed" and "over_fio" not in row
    dense = write_pack(tiny_llama("src"), tmp_path / "dense.pack", progress=False)
    assert bench_io.expert_reads(bench_of(dense), 1 << 20, with_fio=False) is None


def test_baseline_loader_takes_turns(tiny_llama, tmp_path, monkeypatch):
    """--baseline DIR: another checkout's FlashLoader (here this one's, imported again as
    mlx_flash_baseline) runs in the large and experts parts next to this one and fio."""
    import argparse
    import shutil
    import sys
    from pathlib import Path

    import pytest

    import mlx_flash
    from conftest import write_tiny_moe
    from mlx_flash.bench import io as bench_io
    from mlx_flash.errors import FlashError
    from mlx_flash.pack import write_pack

    root = Path(mlx_flash.__file__).parents[1]
    pack = write_pack(write_tiny_moe(tmp_path / "moe", "olmoe", layers=2, top_k=2),
                      tmp_path / "moe.pack", progress=False)
    parser = argparse.ArgumentParser()
    bench_io.add_arguments(parser)
    bench = bench_io.Bench(parser.parse_args(["--pack", str(pack), "--repeat", "1",
                                              "--baseline", str(root)]))
    assert bench.baseline.__module__ == "mlx_flash_baseline.io.loader"
    assert bench.baseline is not bench_io.FlashLoader and "mlx_flash_baseline.io" in sys.modules
    with_fio = shutil.which("fio") is not None
    stride = max(b.stride for b in bench.manifest.bundles)
    row = bench_io.large_reads(bench, [2 * stride], 2, 1 << 20, with_fio=with_fio)[0]
    assert row["baseline_gbps"] > 0 and (not with_fio or row["baseline_over_fio"] > 0)
    experts = bench_io.expert_reads(bench, 1 << 20, with_fio=with_fio)
    assert experts["baseline_ms_per_call"] > 0
    assert not with_fio or experts["baseline_over_fio"] == pytest.approx(
        experts["baseline_ms_per_call"] / experts["fio_ms_per_call"])
    with pytest.raises(FlashError, match="--baseline .*: no mlx_flash/io/loader.py there"):
        bench_io.baseline_loader(tmp_path)


def tiny_bench(tiny_llama, tmp_path):
    """A bench.io Bench (--repeat 1) on a float16 pack of a tiny llama."""
    import argparse

    from mlx_flash.bench import io as bench_io
    from mlx_flash.pack import write_pack

    pack = write_pack(tiny_llama("src", dtype="float16", intermediate=256), tmp_path / "pack",
                      progress=False)
    parser = argparse.ArgumentParser()
    bench_io.add_arguments(parser)
    return bench_io.Bench(parser.parse_args(["--pack", str(pack), "--repeat", "1"]))


def test_destination_kinds(tiny_llama, tmp_path):
    """--parts dest: the AIO engine alone into memory of each kind, next to fio."""
    import shutil

    import pytest

    from mlx_flash.bench import io as bench_io
    from mlx_flash.io import aio

    if not aio.available():
        pytest.skip("native AIO: Linux")
    bench = tiny_bench(tiny_llama, tmp_path)
    rows = bench_io.destination_kinds(bench, [16384, 1 << 30], 2, 1 << 20, with_fio=bool(shutil.which("fio")))
    ok, big = rows
    assert ok["size"] == 16384 and ok["reads"] == 64 and ok["depth"] == 2
    for kind in bench_io.DEST_KINDS:
        assert ok[f"{kind}_gbps"] > 0
        if shutil.which("fio"):
            assert ok[f"{kind}_over_fio"] == ok[f"{kind}_gbps"] / ok["fio_gbps"]
    assert big == {"size": 1 << 30, "skipped": "bundle files are smaller than one read"}
    # the bytes land where each kind says: read i at addresses[i]
    path = bench.paths()[0]
    buf = np.zeros(3 * 16384 + 4096, np.uint8)
    base = buf.ctypes.data + (-buf.ctypes.data % 4096)
    run = bench_io.aio_reads([path], 16384, 3, 2, np.random.default_rng(0), base + np.arange(3) * 16384)
    assert run.bytes_read == 3 * 16384 and buf.any()


def test_segment_kinds_land_the_same_bytes_as_one_piece(tiny_llama, tmp_path):
    """--parts segments: the same reads as 1, 3 or size / 4 KiB iovec segments, next to fio; each
    kind puts every 4 KiB piece of the file where io.read_cost.segment_iovecs says."""
    import shutil

    import pytest

    from mlx_flash.bench import io as bench_io
    from mlx_flash.io import aio
    from mlx_flash.io.read_cost import segment_iovecs

    if not aio.available():
        pytest.skip("native AIO: Linux")
    bench = tiny_bench(tiny_llama, tmp_path)
    with_fio = bool(shutil.which("fio"))
    (row,) = bench_io.destination_kinds(bench, [20480], 2, 1 << 20, with_fio, bench_io.SEGMENT_KINDS)
    assert row["size"] == 20480 and row["reads"] == 51
    for kind in bench_io.SEGMENT_KINDS:
        assert row[f"{kind}_gbps"] > 0
        assert (f"{kind}_over_fio" in row) == with_fio
    # a file of one read plus a block: every read is at offset 0, so each lands the same bytes
    src = tmp_path / "one.bin"
    data = np.random.default_rng(1).integers(0, 256, 5 * 4096 + 4096, np.uint8)
    src.write_bytes(data.tobytes())
    for kind in bench_io.VECTORED_KINDS:
        buf = np.zeros(2 * (5 * 4096 + 2 * 4096) + 4096, np.uint8)
        base = buf.ctypes.data + (-buf.ctypes.data % 4096)
        iov = segment_iovecs(kind, base, 5 * 4096, 2)
        per = len(iov) // 2
        got = bench_io.aio_reads([src], 5 * 4096, 2, 2, np.random.default_rng(0),
                                 iov.ctypes.data + np.arange(2) * per * aio.IOVEC.itemsize, iovecs=(iov, per))
        assert got.bytes_read == 2 * 5 * 4096
        skip = base - buf.ctypes.data
        for read in range(2):
            pos = 0
            for piece in iov[read * per: (read + 1) * per]:
                at, n = int(piece["base"] - base) + skip, int(piece["len"])
                assert (buf[at: at + n] == data[pos: pos + n]).all(), kind
                pos += n
            assert pos == 5 * 4096


def test_landing_paths_run_both_paths_of_the_loader(tiny_llama, tmp_path, capsys):
    """--landing-paths: this loader with zero copy forced and with staging forced, next to the
    one the device profile chose, on a pack whose 4 KiB rows can land zero copy."""
    import argparse

    from mlx_flash.bench import io as bench_io
    from mlx_flash.pack import write_pack

    pack = write_pack(tiny_llama("src", dtype="float32", hidden=1024, intermediate=64, layers=2, vocab=16),
                      tmp_path / "pack", progress=False)
    parser = argparse.ArgumentParser()
    bench_io.add_arguments(parser)
    bench = bench_io.Bench(parser.parse_args(["--pack", str(pack), "--repeat", "1", "--landing-paths"]))
    (row,) = bench_io.large_reads(bench, [4 * 12288], 2, 1 << 20, with_fio=False, landing_paths=True)
    assert row["bundles_per_read"] == 4 and row["zero_copy_gbps"] > 0 and row["staged_gbps"] > 0
    if not row["direct"]:
        pytest.skip("filesystem refuses O_DIRECT")
    assert row["zero_copy_zero_copy_reads"] == row["reads"] and row["staged_zero_copy_reads"] == 0
    # what the profile adds per read on either path: 4 bundles of gate / up / down rows
    assert row["segments_per_read"] == 12 and row["read_s"] > 0
    assert all(row[f"{name}_cpu_us_per_read"] > 0 for name in ("loader", "zero_copy", "staged"))
    assert row["zero_copy_extra_s"] == pytest.approx(11 * row["segment_s"])
    if row["copy_bandwidth"] > 0:
        assert row["staged_extra_s"] == pytest.approx(row["read_bytes"] / row["copy_bandwidth"])
    bench_io.print_large_reads([row], 2)
    out = capsys.readouterr().out
    assert "zero-copy / staged: this loader with that path forced" in out
    header = next(line for line in out.splitlines() if line.split()[:2] == ["size", "k"])
    assert header.split()[-4:] == ["zero-copy", "/fio", "staged", "/fio"]
    assert "CPU per read, microseconds" in out and "zero copy " in out.splitlines()[-1]


def test_fio_cpu_time_comes_from_its_json(monkeypatch):
    """run_fio: fio's user + system CPU seconds from its JSON (percentages of its run time)."""
    from mlx_flash.bench import io as bench_io

    out = json.dumps({"jobs": [{"job_runtime": 200, "usr_cpu": 10.0, "sys_cpu": 30.0,
                                "read": {"bw_bytes": 1e9, "iops": 1000, "io_bytes": 2e8}}]})
    monkeypatch.setattr(bench_io.subprocess, "run",
                        lambda *a, **k: type("P", (), {"returncode": 0, "stdout": out, "stderr": ""})())
    r = bench_io.run_fio(["fio"])
    assert r.cpu_s == pytest.approx(0.08) and r.seconds == pytest.approx(0.2)


def test_fio_read_size_mix_sums_to_100_percent_and_keeps_the_mean_size():
    from mlx_flash.bench.io import BSSPLIT_SIZES, bssplit, fio_command

    assert bssplit({4096: 3, 8192: 1}) == [(4096, 75), (8192, 25)]
    assert bssplit({1 << 20: 5}) == [(1 << 20, 100)]
    # a flash row's mix: ~150 merged read sizes, most of them a handful of reads each
    rng = np.random.default_rng(0)
    mix = {int(b) * 4096: int(n) for b, n in zip(rng.choice(np.arange(1, 257), 150, replace=False),
                                                  rng.integers(1, 60, 150))}
    split = bssplit(mix)
    sizes, pct = np.array(split).T
    assert pct.sum() == 100 and (pct >= 1).all() and len(split) <= BSSPLIT_SIZES
    assert (sizes % 4096 == 0).all() and (np.diff(sizes) > 0).all()
    mean = sum(k * v for k, v in mix.items()) / sum(mix.values())
    assert abs((sizes * pct).sum() / 100 / mean - 1) < 0.03
    cmd = fio_command(["/dev/null"], 7, mix, 1 << 20, "libaio")
    if cmd is not None:  # fio installed: its split is this one
        (arg,) = [a for a in cmd if a.startswith("--bssplit=")]
        assert arg == "--bssplit=" + ":".join(f"{s}/{p}" for s, p in split)


def test_fio_reads_the_mix_it_is_given(tmp_path):
    import shutil

    from mlx_flash.bench.io import fio_throughput

    if shutil.which("fio") is None:
        pytest.skip("fio is not installed (apt-get install fio)")
    f = tmp_path / "bundles.bin"
    f.write_bytes(np.random.default_rng(0).integers(0, 256, 8 << 20, np.uint8).tobytes())
    ref = fio_throughput([f], {4096: 3, 262144: 1}, 4, 16 << 20)
    mean = ref["gbps"] * 1e9 / ref["iops"]  # bytes per read fio issued: (3 x 4 KiB + 256 KiB) / 4
    assert abs(mean / ((3 * 4096 + 262144) / 4) - 1) < 0.15, ref
