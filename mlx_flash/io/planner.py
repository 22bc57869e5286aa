"""Read planner: merge neighbouring bundles into one larger read when the cost model says so.

Cost of one read of `n` bytes = latency (to first byte) + n / bandwidth, measured cold once per
machine, storage device and thread count (`calibrate`) and kept in
$MLX_FLASH_HOME/io_profile.json (default ~/.cache/mlx_flash). Two requested ranges are read as one
when the gap between them costs less to read than a second read's latency: gap / bandwidth <
latency (the paper's "read more than needed, in larger chunks, and discard").
"""

import json
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..paths import flash_home
from . import aio
from .cache import evict
from .files import FileLayer, aligned_buffer, read_full

DEFAULT_MAX_READ = 1 << 20  # bytes; larger merged reads stop helping and cost parallelism


@dataclass
class ReadCost:
    """Per-read latency (seconds) and streaming bandwidth (bytes/second) of one device."""
    latency_s: float
    bandwidth: float

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth

    @property
    def merge_gap(self) -> int:
        """Largest gap (bytes) worth reading through instead of issuing another read."""
        return int(self.latency_s * self.bandwidth)


def _profile_key(path, threads, engine) -> str:
    return f"dev{os.stat(path).st_dev}-t{threads}-{engine}"


def load_cost(path, threads, engine="threads") -> ReadCost | None:
    """The stored cost model of the device holding `path` at `threads` reads in flight issued
    by `engine` ('threads' or 'aio'), if any."""
    f = flash_home() / "io_profile.json"
    try:
        entry = json.loads(f.read_text()).get(_profile_key(path, threads, engine))
    except (OSError, ValueError):
        return None
    return ReadCost(entry["latency_s"], entry["bandwidth"]) if entry else None


def save_cost(path, threads, cost: ReadCost, engine="threads"):
    f = flash_home() / "io_profile.json"
    f.parent.mkdir(parents=True, exist_ok=True)
    try:
        data = json.loads(f.read_text())
    except (OSError, ValueError):
        data = {}
    data[_profile_key(path, threads, engine)] = {**asdict(cost), "measured": time.strftime("%Y-%m-%dT%H:%M:%S")}
    tmp = f.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, f)


def calibrate(directory, *, threads=32, file_bytes=64 << 20, small=4096, large=256 << 10,
              reads=2048, files: FileLayer | None = None, save=True, key_path=None,
              engine="threads") -> ReadCost:
    """Measure latency and bandwidth cold on a scratch file written in `directory`.

    The result is stored for the device of `key_path` (default: `directory`).
    Random aligned reads of `small` and `large` bytes, `threads` in flight, issued the way the
    loader will issue them (engine 'threads': a thread pool; 'aio': Linux native AIO), each
    after evicting the file (best of 3); two equations t = latency + n / bandwidth give both
    numbers. ~1-3 s.
    """

    files = files or FileLayer()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f".mlx_flash_calibrate_{os.getpid()}"
    try:
        with open(path, "wb") as f:
            f.write(np.random.default_rng(0).integers(0, 256, file_bytes, np.uint8).tobytes())
            f.flush()
            os.fsync(f.fileno())
        fd, direct = files.open(path, True)
        use_aio = engine == "aio" and direct and aio.available()
        ctx = aio.AioContext(threads) if use_aio else None
        try:
            def per_read(size, n):
                evict([path])
                offsets = [random.randrange(0, file_bytes - size) // 4096 * 4096 for _ in range(n)]
                if ctx is not None:
                    buf = aligned_buffer(size * n)
                    addrs = np.frombuffer(buf, np.uint8).ctypes.data + size * np.arange(n)
                    t0 = time.perf_counter()
                    res = ctx.read(np.full(n, fd), np.array(offsets), np.full(n, size), addrs)
                    if (res != size).any():
                        raise OSError(f"calibration read failed on {path}")
                    return (time.perf_counter() - t0) / n
                groups = [offsets[i::threads] for i in range(threads)]

                def work(group):
                    buf = aligned_buffer(size)
                    for off in group:
                        read_full(files, fd, [buf[:size]], off, path)

                t0 = time.perf_counter()
                with ThreadPoolExecutor(threads) as pool:
                    list(pool.map(work, groups))
                return (time.perf_counter() - t0) / n

            # best of 3: background load only ever makes a run slower
            t_small = min(per_read(small, reads) for _ in range(3))
            t_large = min(per_read(large, max(threads, reads // 8)) for _ in range(3))
        finally:
            if ctx is not None:
                ctx.close()
            files.close(fd)
    finally:
        path.unlink(missing_ok=True)
    bandwidth = (large - small) / max(t_large - t_small, 1e-9)
    latency = max(t_small - small / bandwidth, 1e-7)
    cost = ReadCost(latency, bandwidth)
    if save:
        save_cost(key_path or directory, threads, cost, "aio" if use_aio else "threads")
    return cost


def plan_read_arrays(starts, length, *, align=1, cost: ReadCost | None = None,
                     max_read=DEFAULT_MAX_READ):
    """Group sorted request start offsets (bytes, each request `length` bytes) into reads.

    Returns numpy arrays (read_start, read_end, first_request): read k covers requests
    first_request[k] .. first_request[k+1]-1, with its bounds rounded out to `align`.
    cost=None: one read per request (no merging). Otherwise a request joins the previous read
    when the bytes between them cost less than another read (gap / bandwidth < latency) and the
    read stays <= max_read bytes (or holds a single request).
    """
    starts = np.asarray(starts, np.int64)
    n = len(starts)
    a0 = starts // align * align
    a1 = -(-(starts + length) // align) * align
    if n == 0 or cost is None:
        return a0, a1, np.arange(n)
    new = np.ones(n, bool)  # equal lengths and sorted starts: a1 never decreases
    new[1:] = a0[1:] - a1[:-1] > cost.merge_gap
    first = np.flatnonzero(new)
    bounds = np.append(first, n)
    if (a1[bounds[1:] - 1] - a0[first]).max() > max_read:  # split long runs greedily
        cut = []
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            r0 = a0[lo]
            cut.append(lo)
            for j in range(lo + 1, hi):
                if a1[j] - r0 > max_read:
                    cut.append(j)
                    r0 = a0[j]
        first = np.array(cut, np.int64)
        bounds = np.append(first, n)
    return a0[first], a1[bounds[1:] - 1], first


def plan_reads(starts, length, *, align=1, cost: ReadCost | None = None,
               max_read=DEFAULT_MAX_READ):
    """plan_read_arrays as a list [(read_start, read_end, [request indices])]."""
    r0, r1, first = plan_read_arrays(starts, length, align=align, cost=cost, max_read=max_read)
    bounds = np.append(first, len(starts)).tolist()
    return [(int(a), int(b), list(range(bounds[k], bounds[k + 1])))
            for k, (a, b) in enumerate(zip(r0.tolist(), r1.tolist()))]
