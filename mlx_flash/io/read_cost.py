"""Read-cost curve: seconds per read measured cold at several read sizes and depths, piecewise linear.

A straight line `latency + bytes / bandwidth` through two sizes misprices the sizes between and
beyond them (on one shared SSD: 17 us at 4 KiB, 31 us at 64 KiB, 338 us at 256 KiB per read at
depth 32: no single line fits). The curve keeps the measured points: for the loader's depth
(reads in flight = its threads) the amortized seconds per read at each measured size, linear
between sizes (beyond the largest, the last segment's slope: streaming bandwidth; below the
smallest, the smallest's cost: a read never costs less than one block). Depths between measured
ones are interpolated linearly in log2(depth).

Used by the read planner (io/planner.py: a gap between two requests is read through when one read
of both costs less than two reads) and by the memory plan (sparse/budget.py prices a layer's
planned reads with it). Stored per machine, device and engine in $MLX_FLASH_HOME/io_profile.json.
"""

import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

DEFAULT_SIZES = (4096, 16384, 65536, 262144, 1048576)  # bytes
DEFAULT_DEPTHS = (1, 4, 16, 32)                          # reads in flight
GAP_STEP = 4096                                          # merge gaps are searched in blocks


@dataclass
class ReadCostCurve:
    """Amortized seconds per read `table[d][s]` at `depths[d]` reads in flight and `sizes[s]`
    bytes per read, priced at `depth` (the reader's reads in flight)."""
    sizes: list
    depths: list
    table: list
    depth: int = 32
    engine: str = field(default="threads", compare=False)  # how the measured reads were issued
    _row: np.ndarray = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        self.sizes = [int(s) for s in self.sizes]
        self.depths = [int(d) for d in self.depths]
        t = np.asarray(self.table, np.float64)
        if t.shape != (len(self.depths), len(self.sizes)) or len(self.sizes) < 2:
            raise ValueError(f"read-cost curve: table {t.shape} does not match {len(self.depths)} depths "
                             f"x {len(self.sizes)} sizes (need >= 2 sizes)")
        logd = np.log2(self.depths)
        x = np.log2(max(1, self.depth))
        self._row = np.array([np.interp(x, logd, t[:, j]) for j in range(len(self.sizes))])
        self._gaps = {}

    def at_depth(self, depth: int) -> "ReadCostCurve":
        return ReadCostCurve(self.sizes, self.depths, self.table, depth, self.engine)

    def seconds(self, nbytes):
        """Seconds per read of `nbytes` (scalar or array) at this curve's depth."""
        n = np.asarray(nbytes, np.float64)
        s, row = np.asarray(self.sizes, np.float64), self._row
        slope = (row[-1] - row[-2]) / (s[-1] - s[-2])
        out = np.where(n > s[-1], row[-1] + (n - s[-1]) * slope, np.interp(n, s, row))
        return float(out) if out.ndim == 0 else out

    @property
    def bandwidth(self) -> float:
        """Streaming bytes/second: the slope of the largest sizes' segment."""
        s, row = self.sizes, self._row
        return (s[-1] - s[-2]) / max(row[-1] - row[-2], 1e-12)

    @property
    def latency_s(self) -> float:
        """Seconds of the smallest read not explained by streaming its bytes (for reports)."""
        return max(float(self._row[0]) - self.sizes[0] / self.bandwidth, 0.0)

    def merge_gap_for(self, length: int, max_gap: int = 1 << 20) -> int:
        """Largest gap (bytes, a multiple of GAP_STEP) worth reading through between two requests of
        `length` bytes: one read of 2 length + gap costs no more than two reads of length."""
        if length not in self._gaps:
            gaps = np.arange(0, max_gap + GAP_STEP, GAP_STEP, dtype=np.float64)
            ok = self.seconds(2 * length + gaps) <= 2 * self.seconds(length)
            self._gaps[length] = int(gaps[np.flatnonzero(ok)[-1]]) if ok[0] else -1
        return self._gaps[length]

    @property
    def merge_gap(self) -> int:
        return self.merge_gap_for(GAP_STEP)

    def to_dict(self) -> dict:
        return {"sizes": self.sizes, "depths": self.depths, "table": np.asarray(self.table).tolist()}

    @classmethod
    def from_dict(cls, d: dict, depth: int = 32) -> "ReadCostCurve":
        return cls(d["sizes"], d["depths"], d["table"], depth)


def timed_reads(fd, path, file_bytes, size, n, depth, *, files, ctx=None) -> float:
    """Amortized seconds per read of `n` random aligned `size`-byte reads of an evicted file, `depth`
    in flight: a thread pool of `depth` (or the Linux AIO context `ctx`, sized >= depth)."""
    from .cache import evict
    from .files import aligned_buffer, read_full

    evict([path])
    offsets = [random.randrange(0, file_bytes - size + 1) // 4096 * 4096 for _ in range(n)]
    if ctx is not None:  # the context keeps `depth` reads in flight
        buf = aligned_buffer(size * n)
        addrs = np.frombuffer(buf, np.uint8).ctypes.data + size * np.arange(n)
        t0 = time.perf_counter()
        res = ctx.read(np.full(n, fd), np.array(offsets), np.full(n, size), addrs)
        if (res != size).any():
            raise OSError(f"calibration read failed on {path}")
        return (time.perf_counter() - t0) / n
    groups = [offsets[i::depth] for i in range(depth)]

    def work(group):
        buf = aligned_buffer(size)
        for off in group:
            read_full(files, fd, [buf[:size]], off, path)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(depth) as pool:
        list(pool.map(work, groups))
    return (time.perf_counter() - t0) / n


def measure_curve(directory, *, sizes=DEFAULT_SIZES, depths=DEFAULT_DEPTHS, file_bytes=64 << 20,
                  engine="threads", files=None, repeats=2, max_reads=512, read_path=None) -> ReadCostCurve:
    """Measure the curve cold on a scratch file written in `directory` (deleted afterwards), or on
    the existing file `read_path`, opened read-only (its size replaces `file_bytes`).

    Per (depth, size): min(max_reads, file_bytes / size) (at least 4 x depth) random aligned reads,
    the file evicted before each of `repeats` runs, the best kept (background load only ever
    slows a run). engine 'aio' uses Linux native AIO when direct I/O works, else threads.
    """
    import os
    from pathlib import Path

    from . import aio
    from .files import FileLayer

    files = files or FileLayer()
    if read_path is None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f".mlx_flash_read_cost_{os.getpid()}"
    else:
        path = Path(read_path)
        file_bytes = path.stat().st_size
    sizes = [s for s in sizes if s <= file_bytes // 2] or [min(sizes)]
    table = np.zeros((len(depths), len(sizes)))
    used = "threads"
    try:
        if read_path is None:
            with open(path, "wb") as f:
                f.write(np.random.default_rng(0).integers(0, 256, file_bytes, np.uint8).tobytes())
                f.flush()
                os.fsync(f.fileno())
        fd, direct = files.open(path, True)
        try:
            for i, depth in enumerate(depths):
                ctx = aio.AioContext(depth) if engine == "aio" and direct and aio.available() else None
                used = "aio" if ctx is not None else used
                try:
                    for j, size in enumerate(sizes):
                        n = max(4 * depth, min(max_reads, file_bytes // size))
                        table[i, j] = min(timed_reads(fd, path, file_bytes, size, n, depth, files=files, ctx=ctx)
                                          for _ in range(repeats))
                finally:
                    if ctx is not None:
                        ctx.close()
        finally:
            files.close(fd)
    finally:
        if read_path is None:
            path.unlink(missing_ok=True)
    table = np.maximum.accumulate(table, axis=1)  # a larger read never costs less: noise otherwise
    return ReadCostCurve(list(sizes), list(depths), table.tolist(), engine=used)
