"""io/read_cost: the piecewise read-cost curve (sizes x depths) and its cold measurement."""

import time

import numpy as np
import pytest

from mlx_flash.io.read_cost import ReadCostCurve, measure_curve

# seconds per read: 17 us at 4 KiB, 31 us at 64 KiB, 338 us at 256 KiB at depth 32 (the issue's
# figures), four times that at depth 1
SIZES, DEPTHS = [4096, 65536, 262144], [1, 32]
TABLE = [[68e-6, 124e-6, 1352e-6], [17e-6, 31e-6, 338e-6]]


def test_curve_is_piecewise_linear_in_size_and_log_depth():
    c = ReadCostCurve(SIZES, DEPTHS, TABLE, depth=32)
    assert c.seconds(4096) == pytest.approx(17e-6) and c.seconds(65536) == pytest.approx(31e-6)
    assert c.seconds(1024) == pytest.approx(17e-6)  # below the smallest size: one block's cost
    assert c.seconds((4096 + 65536) / 2) == pytest.approx(24e-6)
    slope = (338e-6 - 31e-6) / (262144 - 65536)
    assert c.seconds(262144 + 1000) == pytest.approx(338e-6 + 1000 * slope)  # streaming beyond
    np.testing.assert_allclose(c.seconds(np.array([4096, 262144])), [17e-6, 338e-6])
    assert c.bandwidth == pytest.approx(1 / slope)
    # depth 4 is 2/5 of the way from 1 to 32 in log2
    assert c.at_depth(4).seconds(4096) == pytest.approx(68e-6 + 0.4 * (17e-6 - 68e-6))
    assert c.at_depth(64).seconds(4096) == pytest.approx(17e-6)  # clamped to the measured depths
    assert ReadCostCurve.from_dict(c.to_dict(), depth=32).seconds(100000) == c.seconds(100000)


def test_merge_gap_is_where_one_read_beats_two():
    c = ReadCostCurve(SIZES, DEPTHS, TABLE, depth=32)
    gap = c.merge_gap_for(1024)
    assert gap % 4096 == 0 and gap > 0
    assert c.seconds(2048 + gap) <= 2 * c.seconds(1024) < c.seconds(2048 + gap + 4096)
    # a flat curve (cost independent of size up to 256 KiB) reads through any gap up to it
    flat = ReadCostCurve(SIZES, DEPTHS, [[1e-4] * 3, [1e-4] * 3], depth=32)
    assert flat.merge_gap_for(4096) >= 262144 - 8192
    # a cost proportional to bytes (no per-read cost) never merges across a gap
    linear = ReadCostCurve(SIZES, DEPTHS, [[s * 1e-9 for s in SIZES]] * 2, depth=32)
    assert linear.merge_gap_for(4096) == 0


def test_bad_tables_are_refused():
    with pytest.raises(ValueError, match="does not match"):
        ReadCostCurve(SIZES, DEPTHS, [[1.0, 2.0]])


def test_measure_curve_on_a_scratch_file(tmp_path):
    c = measure_curve(tmp_path, sizes=(4096, 65536), depths=(1, 4), file_bytes=4 << 20, repeats=1,
                      max_reads=64)
    t = np.asarray(c.table)
    assert t.shape == (2, 2) and (t > 0).all() and (np.diff(t, axis=1) >= 0).all()
    assert not list(tmp_path.iterdir())  # the scratch file is gone


def test_planner_merges_by_the_curves_gap_for_the_request_size():
    from mlx_flash.io.planner import plan_reads

    c = ReadCostCurve(SIZES, DEPTHS, TABLE, depth=32)
    gap = c.merge_gap_for(1024)
    starts = [0, 1024 + gap, 2 * 1024 + 2 * gap + 4096]  # the second gap is one block too wide
    assert [r[2] for r in plan_reads(starts, 1024, cost=c)] == [[0, 1], [2]]
    assert c.merge_gap_for(65536) < gap  # larger requests: reading through a gap is worth less


def test_staging_is_chosen_when_it_clearly_saves_read_time():
    from mlx_flash.io.planner import ReadCost
    from mlx_flash.io.read_cost import STAGE_MIN_GAIN, stage_saves_time

    assert STAGE_MIN_GAIN == 0.1
    # a 64 KiB read (31 us) landing as 16 pieces: + 15 x 1 us; staged: + the time the copy adds
    c = ReadCostCurve(SIZES, DEPTHS, TABLE, depth=32, segment_s=1e-6, copy_bandwidth=8e9)  # 8.2 us
    assert stage_saves_time(c, np.array([65536]), np.array([16]))  # 39.2 < 0.9 x 46
    assert not stage_saves_time(c, np.array([65536]), np.array([1]))  # one piece: nothing to save
    slow_copy = ReadCostCurve(SIZES, DEPTHS, TABLE, segment_s=1e-6, copy_bandwidth=1.5e9)  # 43.7 us
    assert not stage_saves_time(slow_copy, [65536], [16])  # the copy adds more than it saves
    # a 4 MiB expert block in 3 pieces (gate, up, down): 2 us more on 6.5 ms is no reason to copy
    assert not stage_saves_time(c, [4 << 20], [3])
    # one 12 KiB bundle (18.9 us) in 3 pieces: staging's 20.4 us vs + 2 us (20.9) or + 4 us (22.9)
    assert not stage_saves_time(c, [12288], [3])
    assert stage_saves_time(ReadCostCurve(SIZES, DEPTHS, TABLE, segment_s=2e-6, copy_bandwidth=8e9),
                            [12288], [3])
    assert stage_saves_time(c, [65536, 4 << 20], [16, 3]) is False  # priced over all the reads
    for unmeasured in (ReadCostCurve(SIZES, DEPTHS, TABLE), ReadCost(1e-5, 1e9), None):
        assert not stage_saves_time(unmeasured, [65536], [16])
    assert stage_saves_time(ReadCost(1e-5, 1e9, 1e-6, 2e10), [65536], [16])  # 78.8 < 0.9 x 90.5 us
    assert not stage_saves_time(c, [], [])
    # the terms survive the profile round trip and a change of depth
    back = ReadCostCurve.from_dict(c.to_dict(), depth=4)
    assert (back.segment_s, back.copy_bandwidth) == (1e-6, 8e9) == (c.at_depth(1).segment_s, 8e9)
    assert ReadCostCurve.from_dict({"sizes": SIZES, "depths": DEPTHS, "table": TABLE}).segment_s == 0


@pytest.mark.parametrize("kind,want", [
    # 5 pieces of 4 KiB per read, 2 reads: rows = 2 per array per read
    ("dest_scattered", [[0, 4, 8, 1, 5], [2, 6, 10, 3, 7]]),
    ("dest_adjacent", [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]),
    ("dest_thirds", [[0, 4, 8], [2, 6, 10]]),
])
def test_segment_iovecs(kind, want):
    from mlx_flash.io.read_cost import segment_iovecs

    iov = segment_iovecs(kind, 1 << 20, 5 * 4096, 2)
    assert ((iov["base"] - (1 << 20)) // 4096).reshape(2, -1).tolist() == want
    lens = iov["len"].reshape(2, -1) // 4096
    assert (lens.sum(axis=1) == 5).all()
    assert lens[0].tolist() == ([2, 2, 1] if kind == "dest_thirds" else [1] * 5)


def test_measure_curve_with_aio_prices_segments_and_the_copy(tmp_path):
    from mlx_flash.io import aio

    c = measure_curve(tmp_path, sizes=(4096, 65536), depths=(4,), file_bytes=8 << 20, repeats=1,
                      max_reads=64, engine="aio")
    if c.engine != "aio" or not aio.available():
        pytest.skip("native AIO with O_DIRECT")
    assert c.segment_s >= 0 and 1e8 < c.copy_bandwidth <= 1e12
    assert not list(tmp_path.iterdir())


def test_segment_and_copy_terms_are_median_differences(tmp_path, monkeypatch):
    from mlx_flash.io import aio, read_cost

    # per read at 64 KiB (16 pieces): one piece 100 us; scattered + 15 us; staged + 32.77 us
    # (65536 bytes at 2 GB/s); one round of five a wild outlier
    rounds = iter([(1e-4, 1.15e-4, 1.32768e-4)] * 4 + [(1e-4, 9e-4, 9e-4)])
    monkeypatch.setattr(read_cost, "timed_segment_reads", lambda *a: next(rounds))
    c = measure_curve(tmp_path, sizes=(4096, 65536), depths=(4,), file_bytes=1 << 20, repeats=1,
                      max_reads=16, engine="aio")
    if c.engine != "aio" or not aio.available():
        pytest.skip("native AIO with O_DIRECT")
    assert c.segment_s == pytest.approx(1e-6) and c.copy_bandwidth == pytest.approx(2e9)


def test_staged_rows_are_copied_on_finishing_threads_while_reads_are_submitted(tmp_path):
    """The copy term prices staging as the loader does it: rows copied out on FINISH_THREADS
    threads (a spare core hides them) while reads remain to be submitted, on the reaping thread
    after that."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from mlx_flash.io import aio, read_cost
    from mlx_flash.io.files import FileLayer

    if not aio.available():
        pytest.skip("native AIO")
    path = tmp_path / "blocks.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4 << 20, np.uint8).tobytes())
    files = FileLayer()
    fd, direct = files.open(path, True)
    if not direct:
        files.close(fd)
        pytest.skip("O_DIRECT refused")
    copied, submitted = [], []

    class CountingPool(ThreadPoolExecutor):
        def submit(self, fn, *args):
            submitted.append(len(args[0]))
            return super().submit(lambda idx: (copied.append(threading.current_thread().name), fn(idx)),
                                  *args)

    ctx = aio.AioContext(4)
    try:
        with CountingPool(read_cost.FINISH_THREADS, thread_name_prefix="finish") as pool:
            times = read_cost.timed_segment_reads(fd, path, 4 << 20, 65536, 32, ctx, pool)
    finally:
        ctx.close()
        files.close(fd)
    assert len(times) == 3 and min(times) > 0
    assert read_cost.FINISH_THREADS == 2 and submitted and 0 < sum(submitted) < 32  # the tail inline
    assert len(copied) == len(submitted) and all(name.startswith("finish") for name in copied)


def test_landing_terms_follow_the_read_size():
    """Segment and copy terms measured at two sizes (a read of more pieces than the device takes per
    request is split, so segments cost more in large reads) price each read at its own size:
    linear in log2(size) between them, the nearest one outside; the decision follows."""
    from mlx_flash.io.read_cost import landing_terms, stage_saves_time

    landing = {"sizes": [262144, 1048576], "segment_s": [0.5e-6, 2.5e-6], "copy_bandwidth": [2e9, 4e9]}
    c = ReadCostCurve(SIZES, DEPTHS, TABLE, depth=32, segment_s=0.5e-6, copy_bandwidth=2e9, landing=landing)
    seg, copy = landing_terms(c, np.array([65536, 262144, 524288, 1048576, 4 << 20]))
    np.testing.assert_allclose(seg, [0.5e-6, 0.5e-6, 1.5e-6, 2.5e-6, 2.5e-6])
    np.testing.assert_allclose(copy, [0.5e-9, 0.5e-9, 0.375e-9, 0.25e-9, 0.25e-9])
    # 4 KiB pieces: at 256 KiB 63 x 0.5 us = 31.5 us vs a copy of 131 us: zero copy; at 4 MiB
    # 1023 x 2.5 us = 2.56 ms vs 1.05 ms: staged
    assert not stage_saves_time(c, [262144], [64])
    assert stage_saves_time(c, [4 << 20], [1024])
    flat = ReadCostCurve(SIZES, DEPTHS, TABLE, depth=32, segment_s=0.5e-6, copy_bandwidth=2e9)
    assert not stage_saves_time(flat, [4 << 20], [1024])  # one size's terms everywhere
    back = ReadCostCurve.from_dict(c.to_dict(), depth=4)
    assert back.landing == landing and back.at_depth(32).landing == landing
    np.testing.assert_allclose(landing_terms(flat, [65536]), [[0.5e-6], [0.5e-9]])
    assert stage_saves_time(None, [65536], [16]) is False


def test_landing_terms_are_measured_at_each_landing_size(tmp_path, monkeypatch):
    from mlx_flash.io import aio, read_cost

    # per read: scattered pieces add 1 ns per piece at 64 KiB, 3 ns at 256 KiB; the copy 1 s/GB
    def rounds(fd, path, file_bytes, size, n, ctx):
        return 1e-4, 1e-4 + (size // 4096 - 1) * (1e-9 if size == 65536 else 3e-9), 1e-4 + size / 1e9

    monkeypatch.setattr(read_cost, "timed_segment_reads", rounds)
    monkeypatch.setattr(read_cost, "LANDING_SIZES", (65536, 262144))
    c = measure_curve(tmp_path, sizes=(4096, 262144), depths=(4,), file_bytes=1 << 20, repeats=1,
                      max_reads=16, engine="aio")
    if c.engine != "aio" or not aio.available():
        pytest.skip("native AIO with O_DIRECT")
    assert c.landing["sizes"] == [65536, 262144]
    np.testing.assert_allclose(c.landing["segment_s"], [1e-9, 3e-9])
    np.testing.assert_allclose(c.landing["copy_bandwidth"], [1e9, 1e9])
    assert (c.segment_s, c.copy_bandwidth) == (c.landing["segment_s"][0], c.landing["copy_bandwidth"][0])


def test_load_share_is_other_processes_cpu_time_over_ours():
    """Two samples 2 s apart on 1 CPU: 1.5 s busy of which 0.5 s ours -> others took half."""
    from mlx_flash.io.read_cost import load_since

    start = {"t": 10.0, "cpus": [0], "busy": 100.0, "own": 3.0, "loadavg": 5.0}
    end = {"t": 12.0, "cpus": [0], "busy": 101.5, "own": 3.5, "loadavg": 5.0}
    assert load_since(start, end) == {"other_cpu_share": 0.5, "cpus": 1, "seconds": 2.0, "source": "proc_stat"}
    # two CPUs: the same time is a quarter of their capacity
    assert load_since({**start, "cpus": [0, 1]}, end)["other_cpu_share"] == 0.25
    # without /proc/stat (macOS): the 1-minute load average per CPU before measuring, capped at 1
    no_stat = load_since({**start, "busy": None, "cpus": [0, 1, 2, 3, 4, 5, 6, 7]}, {**end, "busy": None})
    assert no_stat["other_cpu_share"] == 0.625 and no_stat["source"] == "loadavg"


def test_a_busy_cpu_is_measured_as_load():
    """A spinning process on every CPU this process may use: others took most of their time."""
    import os
    import subprocess
    import sys
    import time

    from mlx_flash.io.read_cost import load_sample, load_since

    if not os.path.exists("/proc/stat"):
        pytest.skip("/proc/stat")
    cpus = sorted(os.sched_getaffinity(0))[:8]
    hogs = [subprocess.Popen(["taskset", "-c", str(c), sys.executable, "-c", "while True: pass"])
            for c in cpus]
    try:
        time.sleep(0.2)
        start = load_sample()
        time.sleep(0.5)
        load = load_since(start)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    assert load["source"] == "proc_stat" and load["other_cpu_share"] >= 0.6


def test_measured_load_is_stored_and_read_back(tmp_path, monkeypatch):
    from mlx_flash.io.planner import calibrate, load_cost

    monkeypatch.setenv("MLX_FLASH_HOME", str(tmp_path / "home"))
    c = calibrate(tmp_path, threads=4, sizes=(4096, 65536), depths=(1,), file_bytes=2 << 20,
                  repeats=1, max_reads=32)
    assert 0 <= c.load["other_cpu_share"] <= 1 and c.load["seconds"] > 0 and c.load["cpus"] >= 1
    assert load_cost(tmp_path, 4).load == c.load
    assert ReadCostCurve.from_dict(c.to_dict()).at_depth(1).load == c.load
    # and when: stamped at measurement, stored as measured, carried to every depth
    assert c.measured[:10] == time.strftime("%Y-%m-%d")
    assert load_cost(tmp_path, 4).measured == c.measured
    assert ReadCostCurve.from_dict(c.to_dict()).at_depth(1).measured == c.measured


def _store(home, path, load):
    """An io_profile.json holding one threads-engine curve for the device of `path`."""
    import json

    from mlx_flash.io.planner import _curve_key

    home.mkdir(parents=True, exist_ok=True)
    entry = {"sizes": SIZES, "depths": DEPTHS, "table": TABLE, "measured": "2026-11-26T05:19:00"}
    if load is not None:
        entry["load"] = load
    (home / "io_profile.json").write_text(json.dumps({_curve_key(path, "threads"): entry}))
    return home / "io_profile.json"


def test_a_profile_stored_without_its_load_loads_as_unknown(tmp_path, monkeypatch, capsys):
    from mlx_flash.io.planner import load_cost
    from mlx_flash.io.read_cost import describe_load

    monkeypatch.setenv("MLX_FLASH_HOME", str(tmp_path / "home"))
    _store(tmp_path / "home", tmp_path, None)
    c = load_cost(tmp_path, 32)
    assert c.seconds(4096) == pytest.approx(17e-6) and c.load is None
    assert "unknown" in describe_load(c.load) and capsys.readouterr().err == ""


def test_a_profile_measured_loaded_warns_once_and_an_idle_one_never(tmp_path, monkeypatch, capsys):
    from mlx_flash.io import read_cost
    from mlx_flash.io.planner import load_cost

    monkeypatch.setattr(read_cost, "_warned", set())
    monkeypatch.setenv("MLX_FLASH_HOME", str(tmp_path / "home"))
    assert read_cost.LOADED_SHARE == 0.25
    idle = {"other_cpu_share": 0.2, "cpus": 1, "seconds": 9.0, "source": "proc_stat"}
    _store(tmp_path / "home", tmp_path, idle)
    assert load_cost(tmp_path, 32).load == idle and capsys.readouterr().err == ""
    f = _store(tmp_path / "home", tmp_path, {**idle, "other_cpu_share": 0.62})
    c = load_cost(tmp_path, 32)
    err = capsys.readouterr().err.strip().splitlines()
    assert c.seconds(4096) == pytest.approx(17e-6)  # still used
    assert len(err) == 1 and str(f) in err[0] and "62%" in err[0] and "2026-11-26T05:19:00" in err[0]
    assert f"`{read_cost.REMEASURE_COMMAND}`" in err[0] and "--parts profile --calibrate" in err[0]
    load_cost(tmp_path, 32)
    assert capsys.readouterr().err == ""  # once per process
    assert "LOADED" in read_cost.describe_load(c.load)


def test_describe_profile_names_the_date_and_the_load():
    from mlx_flash.io.planner import ReadCost
    from mlx_flash.io.read_cost import describe_profile

    loaded = {"other_cpu_share": 0.62, "cpus": 2, "seconds": 5.3, "source": "proc_stat"}
    c = ReadCostCurve(SIZES, DEPTHS, TABLE, load=loaded, measured="2026-11-26T05:19:00").at_depth(4)
    line = describe_profile(c, "/h/io_profile.json")
    assert line.startswith("read-cost profile /h/io_profile.json: measured 2026-11-26T05:19:00, ")
    assert "62% of 2 CPU(s)" in line and "LOADED" in line
    assert "date not recorded" in describe_profile(ReadCost(1e-4, 1e9)) and "unknown" in describe_profile(ReadCost(1e-4, 1e9))
    assert "none stored" in describe_profile(None)


def test_old_and_new_profiles_price_reads_identically():
    """A profile stored before the per-size terms (scalars only) and one with `landing` holding the
    same terms price every read alike; with `landing` the scalars are derived from its first size
    (what an older reader of the stored profile prices with); unmeasured terms are 0."""
    from mlx_flash.io.read_cost import landing_terms, stage_saves_time

    reads = np.array([4096, 65536, 262144, 524288, 1 << 20, 4 << 20])
    base = {"sizes": SIZES, "depths": DEPTHS, "table": TABLE}
    old = ReadCostCurve.from_dict({**base, "segment_s": 1e-6, "copy_bandwidth": 8e9})
    for sizes in ([262144], [262144, 1048576]):
        new = ReadCostCurve.from_dict({**base, "landing": {"sizes": sizes, "segment_s": [1e-6] * len(sizes),
                                                           "copy_bandwidth": [8e9] * len(sizes)}})
        assert (new.segment_s, new.copy_bandwidth) == (old.segment_s, old.copy_bandwidth) == (1e-6, 8e9)
        np.testing.assert_array_equal(landing_terms(new, reads), landing_terms(old, reads))
        for pieces in (1, 3, 16, 1024):
            assert stage_saves_time(new, reads, [pieces] * len(reads)) == \
                stage_saves_time(old, reads, [pieces] * len(reads))
    np.testing.assert_array_equal(landing_terms(old, reads), [np.full(6, 1e-6), np.full(6, 1 / 8e9)])
    varied = {"sizes": [262144, 1048576], "segment_s": [0.5e-6, 2.5e-6], "copy_bandwidth": [2e9, 4e9]}
    d = ReadCostCurve.from_dict({**base, "landing": varied}).at_depth(4).to_dict()
    assert (d["segment_s"], d["copy_bandwidth"], d["landing"]) == (0.5e-6, 2e9, varied)
    np.testing.assert_array_equal(landing_terms(ReadCostCurve.from_dict(base), reads), np.zeros((2, 6)))
