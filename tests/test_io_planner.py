"""io/planner.py: reads merged by the measured cost model; the cost model measured and stored."""

import numpy as np
import pytest

from mlx_flash.errors import FlashError
from mlx_flash.io import ReadCost, aio, calibrate, load_cost, plan_reads, planner


def test_planner_merges_by_cost():
    starts = [0, 1000, 9000, 200_000, 210_000]
    assert [r[2] for r in plan_reads(starts, 1000)] == [[0], [1], [2], [3], [4]]
    merged = plan_reads(starts, 1000, cost=ReadCost(1e-5, 1e9))  # merge gaps <= 10 kB
    assert [(r[0], r[1], r[2]) for r in merged] == [(0, 10000, [0, 1, 2]), (200_000, 211_000, [3, 4])]
    aligned = plan_reads(starts, 1000, align=4096, cost=ReadCost(1e-9, 1e9))  # 1-byte gaps only
    assert aligned[0] == (0, 4096, [0, 1]) and aligned[1] == (8192, 12288, [2])
    capped = plan_reads(list(range(0, 100_000, 1000)), 1000, cost=ReadCost(1, 1e9), max_read=16_000)
    assert all(r[1] - r[0] <= 16_000 for r in capped) and sum(len(r[2]) for r in capped) == 100


@pytest.mark.parametrize("engine", ["threads", "aio"])
def test_calibrate_and_profile(tmp_path, monkeypatch, engine):
    monkeypatch.setenv("MLX_FLASH_HOME", str(tmp_path / "home"))
    cost = calibrate(tmp_path, threads=4, file_bytes=8 << 20, sizes=(4096, 65536), depths=(1,),
                     max_reads=64, repeats=1, engine=engine)
    assert cost.depths == [1, 4] and cost.seconds(4096) > 0 and cost.bandwidth > 0
    stored = [k for k in ("aio", "threads") if load_cost(tmp_path, 4, k) == cost]
    # one curve per device and engine, priced at any depth
    assert len(stored) == 1 and load_cost(tmp_path, 8, stored[0]).depth == 8
    if engine == "threads" or not aio.available():
        assert stored == ["threads"]
    assert not list(tmp_path.glob(".mlx_flash_read_cost_*"))


@pytest.mark.parametrize("content, reason", [
    (b"{not json", "not JSON"), (b"[1, 2]", "not a JSON object"), (b"\xff\xfe", "not JSON"),
    ("curve-list", "damaged entry (TypeError"), ("curve-table", "damaged entry (ValueError"),
    ("line-keys", "damaged entry (KeyError"), ("line-value", "damaged entry (ValueError"),
])
def test_a_damaged_profile_counts_as_none_named_on_one_line_and_is_rewritten(tmp_path, monkeypatch, capsys,
                                                                              content, reason):
    import json

    from mlx_flash.io.read_cost import ReadCostCurve

    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("MLX_FLASH_HOME", str(home))
    f = home / "io_profile.json"
    curve_key, line_key = planner._curve_key(tmp_path, "threads"), planner._profile_key(tmp_path, 4, "threads")
    if isinstance(content, bytes):
        f.write_bytes(content)
    else:
        f.write_text(json.dumps({
            "curve-list": {curve_key: [1, 2]},
            "curve-table": {curve_key: {"sizes": [4096, 65536], "depths": [1], "table": [[1e-5]]}},
            "line-keys": {line_key: {"latency": 1e-5}},
            "line-value": {line_key: {"latency_s": "fast", "bandwidth": 1e9}},
        }[content]))
    assert load_cost(tmp_path, 4) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(f) in err[0] and reason in err[0] and "measured again" in err[0], err
    # the next save (a measured curve, as calibrate stores it) rewrites it, silently
    good = ReadCostCurve([4096, 65536], [1, 4], [[2e-5, 6e-5], [1e-5, 3e-5]], 4)
    planner.save_cost(tmp_path, 4, good)
    assert load_cost(tmp_path, 4) == good and capsys.readouterr().err == ""


def test_no_profile_stored_is_none_without_a_word(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLX_FLASH_HOME", str(tmp_path / "home"))
    assert load_cost(tmp_path, 4) is None and capsys.readouterr().err == ""


def greedy_reference(starts, length, align, merge_gap, max_read):
    """The planner's rule, one request at a time: join the open read when the gap is at most
    merge_gap and the read stays <= max_read."""
    reads = []
    for i, s in enumerate(starts):
        a0, a1 = s // align * align, -(-(s + length) // align) * align
        if reads and a0 - reads[-1][1] <= merge_gap and a1 - reads[-1][0] <= max_read:
            reads[-1][1], reads[-1][2] = a1, reads[-1][2] + [i]
        else:
            reads.append([a0, a1, [i]])
    return [tuple(r) for r in reads]


def test_only_runs_longer_than_max_read_are_split():
    # runs of touching 12 KiB bundles of 1-40 bundles at random places: short runs stay one read,
    # long ones are cut greedily at max_read, exactly as the one-at-a-time rule does
    rng = np.random.default_rng(0)
    starts, pos = [], 0
    for run in rng.integers(1, 40, 60).tolist():
        pos += int(rng.integers(1, 4)) * 12288 * 50
        starts += [pos + 12288 * j for j in range(run)]
        pos = starts[-1]
    got = plan_reads(starts, 12288, align=4096, cost=ReadCost(0.0, 1e9), max_read=65536)
    want = greedy_reference(starts, 12288, 4096, 0, 65536)
    assert got == want and len(got) > 60 and max(r[1] - r[0] for r in got) <= 65536


def test_an_aio_curve_whose_landing_terms_were_measured_an_older_way_is_measured_again(tmp_path, monkeypatch):
    import json
    import os

    from mlx_flash.io.read_cost import ReadCostCurve

    monkeypatch.setenv("MLX_FLASH_HOME", str(tmp_path))
    dev = os.stat(tmp_path).st_dev
    curve = ReadCostCurve([4096, 65536], [1, 32], [[2e-5, 4e-5], [1e-5, 3e-5]], segment_s=1.5e-6,
                          copy_bandwidth=5e9)
    old = {"sizes": curve.sizes, "depths": curve.depths, "table": curve.table}
    (tmp_path / "io_profile.json").write_text(json.dumps(
        {f"dev{dev}-aio-curve": old, f"dev{dev}-threads-curve": old}))
    assert load_cost(tmp_path, 32, "aio") is None  # stored before segments were priced
    assert load_cost(tmp_path, 32, "threads").segment_s == 0  # threads never price them
    # the terms measured with the copy on the reaping thread (before LANDING_VERSION 2)
    (tmp_path / "io_profile.json").write_text(json.dumps(
        {f"dev{dev}-aio-curve": {**old, "segment_s": 1.4e-6, "copy_bandwidth": 3.1e9}}))
    assert load_cost(tmp_path, 32, "aio") is None
    from mlx_flash.io.planner import save_cost
    save_cost(tmp_path, 32, curve, "aio")
    got = load_cost(tmp_path, 32, "aio")
    assert (got.segment_s, got.copy_bandwidth) == (1.5e-6, 5e9)


def _random_strided_case(rng):
    """Random ids (sorted, shuffled, runs, empty) of a random plain layer and a random planner."""
    count = int(rng.integers(1, 3000))
    stride = int(rng.choice([64, 1036, 3000, 4096, 12288]))
    ids = rng.choice(count, int(rng.integers(0, min(count, 400) + 1)), replace=False)
    if rng.random() < 0.3:  # a run of neighbours, as a chunked cache fill asks
        lo = int(rng.integers(0, count))
        ids = np.arange(lo, min(count, lo + int(rng.integers(1, 200))))
    if rng.random() < 0.5:
        ids = np.sort(ids)
    cost = None if rng.random() < 0.2 else ReadCost(float(rng.choice([0.0, 1e-6, 2e-5, 1e-4])), 1e9)
    return dict(ids=ids, count=count, offset=int(rng.integers(0, 4)) * 4096 + int(rng.choice([0, 17])),
                stride=stride, align=int(rng.choice([1, 512, 4096])), cost=cost,
                max_read=int(rng.choice([1000, 16384, 65536, 1 << 20])))


def test_plan_strided_kernel_plans_exactly_as_numpy(monkeypatch):
    # the kernel's one pass and the numpy planner give the same arrays, row for row, on random
    # layers, ids, alignments, merge gaps and max_read (including reads of one oversized bundle)
    if planner.plan_strided_kernel is None:
        pytest.skip("kernels not built")
    rng = np.random.default_rng(1)
    names = ("ids", "index", "starts", "lengths", "r0", "r1", "first", "member_read")
    for _ in range(400):
        case = _random_strided_case(rng)
        a, b, c = case.pop("ids"), case.pop("count"), case.pop("offset")
        got = planner.plan_strided(a, b, c, **case)
        with monkeypatch.context() as m:
            m.setattr(planner, "plan_strided_kernel", None)
            want = planner.plan_strided(a, b, c, **case)
        for name, x, y in zip(names, got, want):
            assert x.dtype == np.int64 and np.array_equal(x, y), (name, case)


@pytest.mark.parametrize("ids, message", [([3, 7, 10], "bundle id out of range 0..9"),
                                          ([-1, 2], "bundle id out of range 0..9"),
                                          ([4, 2, 4], "duplicate bundle ids in one read")])
def test_plan_strided_refuses_bad_ids_naming_the_file(monkeypatch, ids, message):
    for kernel in (planner.plan_strided_kernel, None):
        monkeypatch.setattr(planner, "plan_strided_kernel", kernel)
        with pytest.raises(FlashError, match=f"^layer3.bin: {message}$"):
            planner.plan_strided(ids, 10, 0, 4096, align=4096, cost=ReadCost(1e-5, 1e9), path="layer3.bin")
