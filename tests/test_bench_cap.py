"""bench.cap: child processes inside a cgroup v1 memory cap (skipped without root / cgroup v1)."""

import os

import pytest

from mlx_flash.io import evict

from mlx_flash.bench.cap import CGROUP_ROOT, cgroup_status, run_capped, run_command

usable, reason = cgroup_status()
needs_cgroup = pytest.mark.skipif(not usable, reason=f"cgroup v1 memory caps unavailable: {reason}")


def _groups():
    return {p.name for p in CGROUP_ROOT.glob(f"mlx-flash-bench-{os.getpid()}-*")}


@needs_cgroup
def test_under_cap_runs_and_reports_peak():
    r = run_capped("mlx_flash.bench.cap:touch_memory", {"mib": 64}, cap_bytes=256 << 20)
    assert r.ok and r.capped and r.value == 64 << 20
    assert 64 << 20 <= r.peak_bytes <= 256 << 20
    assert r.peak_source.startswith("cgroup")
    assert not _groups()  # cleaned up


@needs_cgroup
def test_over_cap_is_oom_killed_not_hung():
    r = run_capped("mlx_flash.bench.cap:touch_memory", {"mib": 400}, cap_bytes=128 << 20)
    assert not r.ok and r.oom_killed and r.returncode == -9
    assert "OOM" in r.error and r.peak_bytes <= 128 << 20
    assert not _groups()


@needs_cgroup
def test_cap_limits_page_cache(tmp_path):
    # Reading a file twice the cap through the page cache still works: the cache is reclaimed
    # inside the group, and the group's peak (which counts page cache) stays under the cap.
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        for _ in range(96):
            f.write(os.urandom(1 << 20))
    cap = 48 << 20
    assert evict(big)["residency"] == 0.0  # pages cached by this process are charged to it
    r = run_command(["/bin/sh", "-c", f"cat {big} > /dev/null"], cap_bytes=cap)
    assert r.ok and cap - (8 << 20) < r.peak_bytes <= cap  # the cap was reached, cache reclaimed
    evict(big)
    r = run_command(["/bin/sh", "-c", f"cat {big} > /dev/null"])  # uncapped: the cache is charged
    assert r.ok and r.peak_bytes > cap


def test_child_errors_come_back_as_data():
    r = run_capped("mlx_flash.bench.cap:touch_memory", {"mib": "x"})
    assert not r.ok and "TypeError" in r.error and r.value is None
    r = run_capped("mlx_flash.bench.cap:no_such_function", {})
    assert not r.ok and "no_such_function" in r.error


def test_uncapped_without_cgroup_uses_rusage():
    r = run_capped("mlx_flash.bench.cap:touch_memory", {"mib": 32}, use_cgroup=False)
    assert r.ok and not r.capped and r.value == 32 << 20
    assert r.peak_source.startswith("ru_maxrss")
