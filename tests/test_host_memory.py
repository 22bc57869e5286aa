"""host_memory.available_memory on fake /proc and cgroup trees (v1, v2, ancestors, page cache)."""

import sys

import pytest

from mlx_flash.host_memory import available_memory


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def proc(tmp_path):
    p = tmp_path / "proc"
    write(p / "meminfo", "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\n")
    write(p / "self" / "cgroup", "")
    return p


def test_meminfo_available_without_limits(proc, tmp_path):
    assert available_memory(proc, tmp_path / "cg") == (20000000 * 1024, "MemAvailable")


def test_cgroup_v1_limit_minus_usage_plus_inactive_page_cache(proc, tmp_path):
    cg = tmp_path / "cg"
    write(proc / "self" / "cgroup", "9:name=systemd:/\n4:memory:/bench/run\n0::/\n")
    write(cg / "memory" / "bench" / "run" / "memory.limit_in_bytes", "500000000\n")
    write(cg / "memory" / "bench" / "run" / "memory.usage_in_bytes", "300000000\n")
    write(cg / "memory" / "bench" / "run" / "memory.stat", "cache 90000000\ntotal_inactive_file 50000000\n")
    write(cg / "memory" / "bench" / "memory.limit_in_bytes", "9223372036854771712\n")  # no limit
    write(cg / "memory" / "bench" / "memory.usage_in_bytes", "300000000\n")
    assert available_memory(proc, cg) == (250000000, "cgroup /bench/run memory.limit_in_bytes")


def test_cgroup_tighter_ancestor_and_v2(proc, tmp_path):
    cg = tmp_path / "cg"
    write(proc / "self" / "cgroup", "0::/user.slice/app\n")
    write(cg / "user.slice" / "app" / "memory.max", "max\n")
    write(cg / "user.slice" / "app" / "memory.current", "100\n")
    write(cg / "user.slice" / "memory.max", "1000000000\n")
    write(cg / "user.slice" / "memory.current", "900000000\n")
    write(cg / "user.slice" / "memory.stat", "anon 800000000\ninactive_file 20000000\n")
    assert available_memory(proc, cg) == (120000000, "cgroup /user.slice memory.max")


def test_usage_above_limit_is_no_room_and_garbage_is_ignored(proc, tmp_path):
    cg = tmp_path / "cg"
    write(proc / "self" / "cgroup", "0::/a\n3:memory:/b\nnot a line\n")
    write(cg / "a" / "memory.max", "lots\n")  # unreadable number: no limit known
    write(cg / "a" / "memory.current", "5\n")
    write(cg / "memory" / "b" / "memory.limit_in_bytes", "1000\n")
    write(cg / "memory" / "b" / "memory.usage_in_bytes", "4000\n")
    assert available_memory(proc, cg) == (0, "cgroup /b memory.limit_in_bytes")


@pytest.mark.skipif(sys.platform == "darwin", reason="macOS reports Metal's working set instead")
def test_without_proc_the_physical_memory(tmp_path):
    got = available_memory(tmp_path / "none", tmp_path / "none")
    assert got is not None and got[1] == "physical memory" and got[0] > 1 << 20


def test_this_machine_reports_something():
    got = available_memory()
    assert got is not None and got[0] > 0 and got[1]


def test_macos_takes_metals_recommended_working_set(tmp_path, monkeypatch):
    """No /proc on macOS: the working set mlx-lm wires (mx.device_info()), else the physical memory."""
    import mlx.core as mx

    import mlx_flash.host_memory as hm

    monkeypatch.setattr(hm.sys, "platform", "darwin")
    monkeypatch.setattr(mx, "device_info", lambda: {"max_recommended_working_set_size": 12 << 30})
    assert available_memory(tmp_path / "none", tmp_path / "none") == (12 << 30, "Metal recommended working set")
    monkeypatch.setattr(mx, "device_info", lambda: {"architecture": "x86_64"})
    assert available_memory(tmp_path / "none", tmp_path / "none")[1] == "physical memory"
