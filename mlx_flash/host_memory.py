"""The memory this process can still take on this machine: what `--mode auto` sizes a model's
weights by (models/auto.py) when the user gives no --memory-budget.

Linux: /proc/meminfo's MemAvailable, and, under cgroup memory limits (v2 `memory.max`, v1
`memory.limit_in_bytes`, the process's cgroup and each ancestor), each limit minus what the
cgroup uses, its reclaimable page cache (`inactive_file`) counted as free: the least of these.
macOS: Metal's recommended working set (what MLX may keep resident on the GPU), else the
physical memory. Other systems: the physical memory.
"""

import os
import sys
from pathlib import Path


def available_memory(proc=Path("/proc"), cgroup_root=Path("/sys/fs/cgroup")) -> tuple[int, str] | None:
    """(bytes, what bounds them, e.g. "MemAvailable" or "cgroup /bench memory.max"), or None when
    nothing tells. proc / cgroup_root: where /proc and the cgroup file systems are (tests)."""
    found = []
    meminfo = _meminfo(proc / "meminfo")
    if "MemAvailable" in meminfo:
        found.append((meminfo["MemAvailable"], "MemAvailable"))
    found += _cgroup_room(proc / "self" / "cgroup", cgroup_root)
    if not found and sys.platform == "darwin":
        found += _metal_working_set()
    if not found:
        total = _physical()
        if total:
            found.append((total, "physical memory"))
    return min(found) if found else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _meminfo(path: Path) -> dict:
    """{field: bytes} of a /proc/meminfo-style file ("MemAvailable:  123 kB")."""
    out = {}
    for line in (_read(path) or "").splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[name.strip()] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    return out


def _number(text) -> int | None:
    text = (text or "").strip()
    return int(text) if text.isdigit() else None


def _stat_field(path: Path, names) -> int:
    """The first of `names` found in a memory.stat file (bytes), or 0."""
    fields = {}
    for line in (_read(path) or "").splitlines():
        key, _, value = line.partition(" ")
        fields[key] = _number(value)
    return next((fields[n] for n in names if fields.get(n) is not None), 0)


def _cgroup_room(self_cgroup: Path, root: Path) -> list:
    """[(bytes, source)]: each limited cgroup (the process's and its ancestors), its limit minus
    its usage plus its inactive page cache; v2 and v1 alike."""
    out = []
    for line in (_read(self_cgroup) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if controllers == "":  # cgroup v2: 0::/path
            base, limit_file, usage_file, cache = root, "memory.max", "memory.current", ("inactive_file",)
        elif "memory" in controllers.split(","):  # cgroup v1: N:memory:/path
            base, limit_file, usage_file = root / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes"
            cache = ("total_inactive_file", "inactive_file")
        else:
            continue
        rel = Path(rel.strip().lstrip("/"))
        for part in [rel, *rel.parents]:
            d = base / part
            limit, used = _number(_read(d / limit_file)), _number(_read(d / usage_file))
            if limit is None or used is None or limit >= 1 << 60:  # "max" or v1's "no limit"
                continue
            room = max(0, limit - used + _stat_field(d / "memory.stat", cache))
            name = "/" if part == Path(".") else f"/{part.as_posix()}"
            out.append((min(room, limit), f"cgroup {name} {limit_file}"))
    return out


def _metal_working_set() -> list:
    """[(Metal's recommended working set, source)] as mlx-lm reads it (mx.device_info()), or []."""
    try:
        import mlx.core as mx

        size = int(mx.device_info().get("max_recommended_working_set_size") or 0)
    except (AttributeError, ImportError, RuntimeError, TypeError, ValueError):
        return []
    return [(size, "Metal recommended working set")] if size > 0 else []


def _physical() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None
