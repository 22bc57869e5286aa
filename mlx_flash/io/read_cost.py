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

Segments: the curve is measured with reads landing in one contiguous buffer. A read whose
destination is many pieces (a zero-copy read of neuron bundles puts each 4 KiB gate / up / down
row in its own array: one physical segment each) costs more on some devices (a KVM virtio disk
here: ~1-2 us per extra segment at depth 32, whatever the read size; `bench io --parts segments`).
`segment_s` prices that, and `copy_bandwidth` the copy out of a contiguous staging buffer that
avoids it (the read time the copy adds, measured while reads fly, so under the machine's CPU
load); `stage_saves_time` compares the two for the loader.

Load: a curve measured while other processes kept the CPUs busy prices reads high (4 KiB: 82 us
loaded vs 14 us idle on one shared SSD), and the planner then reads through large gaps. Each
measurement records the share of its CPUs' time other processes took meanwhile (`load`,
load_since) and when it was measured (`measured`); a curve at or above LOADED_SHARE is reported once
per process (warn_if_loaded), and report headers show both (describe_profile). REMEASURE_COMMAND
measures one device's entry again, leaving the others stored.
"""

import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

DEFAULT_SIZES = (4096, 16384, 65536, 262144, 1048576)  # bytes
DEFAULT_DEPTHS = (1, 4, 16, 32)                          # reads in flight
GAP_STEP = 4096                                          # merge gaps are searched in blocks
# Read sizes (bytes) at which the segment and copy terms are measured: 64 and 256 pieces of
# 4 KiB vs one. Two, because a read of more pieces than the device takes per request
# (/sys/block/*/queue/max_segments: 254 on this virtio disk) is split into several requests, so
# the cost per segment grows with the read; priced between them by log2(size), clamped outside.
LANDING_SIZES = (262144, 1048576)
SEGMENT_REPEATS = 5  # rounds of both, taking turns (median difference): load moves single runs
# Staging costs a copy's CPU time and a buffer: taken only when it saves this share of read time
STAGE_MIN_GAIN = 0.1
FREE_COPY = 1e12  # bytes/second: a copy that added no measurable time
# How the segment and copy terms are measured; an AIO profile stored by an older way is measured
# again (3: at LANDING_SIZES, the copy on the finishing threads as the loader does it; 2: at
# 256 KiB only; 1: the copy on the reaping thread)
LANDING_VERSION = 3
# The loader's finishing threads, checking (crc32), decoding and scattering landed reads: two
# cores' worth, so checks keep up with the device. The calibration copies staged rows on as many.
FINISH_THREADS = 2
# A curve measured while other processes took this share (or more) of the CPU time of the CPUs
# the measurement could run on is called loaded: warned about, re-measured by hand on an idle machine
LOADED_SHARE = 0.25
MEASURED_FORMAT = "%Y-%m-%dT%H:%M:%S"  # a curve's `measured` stamp (local time)
# re-measures one device's stored curve (its entry only) and prints it
REMEASURE_COMMAND = "python -m mlx_flash.bench io --pack PACK --parts profile --calibrate"


@dataclass
class ReadCostCurve:
    """Amortized seconds per read `table[d][s]` at `depths[d]` reads in flight and `sizes[s]`
    bytes per read, priced at `depth` (the reader's reads in flight)."""
    sizes: list
    depths: list
    table: list
    depth: int = 32
    engine: str = field(default="threads", compare=False)  # how the measured reads were issued
    segment_s: float = 0.0  # seconds a read costs per destination segment beyond its first (0: none)
    copy_bandwidth: float = 0.0  # bytes/second of read time that copying staged rows out adds (0: unmeasured)
    # the two terms per measured read size, {"sizes", "segment_s", "copy_bandwidth"} (lists); when
    # given, the scalars above are derived from it (its first size's: what older readers of a
    # stored profile price with); None: the scalars, from a profile stored before, at every size
    landing: dict | None = field(default=None, compare=False)
    # how loaded the machine was while measuring (load_since: other_cpu_share, cpus, seconds,
    # source); None: unknown (a profile stored before loads were recorded)
    load: dict | None = field(default=None, compare=False)
    measured: str | None = field(default=None, compare=False)  # when, local time (MEASURED_FORMAT)
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
        if _measured_sizes(self.landing):
            self.segment_s = float(self.landing["segment_s"][0])
            self.copy_bandwidth = float(self.landing["copy_bandwidth"][0])

    def at_depth(self, depth: int) -> "ReadCostCurve":
        return ReadCostCurve(self.sizes, self.depths, self.table, depth, self.engine, self.segment_s,
                             self.copy_bandwidth, self.landing, self.load, self.measured)

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
        return {"sizes": self.sizes, "depths": self.depths, "table": np.asarray(self.table).tolist(),
                "segment_s": self.segment_s, "copy_bandwidth": self.copy_bandwidth,
                "landing": self.landing, "landing_version": LANDING_VERSION, "load": self.load,
                "measured": self.measured}

    @classmethod
    def from_dict(cls, d: dict, depth: int = 32, engine: str | None = None) -> "ReadCostCurve":
        """The curve of a to_dict() (a stored profile entry); engine: the one its entry is stored
        for (named by the entry's key, planner._curve_key)."""
        return cls(d["sizes"], d["depths"], d["table"], depth, engine=engine or "threads",
                   segment_s=d.get("segment_s", 0.0),
                   copy_bandwidth=d.get("copy_bandwidth", 0.0), landing=d.get("landing"),
                   load=d.get("load"), measured=d.get("measured"))


def _cpu_busy_seconds(cpus) -> float | None:
    """Seconds the CPUs numbered `cpus` have spent busy since boot (Linux /proc/stat: user, nice,
    system, irq, softirq, steal), all processes; None where /proc/stat is missing."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    busy, found = 0, 0
    for line in lines:
        name, *ticks = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            t = [int(x) for x in ticks] + [0] * 8
            busy += t[0] + t[1] + t[2] + t[5] + t[6] + t[7]
            found += 1
    return busy / os.sysconf("SC_CLK_TCK") if found else None


def load_sample() -> dict:
    """A point to measure load from (load_since): the clock (s), the busy seconds of the CPUs this
    process may run on, this process's own CPU seconds (all threads) and the 1-minute load average."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    return {"t": time.perf_counter(), "cpus": cpus, "busy": _cpu_busy_seconds(set(cpus)),
            "own": sum(os.times()[:2]), "loadavg": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def load_since(start: dict, end: dict | None = None) -> dict:
    """How loaded the machine was between two load_sample()s (end: now): {"other_cpu_share": the
    share (0-1) of the CPU time of the CPUs we may run on that other processes took (their busy
    time minus ours, over seconds x cpus), "cpus", "seconds", "source": "proc_stat"}; without
    /proc/stat (macOS) the 1-minute load average before the start per CPU, capped at 1,
    "source": "loadavg"; share None when neither is known."""
    end = end or load_sample()
    seconds, cpus = end["t"] - start["t"], len(start["cpus"])
    if start["busy"] is not None and end["busy"] is not None and seconds > 0:
        other = max(0.0, (end["busy"] - start["busy"]) - (end["own"] - start["own"]))
        share, source = min(1.0, other / (seconds * cpus)), "proc_stat"
    elif start.get("loadavg") is not None:
        share, source = min(1.0, start["loadavg"] / cpus), "loadavg"
    else:
        share, source = None, "unknown"
    return {"other_cpu_share": None if share is None else round(share, 3), "cpus": cpus,
            "seconds": round(seconds, 2), "source": source}


def describe_load(load: dict | None) -> str:
    """One phrase for reports: how loaded the machine was when a curve was measured."""
    if not load or load.get("other_cpu_share") is None:
        return "machine load while measured: unknown (not recorded)"
    verdict = "LOADED" if is_loaded(load) else "idle enough"
    return (f"machine load while measured: other processes took {load['other_cpu_share']:.0%} of "
            f"{load['cpus']} CPU(s) over {load['seconds']:.1f} s ({load['source']}; "
            f"loaded from {LOADED_SHARE:.0%}): {verdict}")


def is_loaded(load: dict | None) -> bool:
    """Whether a curve's recorded load (ReadCostCurve.load) reaches LOADED_SHARE; unknown: False."""
    share = (load or {}).get("other_cpu_share")
    return share is not None and share >= LOADED_SHARE


def describe_profile(cost, profile_file=None) -> str:
    """One line for report headers: the read-cost profile that prices reads (a ReadCostCurve, an
    older straight-line planner.ReadCost, or None: none stored), when it was measured and how
    loaded the machine was then."""
    where = f" {profile_file}" if profile_file else ""
    if cost is None:
        return f"read-cost profile{where}: none stored for this device (the first load measures it, ~5-15 s)"
    measured = getattr(cost, "measured", None)
    return (f"read-cost profile{where}: {'measured ' + measured if measured else 'date not recorded'}, "
            f"{describe_load(getattr(cost, 'load', None))}")


_warned = set()


def warn_if_loaded(curve, profile_file, key: str = "") -> bool:
    """Print one stderr line per profile entry and process when `curve` was measured loaded,
    naming the profile file and the command that re-measures that entry (REMEASURE_COMMAND).
    Returns whether it warned."""
    load = getattr(curve, "load", None)
    if not is_loaded(load) or (str(profile_file), key) in _warned:
        return False
    _warned.add((str(profile_file), key))
    print(f"mlx_flash: the read-cost profile {profile_file} [{key}] was measured "
          f"{getattr(curve, 'measured', None) or '(date not recorded)'} while other processes took "
          f"{load['other_cpu_share']:.0%} of the CPUs (loaded from {LOADED_SHARE:.0%}): reads may be "
          f"mispriced; on an idle machine `{REMEASURE_COMMAND}` (PACK: a pack on this device) measures "
          f"this entry again (~5-15 s)", file=sys.stderr)
    return True


def _measured_sizes(landing) -> bool:
    return bool(landing) and len(landing.get("sizes", ())) > 0


def landing_terms(cost, read_bytes) -> tuple:
    """(seconds per extra destination segment, seconds of copy per byte) for reads of
    `read_bytes` (array): the cost model's terms at the measured size nearest in log2(bytes),
    linear between measured sizes (ReadCostCurve.landing), else its scalars (segment_s,
    copy_bandwidth) at every size; 0 where unmeasured (a copy bandwidth of 0)."""
    nbytes = np.asarray(read_bytes, np.float64)
    landing = getattr(cost, "landing", None)
    if not _measured_sizes(landing):  # one size's terms price every size
        landing = {"sizes": [1], "segment_s": [getattr(cost, "segment_s", 0.0)],
                   "copy_bandwidth": [getattr(cost, "copy_bandwidth", 0.0)]}
    x = np.log2(np.maximum(nbytes, 1))
    sizes = np.log2(np.asarray(landing["sizes"], np.float64))
    bandwidth = np.asarray(landing["copy_bandwidth"], np.float64)
    per_byte = np.divide(1.0, bandwidth, out=np.zeros_like(bandwidth), where=bandwidth > 0)
    return (np.interp(x, sizes, np.asarray(landing["segment_s"], np.float64)),
            np.interp(x, sizes, per_byte))


def stage_saves_time(cost, read_bytes, segments) -> bool:
    """Whether reads of `read_bytes` (array, bytes each) whose destinations are `segments` pieces
    each (array) finish clearly sooner landing in one contiguous staging buffer and copied out
    than landing in their pieces. Zero copy: each read's time (cost.seconds) plus
    (segments - 1) x the segment term; staged: the read's time plus the time its copy adds,
    bytes x the copy term (measured as the loader copies, overlapping the reads in flight, so a
    copy that a spare core hides adds little, one that competes for a busy core adds its share);
    both terms at each read's size (landing_terms).
    Staging must save STAGE_MIN_GAIN of the zero-copy time: its copy costs CPU and its buffer
    memory, so a block of a few large segments (an MoE expert) stays zero copy. False when the
    cost model (a ReadCostCurve or planner.ReadCost) has no measured segment or copy term."""
    if cost is None or len(read_bytes) == 0:
        return False
    nbytes = np.asarray(read_bytes, np.float64)
    seg, copy_s = landing_terms(cost, nbytes)
    if not (seg > 0).any() or not (copy_s > 0).all():
        return False
    read_s = np.asarray(cost.seconds(nbytes), np.float64)
    zero_copy = float(np.sum(read_s + (np.asarray(segments, np.float64) - 1) * seg))
    staged = float(np.sum(read_s + nbytes * copy_s))
    return staged < (1 - STAGE_MIN_GAIN) * zero_copy


def segment_iovecs(kind, base, size, reads) -> np.ndarray:
    """aio.IOVEC array of `reads` vectored reads of `size` bytes (a multiple of 4 KiB) into memory
    at `base` (room for reads x (size + 8 KiB)), len // reads iovecs per read, read after read:
      dest_scattered: 4 KiB pieces, piece j of read i -> array j % 3, row i x rows + j // 3 (a
        zero-copy read of neuron bundles: gate / up / down rows, one iovec and segment each);
      dest_adjacent: 4 KiB pieces end to end, read i at base + i x size (iovecs, one segment);
      dest_thirds: 3 pieces per read, piece j (a third of the read in whole 4 KiB rows) -> array j."""
    from .aio import IOVEC

    per = size // 4096
    rows = -(-per // 3)  # 4 KiB rows per array per read
    if kind == "dest_thirds":
        i, j = np.divmod(np.arange(reads * 3), 3)
        iov = np.empty(reads * 3, IOVEC)
        iov["base"] = base + (j * reads * rows + i * rows) * 4096
        iov["len"] = np.minimum(rows, np.maximum(per - j * rows, 0)) * 4096
        return iov
    i, j = np.divmod(np.arange(reads * per), per)
    iov = np.empty(reads * per, IOVEC)
    if kind == "dest_scattered":
        iov["base"] = base + (j % 3 * reads * rows + i * rows + j // 3) * 4096
    elif kind == "dest_adjacent":
        iov["base"] = base + (i * per + j) * 4096
    else:
        raise ValueError(f"segment_iovecs: unknown kind {kind!r}")
    iov["len"] = 4096
    return iov


def timed_segment_reads(fd, path, file_bytes, size, n, ctx, pool=None) -> tuple:
    """(contiguous, scattered, staged): amortized seconds per read of `n` random aligned
    `size`-byte reads of an evicted file through the AIO context `ctx`: landing in one contiguous
    huge-page buffer; as size / 4 KiB pieces dealt over three arrays (segment_iovecs
    'dest_scattered': a zero-copy read of neuron bundles); landing contiguously again, each read's
    rows copied into three arrays as it lands (gate / up / down rows of 4 KiB: what staging
    costs end to end, done as the loader does it: on FINISH_THREADS threads (`pool`, made here
    when None) while reads are still to be submitted, so a spare core hides the copy and a busy
    one shows it; the time includes waiting for the last copy)."""
    from .cache import evict
    from .files import address, aligned_buffer, copy_rows

    if pool is None:
        with ThreadPoolExecutor(FINISH_THREADS, thread_name_prefix="calibrate-copy") as own:
            return timed_segment_reads(fd, path, file_bytes, size, n, ctx, own)
    buf = aligned_buffer(n * (size + 2 * 4096))
    base, flat = address(buf), np.frombuffer(buf, np.uint8)
    bundles = size // (3 * 4096)  # per read
    # the rows copied into: faulted in, in huge pages where granted, as the loader's alloc() rows
    rows = [np.frombuffer(aligned_buffer(n * bundles * 4096), np.uint8)[: n * bundles * 4096]
            .reshape(n * bundles, 4096) for _ in range(3)]
    out = []
    for kind in ("contiguous", "scattered", "staged"):
        evict([path])
        offsets = np.array([random.randrange(0, file_bytes - size + 1) // 4096 * 4096 for _ in range(n)])
        fds, on_done = np.full(n, fd), None
        if kind == "scattered":
            iov = segment_iovecs("dest_scattered", base, size, n)
            per = len(iov) // n
            args = (fds, offsets, np.full(n, per), iov.ctypes.data + np.arange(n, dtype=np.uint64)
                    * np.uint64(per * iov.itemsize), np.ones(n, bool))
        else:
            args = (fds, offsets, np.full(n, size), base + size * np.arange(n, dtype=np.uint64))
        copies = []
        if kind == "staged":
            def copy_out(landed):  # the loader's copy (files.copy_rows) of each landed read's rows
                j = np.arange(bundles)
                starts = (landed[:, None] * size + j[None, :] * 3 * 4096).reshape(-1)
                slots = (landed[:, None] * bundles + j[None, :]).reshape(-1)
                for c, mat in enumerate(rows):
                    copy_rows(flat, starts + c * 4096, 4096, mat, slots)

            def on_done(idx, res):  # as the loader finishes staged reads: on its finishing
                # threads while reads are still to be submitted, then on the reaping thread
                if ctx.all_submitted:
                    copy_out(idx)
                else:
                    copies.append(pool.submit(copy_out, idx.copy()))
        t0 = time.perf_counter()
        res = ctx.read(*args, on_done=on_done)
        for f in copies:
            f.result()
        if (res != size).any():
            raise OSError(f"calibration read failed on {path}")
        out.append((time.perf_counter() - t0) / n)
    return tuple(out)


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
    slows a run). engine 'aio' uses Linux native AIO when direct I/O works, else threads; with
    AIO the segment term (reads of each LANDING_SIZES size, capped at the largest of `sizes`, as
    scattered 4 KiB pieces vs one piece, at the largest depth: the median difference of
    max(repeats, SEGMENT_REPEATS) rounds taking turns) and the copy term (the same reads landing
    contiguously, each copied into three row arrays as it lands, vs not copied:
    timed_segment_reads) are measured too, per size (ReadCostCurve.landing).
    """
    import os
    from pathlib import Path

    from . import aio
    from .files import FileLayer

    files = files or FileLayer()
    started = load_sample()
    if read_path is None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f".mlx_flash_read_cost_{os.getpid()}"
    else:
        path = Path(read_path)
        file_bytes = path.stat().st_size
    sizes = [s for s in sizes if s <= file_bytes // 2] or [min(sizes)]
    table = np.zeros((len(depths), len(sizes)))
    used, landing = "threads", {"sizes": [], "segment_s": [], "copy_bandwidth": []}
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
                    seg_sizes = sorted({min(s, max(sizes)) // 4096 * 4096 for s in LANDING_SIZES})
                    for seg_size in seg_sizes:
                        if ctx is None or depth != max(depths) or seg_size < 8192 or file_bytes < 2 * seg_size:
                            continue
                        n = max(4 * depth, min(max_reads, file_bytes // seg_size))
                        runs = np.array([timed_segment_reads(fd, path, file_bytes, seg_size, n, ctx)
                                         for _ in range(max(repeats, SEGMENT_REPEATS))])
                        extra = np.median(runs[:, 1:] - runs[:, :1], axis=0)  # scattered, staged
                        landing["sizes"].append(seg_size)
                        landing["segment_s"].append(max(0.0, float(extra[0]) / (seg_size // 4096 - 1)))
                        landing["copy_bandwidth"].append(seg_size / max(float(extra[1]), seg_size / FREE_COPY))
                finally:
                    if ctx is not None:
                        ctx.close()
        finally:
            files.close(fd)
    finally:
        if read_path is None:
            path.unlink(missing_ok=True)
    table = np.maximum.accumulate(table, axis=1)  # a larger read never costs less: noise otherwise
    return ReadCostCurve(list(sizes), list(depths), table.tolist(), engine=used,
                         landing=landing if landing["sizes"] else None, load=load_since(started),
                         measured=time.strftime(MEASURED_FORMAT))
