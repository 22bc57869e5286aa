"""Run a Python function or a command in a child process, optionally inside a cgroup memory cap.

    result = run_capped("mlx_flash.bench.run:measure", {"pack": ...}, cap_bytes=2 << 30)
    result.value        # what the function returned (JSON-serialisable), None if it failed
    result.peak_bytes   # the child's peak memory: cgroup max_usage (anon + page cache) or ru_maxrss

Linux cgroup v1 as root: a fresh group /sys/fs/cgroup/memory/mlx-flash-bench-<pid>-<n> with
`memory.limit_in_bytes` (and `memory.memsw.limit_in_bytes` when swap accounting exists) set to the
cap; the child shell writes its own pid into `cgroup.procs` and then execs the real command, so
every byte of the process, page cache included, is charged from its first instruction. The group is
used even without a cap (limit unlimited) so the peak of an uncapped run is measured the same way.
Without root or cgroup v1 the child runs uncapped and `peak_bytes` is its ru_maxrss (anon + file
mapped pages only). The group is removed afterwards.
"""

import json
import os
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
_counter = 0


@dataclass
class CappedResult:
    """What a child run did. Sizes in bytes, times in seconds."""
    ok: bool
    value: object = None
    error: str | None = None  # last lines of stderr / the exception, when not ok
    returncode: int | None = None
    capped: bool = False  # ran under a cgroup memory limit
    cap_bytes: int | None = None
    peak_bytes: int | None = None
    peak_source: str = ""  # "cgroup memory.max_usage_in_bytes" or "ru_maxrss"
    failcnt: int | None = None  # times the cgroup hit its limit (reclaim happened)
    oom_killed: bool = False
    seconds: float = 0.0
    stderr_tail: str = ""

    def to_dict(self):
        return asdict(self)


def cgroup_status() -> tuple[bool, str]:
    """(usable, reason): can this process create cgroup v1 memory groups?"""
    if sys.platform != "linux":
        return False, f"cgroup memory caps need Linux (this is {sys.platform})"
    if not (CGROUP_ROOT / "memory.limit_in_bytes").is_file():
        return False, f"no cgroup v1 memory controller at {CGROUP_ROOT}"
    if os.geteuid() != 0:
        return False, "not root: cannot create cgroups (run as root for --cap)"
    if not os.access(CGROUP_ROOT, os.W_OK):
        return False, f"{CGROUP_ROOT} is not writable"
    return True, "cgroup v1 memory controller"


def _read_int(path: Path):
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _oom_kills(group: Path) -> int:
    try:
        for line in (group / "memory.oom_control").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


class _Group:
    """A cgroup v1 memory group that lives for one child run."""

    def __init__(self, cap_bytes):
        global _counter
        _counter += 1
        self.path = CGROUP_ROOT / f"mlx-flash-bench-{os.getpid()}-{_counter}"
        self.path.mkdir()
        try:
            if cap_bytes is not None:
                (self.path / "memory.limit_in_bytes").write_text(str(int(cap_bytes)))
                memsw = self.path / "memory.memsw.limit_in_bytes"
                if memsw.exists():  # no escape into swap either
                    memsw.write_text(str(int(cap_bytes)))
        except OSError:
            self.remove()
            raise

    def stats(self):
        return (_read_int(self.path / "memory.max_usage_in_bytes"),
                _read_int(self.path / "memory.failcnt"), _oom_kills(self.path))

    def remove(self):
        for _ in range(50):
            try:
                if (self.path / "cgroup.procs").read_text().strip():
                    time.sleep(0.1)  # a killed child is still being reaped
                    continue
                try:  # uncharge leftover page cache so the parent is not billed with it
                    (self.path / "memory.force_empty").write_text("0")
                except OSError:
                    pass
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)


def run_command(argv, *, cap_bytes=None, use_cgroup=True, timeout=None, env=None,
                stdout_path=None) -> CappedResult:
    """Run `argv` in a child process (inside a memory cap of `cap_bytes` when given and possible).

    `use_cgroup`: measure peak memory with an (unlimited) cgroup even when `cap_bytes` is None.
    Raises RuntimeError when a cap is asked for but cgroups are unusable (check cgroup_status()).
    """
    usable, reason = cgroup_status()
    if cap_bytes is not None and not usable:
        raise RuntimeError(f"cannot cap memory: {reason}")
    group = _Group(cap_bytes) if usable and (use_cgroup or cap_bytes is not None) else None
    err = tempfile.TemporaryFile()
    out = open(stdout_path, "wb") if stdout_path else subprocess.DEVNULL
    t0 = time.perf_counter()
    try:
        if group is not None:
            # The shell joins the group, then execs: the real program is charged from the start.
            procs = shlex.quote(str(group.path / "cgroup.procs"))
            cmd = ["/bin/sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *map(str, argv)]
        else:
            cmd = [str(a) for a in argv]
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env)
        try:
            rc = proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
            timed_out = True
        seconds = time.perf_counter() - t0
        err.seek(0)
        tail = err.read().decode(errors="replace")[-4000:]
        result = CappedResult(ok=rc == 0 and not timed_out, returncode=rc, seconds=seconds,
                              capped=group is not None and cap_bytes is not None,
                              cap_bytes=cap_bytes if group is not None else None, stderr_tail=tail)
        if group is not None:
            result.peak_bytes, result.failcnt, kills = group.stats()
            result.peak_source = "cgroup memory.max_usage_in_bytes (anon + page cache)"
            result.oom_killed = kills > 0
        else:
            # ru_maxrss of children is a high-water mark over all children: only trust it if it grew.
            after = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
            result.peak_bytes = after * 1024 if after > before else None
            result.peak_source = "ru_maxrss (resident set, no page cache)"
        if timed_out:
            result.error = f"timed out after {timeout:.0f} s"
        elif result.oom_killed:
            result.error = f"killed by the OOM killer under the {cap_bytes / 2**20:.0f} MiB cap"
        elif rc != 0:
            lines = [ln for ln in tail.strip().splitlines() if ln.strip()]
            result.error = lines[-1] if lines else f"exit code {rc}"
        return result
    finally:
        err.close()
        if stdout_path:
            out.close()
        if group is not None:
            group.remove()


def run_capped(function: str, kwargs: dict, *, cap_bytes=None, use_cgroup=True, timeout=None,
               env=None) -> CappedResult:
    """Call `function` ("module:name") with JSON `kwargs` in a fresh Python child process.

    The function's return value must be JSON-serialisable; it comes back as `result.value`.
    An exception in the child gives ok=False with its message in `result.error`.
    """
    with tempfile.TemporaryDirectory(prefix="mlx-flash-cap-") as tmp:
        spec, out = Path(tmp) / "call.json", Path(tmp) / "result.json"
        spec.write_text(json.dumps({"function": function, "kwargs": kwargs, "out": str(out)}))
        result = run_command([sys.executable, "-m", "mlx_flash.bench.cap", str(spec)],
                             cap_bytes=cap_bytes, use_cgroup=use_cgroup, timeout=timeout, env=env)
        if out.is_file():
            payload = json.loads(out.read_text())
            if "error" in payload:
                result.ok, result.error = False, payload["error"]
            else:
                result.value = payload["value"]
        elif result.ok:
            result.ok, result.error = False, "the child wrote no result"
        return result


def touch_memory(mib: int) -> int:
    """Allocate and write `mib` MiB of anonymous memory, return the bytes touched (cap self-test)."""
    block = bytearray(mib << 20)
    for i in range(0, len(block), 4096):
        block[i] = 1
    return len(block)


def _child(spec_path):
    import importlib
    import traceback

    spec = json.loads(Path(spec_path).read_text())
    module, _, name = spec["function"].partition(":")
    try:
        value = getattr(importlib.import_module(module), name)(**spec["kwargs"])
        payload = {"value": value}
    except BaseException as e:  # report every failure (MemoryError, FlashError, ...) as data
        traceback.print_exc()
        payload = {"error": f"{type(e).__name__}: {e}".strip()}
    Path(spec["out"]).write_text(json.dumps(payload))
    return 0 if "value" in payload else 1


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1]))
