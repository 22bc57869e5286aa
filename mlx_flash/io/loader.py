"""FlashLoader: read neuron / expert bundles of a pack straight into preallocated MLX arrays."""

import importlib
import os
import queue
import sys
import threading
import time
import zlib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..errors import FlashError
from ..pack.bitmap import check_crc32s
from ..pack.layout import Bundle, layer_bundles, mx_dtype, read_manifest
from ..pack.reader import bundle_crc32, endor_roles, read_bundle_index, read_checksum_table
from ..paths import flash_home
from . import aio
from .files import (IOV_MAX, FileLayer, address, aligned_buffer, copy_rows, copy_rows_kernel, read_full,
                    use_huge_pages)
from .planner import (DEFAULT_MAX_READ, ReadCost, ReadPlan, calibrate, load_cost, member_reads,
                      plan_read_arrays, plan_strided, sort_bundle_ids)
from .read_cost import FINISH_THREADS, stage_saves_time

# A bundle file this large is measured in place (read-only): random reads of up to 1 MiB need room.
CALIBRATION_MIN_BYTES = 16 << 20
# Mean AIO read size (bytes) from which each completion is handled as it lands (min_nr 1): few
# completions per second, so the per-completion Python cost is small next to an earlier check.
LARGE_READ = 256 << 10
# Landed staged bytes handed over per copy-out (bytes): copies keep pace with the reads, so a
# request's copy after its last read is at most this (~0.5 ms), at ~0.1 ms of Python per hand-over.
STAGED_BATCH = 4 << 20


def measure_cost(paths, threads, engine) -> ReadCost | None:
    """The read cost of the device holding `paths` (a pack's bundle files), measured without ever
    writing into the pack: on the largest file (read-only) when it is big enough for random reads,
    else on a scratch file in the cache home when that is on the same device; None (one read per
    bundle run, no merging) when neither is possible. Stored for the device (load_cost)."""
    try:
        largest = max(paths, key=lambda p: p.stat().st_size)
        if largest.stat().st_size >= CALIBRATION_MIN_BYTES:
            return calibrate(threads=threads, read_path=largest, key_path=paths[0], engine=engine)
        home = flash_home()
        home.mkdir(parents=True, exist_ok=True)
        if os.stat(home).st_dev == os.stat(paths[0]).st_dev:
            return calibrate(home, threads=threads, key_path=paths[0], engine=engine)
    except (OSError, ValueError):  # an unreadable file is reported by the read that needs it
        return None
    return None


def _crc32_function():
    """zlib's crc32 as (bytes, start crc) -> crc: the kernels' PCLMULQDQ version when the
    extension has it (~5x zlib here, GIL released), else zlib's."""
    try:
        ext = importlib.import_module("mlx_flash._ext")  # by name: the compiled module is optional
        kernel = ext.endor_crc32
    except (ImportError, AttributeError):
        return zlib.crc32
    return lambda data, crc=0: kernel(np.asarray(data, np.uint8).reshape(-1), crc, None)


crc32 = _crc32_function()


def _crc32_ranges_function():
    """The kernels' crc32_ranges(flat, starts, length, crcs) (crcs[b] = crc32 of flat[starts[b]:
    starts[b] + length] chained on crcs[b], in place, GIL released), or None when the extension
    is missing or older."""
    try:
        return importlib.import_module("mlx_flash._ext").crc32_ranges
    except (ImportError, AttributeError):
        return None


crc32_ranges = _crc32_ranges_function()


def _checksum_mismatch(job, i: int) -> FlashError:
    """The error for bundle job.ids[i] of a request whose bytes fail their crc32."""
    return FlashError(f"{job.f.path}: checksum mismatch in bundle {job.ids[i]} (offset {int(job.starts[i])})")


def _check_crcs(job, members, crcs) -> None:
    """Raise _checksum_mismatch for the first of bundles `members` (indices into job.ids; None:
    every bundle, without index arrays) whose crc32 in `crcs` differs from the file's table."""
    ids = job.ids if members is None else job.ids[members]
    bad = np.flatnonzero(crcs != job.f.crc[ids])
    if len(bad):
        raise _checksum_mismatch(job, int(bad[0] if members is None else members[bad[0]]))


def _segments_per_read(targets, slots, first) -> np.ndarray:
    """Destination pieces of each planned read landing zero copy (read k holds bundles
    first[k]..first[k + 1] - 1 going to rows slots[...]): one per bundle and component when a
    bundle goes to several arrays, else one per run of consecutive rows (memory contiguous).
    Merge gaps and edges, which land in scratch, are not counted."""
    if len(first) == 0:
        return np.zeros(0, np.int64)
    if len(targets) > 1:
        return np.diff(np.append(first, len(slots))) * len(targets)
    breaks = np.zeros(len(slots), np.int64)
    breaks[1:] = np.diff(slots) != 1
    breaks[first] = 0  # every read starts a piece of its own
    return 1 + np.add.reduceat(breaks, first)


def _staged_offsets(job) -> np.ndarray:
    """Where each bundle of a staged job sits in the staging buffer (bytes), computed once per job:
    the landed crc32s and the copy out both need it."""
    if job.staged_at is None:
        reads = job.member_read
        job.staged_at = job.pos[reads] + job.starts - job.r0[reads]
    return job.staged_at


def _members_of(job, reads) -> np.ndarray:
    """Indices into job.ids of the bundles that planned reads `reads` (indices) hold, read by
    read: array ops over those reads only (a batch of landed reads of a large request)."""
    reads = np.asarray(reads, np.int64)
    lo = job.first[reads]
    hi = np.append(job.first, len(job.ids))[reads + 1]
    counts = hi - lo
    return np.repeat(lo - (np.cumsum(counts) - counts), counts) + np.arange(int(counts.sum()))


def _per_dest(store: dict, key, dest, make):
    """make()'s result for (key, destination `dest`: a dict of arrays or one array), kept in `store`
    (at most 1024 entries, each holding its arrays so that their ids stay unique)."""
    arrays = tuple(dest.values()) if isinstance(dest, dict) else (dest,)
    full = (key, tuple(map(id, arrays)))
    hit = store.get(full)
    if hit is not None and all(a is b for a, b in zip(hit[0], arrays)):
        return hit[1]
    result = make()
    if len(store) >= 1024:
        store.pop(next(iter(store)))
    store[full] = (arrays, result)
    return result


@dataclass
class ReadStats:
    """What one `read` call did. Bytes are file bytes; seconds is wall time of the call."""
    bundles: int = 0
    reads: int = 0
    bytes_useful: int = 0
    bytes_read: int = 0
    zero_copy_reads: int = 0
    bounced_reads: int = 0
    seconds: float = 0.0
    decode_seconds: float = 0.0  # ENDOR: crc32 check + decode, part of `seconds` (overlaps reads)
    direct: bool = False
    read_sizes: dict = field(default_factory=dict)  # bytes per read -> number of reads

    def add(self, other: "ReadStats"):
        for k in ("bundles", "reads", "bytes_useful", "bytes_read", "zero_copy_reads",
                  "bounced_reads", "seconds", "decode_seconds"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        for size, n in other.read_sizes.items():
            self.read_sizes[size] = self.read_sizes.get(size, 0) + n


def host_bytes(arr) -> np.ndarray:
    """Writable uint8 numpy view sharing memory with an evaluated, row-contiguous MLX array."""
    mx.eval(arr)
    mv = memoryview(arr)
    if not mv.c_contiguous:
        raise FlashError("destination array is not row-contiguous (slice it before allocating)")
    return np.frombuffer(mv.cast("B"), np.uint8)


def _count_job(stats, job, pos: int) -> int:
    """Add a prepared job's reads to `stats` and give its staged reads positions from `pos` in
    the staging buffer (job.pos); returns the staging bytes used so far."""
    sizes = job.r1 - job.r0
    ends = np.cumsum(sizes)
    read_bytes = int(ends[-1]) if len(ends) else 0
    if not job.zero_copy:
        job.pos = pos + ends - sizes
        pos += read_bytes
    stats.direct = job.f.direct
    stats.bundles += len(job.ids)
    stats.bytes_useful += (int(job.lengths.sum()) if job.lengths is not None
                           else len(job.ids) * sum(n for _, n in job.pieces))
    stats.reads += len(sizes)
    stats.bytes_read += read_bytes
    for n, k in sorted(Counter(sizes.tolist()).items()):  # Counter: a C loop, ~10x np.unique on a few reads
        stats.read_sizes[n] = stats.read_sizes.get(n, 0) + k
    stats.zero_copy_reads += len(sizes) if job.zero_copy else 0
    stats.bounced_reads += 0 if job.zero_copy else len(sizes)
    return pos


@dataclass
class _Open:
    path: Path
    fd: int
    direct: bool
    buffered_fd: int | None = None
    crc: np.ndarray | None = None
    index: np.ndarray | None = None  # ENDOR layers: file offsets of bundles 0..count
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class _Job:
    """One request, prepared: where its bundles are and where they go."""
    f: _Open
    entry: dict
    targets: list  # [(offset in bundle, length, uint8 matrix [rows, length])]
    raw: bool
    ids: np.ndarray  # sorted bundle ids
    slots: np.ndarray  # destination row of each id
    starts: np.ndarray  # file offset of each bundle
    stride: int
    zero_copy: bool  # read straight into dest: every iovec aligned, and no dearer than staging
    pieces: list  # [(offset, length)] of the components inside a bundle
    tight: int  # bytes covered by the components when they are packed without padding, else 0
    r0: np.ndarray  # file offset of each planned read
    r1: np.ndarray  # its end
    first: np.ndarray  # first bundle (index into ids) of each read
    member_read: np.ndarray  # planned read holding each bundle
    pos: np.ndarray | None = None  # staging position of each planned read
    lengths: np.ndarray | None = None  # ENDOR layers: encoded bytes of each bundle (ids order)
    roles: list | None = None  # ENDOR layers: decode destinations (pack.reader.endor_roles)
    decode_s: float = 0.0  # ENDOR layers: seconds spent checking + decoding (finishing thread)
    iov: np.ndarray | None = None  # zero-copy AIO: iovecs of every read, in order (aio.IOVEC)
    iov_counts: np.ndarray | None = None  # iovecs of each read
    scratch: memoryview | None = None  # where gap iovecs point: kept alive while reads fly
    staged_at: np.ndarray | None = None  # staged jobs: each bundle's offset in staging (_staged_offsets)


class FlashLoader:
    """Reads bundles of one pack. Thread-safe for reads into disjoint destination rows.

    threads: parallel reads in flight (default 32, as in the paper).
    direct: bypass the page cache (O_DIRECT / F_NOCACHE; posix_fadvise fallback).
    verify: check each bundle's crc32 after reading it (the kernels' crc32 when built: ~20 GB/s of
      one core here; zlib's: ~4 GB/s).
    plan: merge neighbouring bundles into larger reads using `cost` (a ReadCost); cost=None
      loads the machine profile, calibrating once (a few seconds) if there is none. The cost's
      segment and copy terms also decide whether reads whose destination is many pieces land
      there directly or in one contiguous staging buffer, copied out (read_cost.stage_saves_time).
    files: the FileLayer (inject faults in tests).
    """

    def __init__(self, pack_dir, *, threads=32, direct=True, verify=True, plan=True,
                 cost: ReadCost | None = None, max_read=DEFAULT_MAX_READ,
                 files: FileLayer | None = None, engine="auto"):
        self.pack = Path(pack_dir)
        self.manifest = read_manifest(self.pack)
        self.bundles = layer_bundles(self.manifest)
        self.alignment = self.manifest.alignment
        self.threads, self.direct, self.verify = threads, direct, verify
        self.merge_reads = plan  # the planner merges neighbouring bundles by `cost`
        self.max_read = max_read
        self.files = files or FileLayer()
        self._open_files: dict[int, _Open] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        self._workers: list[threading.Thread] = []
        self._tasks = None
        self._aio_contexts = []
        self._started = {}  # start_read key -> {"ctx": its AioContext, "staging": its buffer}
        self._finish_pool = None
        self._target_cache = {}
        self._at_once_cache = {}
        self._layout_cache = {}
        self._pieces_cache = {}
        self._stream_reads = None  # decode_reads' (AioContext, staging) of the MLX stream's thread
        self._ahead_reads = None  # decode_lookahead_io's (AioContext, staging)
        if engine not in ("auto", "threads", "aio"):
            raise FlashError(f"engine {engine!r}: choose auto, threads or aio")
        self.engine = engine
        if plan and cost is None and self.bundles:
            cost = self._measured_cost()
        self.cost = cost

    def stored_cost(self) -> ReadCost | None:
        """The stored cost model of the pack's device for this loader's engine, priced at its
        threads (planner.load_cost), or None when none is stored (or the pack has no bundles)."""
        first = next(iter(self.bundles.values()), None)
        return load_cost(self.pack / first.file, self.threads, self.cost_engine()) if first else None

    def _measured_cost(self) -> ReadCost | None:
        """The stored cost model of the pack's device, else measure_cost's."""
        paths = [self.pack / e.file for e in self.bundles.values()]
        return self.stored_cost() or measure_cost(paths, self.threads, self.cost_engine())

    # -- layout -------------------------------------------------------------------------------
    def entry(self, layer) -> Bundle:
        try:
            return self.bundles[layer]
        except KeyError:
            raise FlashError(f"{self.pack}: no bundle file for layer {layer}") from None

    def alloc(self, layer, n) -> dict:
        """{component name: zeroed mx.array [n, *component shape]} to read `n` bundles into."""
        return {c.name: self._aligned_zeros((n, *c.shape), mx_dtype(c.dtype))
                for c in self.entry(layer).components}

    def alloc_raw(self, layer, n) -> mx.array:
        """A uint8 mx.array [n, stride] of whole bundles (dense layers only)."""
        if self.entry(layer).encoding == "endor":
            raise FlashError(f"{self.pack}: layer {layer} is ENDOR-encoded: read it with alloc()")
        return self._aligned_zeros((n, self.entry(layer).stride), mx.uint8)

    def _aligned_zeros(self, shape, dtype) -> mx.array:
        """Zeroed, evaluated MLX array whose memory starts on an `alignment` boundary (a view
        into a slightly larger buffer), so direct reads can land in it when row sizes allow;
        its 2 MiB-aligned part in transparent huge pages on Linux (files.use_huge_pages)."""
        nbytes = int(np.prod(shape)) * dtype.size
        base = mx.zeros((nbytes + self.alignment,), dtype=mx.uint8)
        mx.eval(base)
        host = host_bytes(base)
        skip = -address(host) % self.alignment
        use_huge_pages(host[skip: skip + nbytes])  # reads land faster in 2 MiB pages
        arr = base[skip: skip + nbytes].view(dtype).reshape(shape)
        mx.eval(arr)
        return arr

    # -- reading ------------------------------------------------------------------------------
    def read(self, layer, ids, dest, slots=None) -> ReadStats:
        """Read bundles `ids` of `layer` into rows `slots` (default 0..len-1) of `dest`.

        dest: the dict from `alloc` (components scattered into separate arrays) or the uint8
        array from `alloc_raw` (whole bundles). On FlashError the destination rows are undefined.
        """
        return self.read_many([(layer, ids, dest, slots)])

    def read_at_once(self, layer, ids, dest, slots=None, max_bytes=None) -> ReadStats | None:
        """`read(layer, ids, dest, slots)` of a decode-sized call in one kernel call: planned, read,
        checked and copied out by aio_read_ids (kernels/aio_read.h), no Python per step of it; or
        None, nothing read, when the call cannot go that way: no such kernel, not native-AIO
        direct reads of a plain layer that `read` would stage, or reads that stage more than
        `max_bytes` (and STAGED_BATCH, the most `read` stages in one kernel call). `ids`: bundle
        ids in any order, unique; `slots`: their rows (default 0..). A call whose reads do not all
        land whole, or whose bytes fail their crc32, is redone (or refused) by `read` itself."""
        t0 = time.perf_counter()
        fast = self._at_once(layer, dest)
        if fast is None:
            return None
        fd, layout, rule, pieces, targets, table, useful = fast
        ids = np.ascontiguousarray(ids, np.int64)
        slots = np.arange(len(ids), dtype=np.int64) if slots is None else np.ascontiguousarray(slots, np.int64)
        limit = STAGED_BATCH if max_bytes is None else min(int(max_bytes), STAGED_BATCH)
        plan = np.empty((8, len(ids)), np.int64)
        ctx = self._aio_context()
        flat = np.frombuffer(self._staging(1), np.uint8)[:limit]  # a larger buffer stages no more
        reads, staged, fits, short, bad = ctx.read_ids(fd, layout, rule, ids, slots, table, flat, pieces,
                                                       targets, plan)
        if reads >= 0 and not fits:
            if staged > limit:
                return None
            flat = np.frombuffer(self._staging(staged), np.uint8)[:limit]
            reads, staged, fits, short, bad = ctx.read_ids(fd, layout, rule, ids, slots, table, flat, pieces,
                                                           targets, plan)
        if reads < 0 or short or bad >= 0:  # a bad id, short reads, a checksum: `read` says or redoes it
            stats = self.read(layer, ids, dest, slots)
            stats.seconds = time.perf_counter() - t0
            return stats
        sizes = plan[5, :reads] - plan[4, :reads]
        stats = ReadStats(bundles=len(ids), reads=reads, bytes_useful=len(ids) * useful, bytes_read=staged,
                          bounced_reads=reads, direct=True, read_sizes=dict(Counter(sizes.tolist())))
        stats.seconds = time.perf_counter() - t0
        return stats

    def _at_once(self, layer, dest):
        """What read_at_once passes the kernel for reads of `layer` into `dest` (fd, (count,
        offset, stride), (align, merge, merge gap, max read), crc32 pieces, targets, crc32 table
        or None, useful bytes per bundle), or None when such reads cannot go that way; kept per
        destination (a runtime reads into the same arrays every token)."""
        return _per_dest(self._at_once_cache, layer, dest, lambda: self._make_at_once(layer, dest))

    def _make_at_once(self, layer, dest):
        if aio.read_ids_kernel is None or self.engine == "threads" or not self._native_aio():
            return None
        entry = self.entry(layer)
        if entry.encoding == "endor":
            return None
        f = self._file(layer, entry)
        if not f.direct:
            return None
        targets, _, _ = self._targets(entry, dest)
        pieces, tight, aligned = self._layout(entry, f, targets)
        if aligned:  # `read` may land these straight in their rows: keep its choice
            return None
        self._load_crcs(f, entry)
        merge = self.merge_reads and self.cost is not None
        rule = (self.alignment, merge, self.cost.merge_gap_for(int(entry.stride)) if merge else 0, self.max_read)
        return (f.fd, (entry.count, entry.offset, entry.stride), rule, self._pieces_of(tight, pieces), targets,
                f.crc if self.verify else None, sum(n for _, n in pieces))

    def decode_reads(self, layer, dest, staging_bytes=None):
        """How the sparse-decode primitive (kernels/sparse_decode.h) reads bundles of `layer` into
        `dest` (alloc's layout; the same offsets serve the layer's cache rows) from the MLX stream's
        thread: a dict of sparse_decode_state's read arguments (fd, layout, rule, crc32 table and
        pieces, each component's offset and bytes, the pack file's path, an AIO context and a
        staging buffer only that thread uses: made by the first call, for calls of at most
        `staging_bytes` (None: STAGED_BATCH); the primitive splits a call it does not fit), or
        None when read_at_once would not take such reads either."""
        fast = self._at_once(layer, dest)
        if fast is None:
            return None
        fd, layout, rule, pieces, targets, table, _ = fast
        if self._stream_reads is None:  # made once: every call runs on the one CPU stream thread
            # in the calling thread's staging: that thread and the stream's never stage at once
            # (_staging waits for MLX's pending work before the calling thread stages again), so
            # the primitives take no staging beyond the one the memory plan counts
            size = self._stage_size(staging_bytes)
            staging = self._staging(size)
            self._stream_reads = (self._new_context(), np.frombuffer(staging, np.uint8)[:size], threading.get_ident())
        ctx, staging, _ = self._stream_reads
        return {"ctx": ctx.handle, "fd": fd, "count": layout[0], "offset": layout[1], "stride": layout[2],
                "align": rule[0], "merge": rule[1], "merge_gap": rule[2], "max_read": rule[3], "table": table,
                "piece_off": pieces[0], "piece_len": pieces[1], "comp_off": [int(t[0]) for t in targets],
                "comp_len": [int(t[1]) for t in targets], "staging": staging, "depth": ctx.depth,
                "spin_ns": ctx.spin_ns, "path": str(self._file(layer, self.entry(layer)).path)}

    def decode_lookahead_io(self, staging_bytes=None) -> tuple:
        """(AIO context handle, staging) for the decode primitives' lookahead reads (kernels/
        sparse_decode.h's Lookahead): their own context, so that a layer's call reaps only its own
        reads on decode_reads' context, and their own staging (`staging_bytes`, None: STAGED_BATCH),
        used by the MLX stream's thread only. Made once."""
        if self._ahead_reads is None:
            size = self._stage_size(staging_bytes)
            self._ahead_reads = (self._new_context(), np.frombuffer(aligned_buffer(size), np.uint8)[:size])
        ctx, staging = self._ahead_reads
        return ctx.handle, staging

    def kernel_reads(self, step, layer, bundles, cache_bundles, nbytes, reads, seconds) -> None:
        """Reads a kernel made with decode_reads' arguments, reported once it ran (step: the flash
        step's index; `bundles` of `layer`, `cache_bundles` of them straight into cache rows;
        `nbytes` in `reads` reads, `seconds`). Their bytes and counts are in the flash stats
        already: nothing to do here; a wrapper that logs the loader's reads (bench) logs them."""

    def read_many(self, requests) -> ReadStats:
        """Several `read`s, [(layer, ids, dest, slots or None)], issued together.

        Worker threads only do I/O: into the destination rows (zero copy) or into this calling
        thread's staging buffer at precomputed positions. The calling thread checks and scatters
        each request with a few vectorised numpy copies as soon as its reads are done, while the
        workers go on with the next request's reads.
        """
        t0 = time.perf_counter()
        stats = ReadStats()
        jobs, pos = [], 0
        for layer, ids, dest, slots in requests:
            job = self._prepare(layer, ids, dest, slots)
            jobs.append(job)
            pos = _count_job(stats, job, pos)
        staging = self._staging(pos) if pos else None
        flat = np.frombuffer(staging, np.uint8) if staging is not None else None
        use_aio = [self._aio_ok(job) for job in jobs]
        done, remaining = queue.SimpleQueue(), []
        for tag, job in enumerate(jobs):
            items = [] if use_aio[tag] else self._items(job)
            if items:
                self._start_workers()
            per_task = max(1, min(8, -(-len(items) // self.threads)))
            tasks = [items[i: i + per_task] for i in range(0, len(items), per_task)]
            for t in tasks:
                self._tasks.put((staging, t, done, tag))
            remaining.append(len(tasks))
        outstanding, error = sum(remaining), None
        try:
            for tag, job in enumerate(jobs):
                if remaining[tag] == 0 and not use_aio[tag]:
                    self._finish(job, flat)
            aio_jobs = [job for job, a in zip(jobs, use_aio) if a]
            if aio_jobs:
                self._read_aio(aio_jobs, staging, flat)
        except FlashError as e:
            error = e
        while outstanding:  # wait for every task: no worker may still write after we return
            tag, err = done.get()
            outstanding -= 1
            remaining[tag] -= 1
            if err is not None:
                error = error or err
            elif remaining[tag] == 0 and error is None:
                try:
                    self._finish(jobs[tag], flat)
                except FlashError as e:
                    error = e
        if error is not None:
            raise error
        stats.seconds = time.perf_counter() - t0
        stats.decode_seconds = sum(job.decode_s for job in jobs)
        return stats

    def start_read(self, layer, ids, dest, slots=None, key=0) -> dict:
        """Submit the reads of `read(layer, ids, dest, slots)` and return at once: the device
        reads while the caller computes; `finish_read` reaps, checks and copies them out (until
        then the destination rows are undefined). One started read per `key` at a time, each
        with its own AIO context and staging buffer (no thread, nothing runs between the calls).
        A read native AIO cannot take is done here, in full."""
        t0 = time.perf_counter()
        job = self._prepare(layer, ids, dest, slots)
        if not self._aio_ok(job):
            return {"stats": self.read(layer, ids, dest, slots), "t0": t0}
        stats = ReadStats()
        pos = _count_job(stats, job, 0)
        started = self._started.get(key)
        if started is None:
            started = self._started[key] = {"ctx": self._new_context(), "staging": None}
        if pos and (started["staging"] is None or len(started["staging"]) < pos):
            started["staging"] = aligned_buffer(pos)
        staging = started["staging"] if pos else None
        flat = np.frombuffer(staging, np.uint8) if staging is not None else None
        submitted = started["ctx"].submit(*self._aio_batch(job, flat))
        return {"stats": stats, "t0": t0, "job": job, "ctx": started["ctx"], "submitted": submitted,
                "staging": staging, "flat": flat}

    def finish_read(self, started: dict) -> ReadStats:
        """The ReadStats of a `start_read` once its bundles are in `dest`, checked (its seconds:
        from the start to now)."""
        stats = started["stats"]
        if "job" in started:
            res = started["ctx"].wait(started["submitted"])
            self._after_reads([started["job"]], res, None, started["staging"], started["flat"])
            stats.seconds = time.perf_counter() - started["t0"]
            stats.decode_seconds = started["job"].decode_s
        return stats

    def cost_engine(self) -> str:
        """'aio' or 'threads': how direct reads will be issued (the cost model depends on it)."""
        use = (self.engine != "threads" and self.direct and aio.available()
               and type(self.files) is FileLayer and hasattr(os, "O_DIRECT"))
        return "aio" if use else "threads"

    def _native_aio(self) -> bool:
        """Native AIO can read this loader's files: Linux AIO, the default FileLayer (an injected
        one sees every read)."""
        return aio.available() and type(self.files) is FileLayer and sys.platform != "darwin"

    def _load_crcs(self, f, entry) -> None:
        """Read the crc32 table of `entry`'s file once, when the loader verifies."""
        if self.verify and f.crc is None:
            with f.lock:
                if f.crc is None:
                    f.crc = read_checksum_table(f.path, entry)

    def _aio_ok(self, job) -> bool:
        """Native AIO for direct reads (into staging, or vectored straight into the destination
        rows), unless a custom file layer is injected or a read needs more than IOV_MAX iovecs."""
        if self.engine == "threads" or not job.f.direct or len(job.r0) == 0:
            return False
        ok = self._native_aio()
        if self.engine == "aio" and not ok:
            raise FlashError("engine='aio' needs Linux O_DIRECT reads and the default FileLayer")
        if ok and job.zero_copy:
            members = int(np.diff(np.append(job.first, len(job.ids))).max())
            if members * len(job.targets) * 2 + 1 <= IOV_MAX:  # gap + piece per segment, one tail
                return True  # iovecs built when the read is submitted (_aio_batch)
            job.iov, job.iov_counts = self._zero_copy_iovecs(job)
            return int(job.iov_counts.max()) <= IOV_MAX
        return ok

    def _zero_copy_iovecs(self, job):
        """(IOVEC array, iovecs per read) landing each planned read of a zero-copy job in the
        destination rows, in file order; bytes between components or bundles (merge gaps, edges)
        go to a scratch buffer whose contents nobody reads. Array ops only: no Python work per
        bundle."""
        comps = sorted(job.targets, key=lambda t: t[0])
        offs = np.array([off for off, _, _ in comps], np.int64)
        lens = np.array([n for _, n, _ in comps], np.int64)
        bases = np.array([address(mat) for _, _, mat in comps], np.uint64)
        row_bytes = np.array([mat.strides[0] for _, _, mat in comps], np.uint64)
        seg_read = np.repeat(job.member_read, len(comps))  # segments: bundle-major, component-minor
        seg_start = (job.starts[:, None] + offs[None, :]).reshape(-1)
        seg_len = np.tile(lens, len(job.ids))
        seg_addr = (bases[None, :] + job.slots.astype(np.uint64)[:, None] * row_bytes[None, :]).reshape(-1)
        seg_end = seg_start + seg_len
        first_of_read = np.ones(len(seg_read), bool)
        first_of_read[1:] = seg_read[1:] != seg_read[:-1]
        gap = seg_start - np.where(first_of_read, job.r0[seg_read], np.roll(seg_end, 1))
        last_of_read = np.append(first_of_read[1:], True)
        tail = np.where(last_of_read, job.r1[seg_read] - seg_end, 0)
        job.scratch = self._scratch(int(max(gap.max(), tail.max())))
        scratch = np.uint64(address(job.scratch))
        lengths = np.stack([gap, seg_len, tail], axis=1).reshape(-1)  # gap, piece, tail per segment
        addrs = np.stack([np.full(len(gap), scratch), seg_addr, np.full(len(gap), scratch)],
                         axis=1).reshape(-1)
        keep = lengths > 0
        iov = np.empty(int(keep.sum()), aio.IOVEC)
        iov["base"], iov["len"] = addrs[keep], lengths[keep]
        return iov, np.bincount(np.repeat(seg_read, 3)[keep], minlength=len(job.r0))

    def _read_aio(self, jobs, staging, flat):
        """All reads of `jobs` through one AIO context, job after job: the first job's reads are
        submitted at once and each later job's iovecs are built while earlier reads are in flight.
        Reads are checked (crc32) or decoded by the finishing threads as they land and each job is
        completed there when its last read is in, while this thread keeps the queue full (work
        done here would leave the device idle for its duration). Once every read is submitted,
        this thread does that work itself as reads land: nothing waits for a submission any
        more, and a hand-over to another thread costs a wake-up (milliseconds on a loaded
        machine) per call."""
        ctx = self._aio_context()
        read_bytes = sum(int(j.r1.sum() - j.r0.sum()) for j in jobs)
        if read_bytes <= STAGED_BATCH and aio.read_loop_kernel is not None:
            if len(jobs) == 1 and aio.read_staged_kernel is not None and not jobs[0].zero_copy \
                    and jobs[0].lengths is None:
                return self._read_staged(ctx, jobs[0], staging, flat)
            return self._read_aio_at_once(ctx, jobs, staging, flat)
        counts = np.array([len(j.r0) for j in jobs])
        firsts = np.cumsum(counts) - counts  # index of each job's first read in the AIO results
        left, finishing = counts.copy(), []
        # large reads land rarely: check each at once (Python per completion is then negligible)
        min_batch = 1 if read_bytes >= LARGE_READ * counts.sum() else None
        pending = iter(jobs[1:])
        # jobs with work per landed read (ENDOR decodes, staged copies, checks of zero-copy rows);
        # unchecked zero-copy jobs only count their reads until the last is in
        per_read = [not j.zero_copy or self.verify for j in jobs]
        staged_landed = [[] for _ in jobs]  # landed reads of staged jobs not yet copied out
        staged_bytes = np.zeros(len(jobs), np.int64)

        def on_done(idx, res):
            owner = np.searchsorted(firsts, idx, side="right") - 1
            inline = ctx.all_submitted
            run = (lambda fn, *a: fn(*a)) if inline else \
                (lambda fn, *a: finishing.append(self._finisher().submit(fn, *a)))
            landed_per_job = np.bincount(owner, minlength=len(jobs))
            left[:] -= landed_per_job
            for t in np.flatnonzero(landed_per_job).tolist():
                job, g0 = jobs[t], int(firsts[t])
                if per_read[t]:
                    mine = idx[owner == t] - g0
                    landed = mine[res[mine + g0] == job.r1[mine] - job.r0[mine]]
                    if len(landed) and job.lengths is not None:  # ENDOR: check + decode what landed
                        run(self._decode, job, flat, _members_of(job, landed))
                    elif not job.zero_copy:  # staged: check + copy out what landed, in batches
                        staged_landed[t].append(landed)
                        staged_bytes[t] += int((job.r1[landed] - job.r0[landed]).sum())
                        if staged_bytes[t] >= STAGED_BATCH or left[t] == 0 or inline:
                            batch = np.concatenate(staged_landed[t])
                            staged_landed[t], staged_bytes[t] = [], 0
                            if len(batch):
                                run(self._scatter, job, flat, _members_of(job, batch))
                    elif len(landed):  # crc32 of the zero-copy rows that landed, split
                        for part in np.array_split(landed, 1 if inline else min(len(landed), FINISH_THREADS)):
                            run(self._check_rows, job, _members_of(job, part))
                if left[t] == 0:
                    run(self._complete_aio, job, res[g0: g0 + counts[t]].copy(), staging, flat)

        try:
            ctx.read(*self._aio_batch(jobs[0], flat), on_done=on_done, min_batch=min_batch,
                     more=lambda: (None if (job := next(pending, None)) is None
                                   else self._aio_batch(job, flat)))
        finally:
            errors = [f.exception() for f in finishing]  # waits: no scatter may outlive the call
        for e in errors:
            if e is not None:
                raise e

    def _aio_context(self):
        """The calling thread's AIO context (made on first use)."""
        ctx = getattr(self._local, "aio", None)
        if ctx is None:
            ctx = self._local.aio = self._new_context()
            if threading.current_thread() is not threading.main_thread():
                ctx.spin_ns = 0  # background readers (prefetch, expert preload): a spin takes the core from compute
        return ctx

    def _new_context(self):
        """A new AIO context, closed with the loader."""
        ctx = aio.AioContext(self.threads)
        with self._lock:
            self._aio_contexts.append(ctx)
        return ctx

    def _stage_size(self, staging_bytes) -> int:
        """Bytes of a staging buffer for calls of at most `staging_bytes` (None: STAGED_BATCH): at
        least one planned read (max_read, aligned at both ends)."""
        return STAGED_BATCH if staging_bytes is None else max(int(staging_bytes), self.max_read + 2 * self.alignment)

    def _read_aio_at_once(self, ctx, jobs, staging, flat):
        """A small call's reads (at most STAGED_BATCH bytes, e.g. a decode token's reads of one
        layer), all of `jobs` at once: submitted and reaped by the kernels' loop in one call with
        the GIL released (AioContext.read_all), then each job checked, decoded or copied out in
        one pass. Its staged bytes would be copied out at the end anyway (one STAGED_BATCH), so
        nothing overlaps with the reads here that did in `_read_aio`'s loop; what goes is its
        Python per submission and per batch of completions (~0.2 ms per call)."""
        batches = [self._aio_batch(job, flat) for job in jobs]
        vectored = None
        if any(b[4] is not None for b in batches):
            vectored = np.concatenate([np.zeros(len(b[0]), bool) if b[4] is None else b[4] for b in batches])
        crcs = self._landed_crcs(jobs, flat)
        joined = batches[0][:4] if len(batches) == 1 else [np.concatenate([b[k] for b in batches]) for k in range(4)]
        res = ctx.read_all(*joined, vectored, landed=crcs)
        self._after_reads(jobs, res, crcs, staging, flat)

    def _read_staged(self, ctx, job, staging, flat):
        """A decode token's call (one staged job of plain bundles, at most STAGED_BATCH bytes): read,
        checked and copied out by one kernel call (AioContext.read_staged), no Python per read or
        per bundle; a call whose reads did not all land whole is finished by _after_reads."""
        pieces = self._crc_pieces(job)
        short, bad, res, crcs = ctx.read_staged(
            job.f.fd, job.r0, job.r1, job.pos, np.append(job.first, len(job.ids)), job.starts, job.ids,
            job.f.crc if self.verify else None, flat, pieces, job.targets, job.slots)
        if short:
            self._after_reads([job], res, (crcs,) if self.verify else None, staging, flat)
        elif bad >= 0:
            raise _checksum_mismatch(job, bad)

    def _crc_pieces(self, job):
        """(offsets, lengths) int64 arrays of the byte ranges of a bundle its crc32 covers: the
        packed components as one range, else each component (kept per layout)."""
        return self._pieces_of(job.tight, job.pieces)

    def _pieces_of(self, tight, pieces):
        """_crc_pieces of a layout: (tight, pieces) as `_layout` gives them."""
        key = (tight, tuple(pieces))
        got = self._pieces_cache.get(key)
        if got is None:
            pieces = [(0, tight)] if tight else pieces
            got = self._pieces_cache[key] = (np.array([o for o, _ in pieces], np.int64),
                                              np.array([k for _, k in pieces], np.int64))
        return got

    def _after_reads(self, jobs, res, crcs, staging, flat):
        """Check and copy out (staged) or check (zero copy) the bundles of jobs whose reads all
        finished (res: each read's AIO result, jobs' reads in order; crcs: `_landed_crcs`' taken
        as they landed, or None), redoing short or failed reads (_complete_aio)."""
        first = bundle = 0
        for job in jobs:
            results = res[first: first + len(job.r0)]
            first += len(job.r0)
            landed = np.flatnonzero(results == job.r1 - job.r0)
            got = None if crcs is None else crcs[-1][bundle: bundle + len(job.ids)]
            bundle += len(job.ids)
            if len(landed) == len(job.r0):
                if got is None:
                    self._finish(job, flat)
                else:
                    _check_crcs(job, None, got)
                    self._scatter(job, flat, checked=True)
                continue
            if len(landed):  # the short or failed reads are redone by _complete_aio
                members = np.arange(len(job.ids)) if len(landed) == len(job.r0) else _members_of(job, landed)
                if got is not None:  # checked as they landed: compare, then copy out
                    _check_crcs(job, members, got[members])
                    self._scatter(job, flat, members, checked=True)
                elif not job.zero_copy:
                    self._scatter(job, flat, members)
                elif self.verify:
                    self._check_rows(job, members)
            if len(landed) < len(job.r0):
                self._complete_aio(job, results.copy(), staging, flat)

    def _landed_crcs(self, jobs, flat):
        """read_all's `landed` argument for a call whose every job is staged plain bundles (no
        ENDOR) with one component layout, checked (verify): their crc32s taken as each read lands,
        while later reads fly, instead of in one pass after the last; else None."""
        if not self.verify or flat is None or any(j.zero_copy or j.lengths is not None for j in jobs) \
                or any(j.pieces != jobs[0].pieces for j in jobs):
            return None
        piece_arrays = self._crc_pieces(jobs[0])
        if len(jobs) == 1:  # one job: no joining
            job = jobs[0]
            return (flat, np.append(job.first, len(job.ids)), _staged_offsets(job), *piece_arrays,
                    np.zeros(len(job.ids), np.uint32))
        starts, firsts, n = [], [], 0
        for job in jobs:
            starts.append(_staged_offsets(job))
            firsts.append(job.first + n)
            n += len(job.ids)
        return (flat, np.concatenate([*firsts, [n]]).astype(np.int64), np.concatenate(starts).astype(np.int64),
                *piece_arrays, np.zeros(n, np.uint32))

    def _aio_batch(self, job, flat):
        """(fds, offsets, sizes, addresses, vectored) of a job's reads for AioContext.read:
        vectored straight into the destination rows (zero copy) or into staging."""
        n = len(job.r0)
        fds = np.full(n, job.f.fd)
        if not job.zero_copy:
            return fds, job.r0, job.r1 - job.r0, np.uint64(address(flat)) + job.pos.astype(np.uint64), None
        if job.iov is None:
            job.iov, job.iov_counts = self._zero_copy_iovecs(job)
        first = (np.cumsum(job.iov_counts) - job.iov_counts).astype(np.uint64)
        return (fds, job.r0, job.iov_counts,
                np.uint64(job.iov.ctypes.data) + np.uint64(aio.IOVEC.itemsize) * first, np.ones(n, bool))

    def _finisher(self) -> ThreadPoolExecutor:
        """The threads that check and scatter what AIO reads landed (started on first use)."""
        if self._finish_pool is None:
            with self._lock:
                if self._finish_pool is None:
                    self._finish_pool = ThreadPoolExecutor(FINISH_THREADS,
                                                           thread_name_prefix="flash-finish")
        return self._finish_pool

    def _complete_aio(self, job, results, staging, flat):
        """Redo a finished job's short or failed reads carefully (EINTR, retries, EOF), then decode
        (ENDOR), check and copy out (staged) or check (zero copy) their bundles; the bundles of
        the reads that landed were handled as they landed. results: AIO result of each read."""
        bounds, sizes = np.append(job.first, len(job.ids)), job.r1 - job.r0
        redone = np.flatnonzero(results != sizes)
        for k in redone.tolist():
            r0, n = int(job.r0[k]), int(sizes[k])
            if job.zero_copy:
                buffers = self._member_iovecs(job, r0, r0 + n, range(bounds[k], bounds[k + 1]))
            else:
                buffers = [staging[int(job.pos[k]): int(job.pos[k]) + n]]
            read_full(self.files, job.f.fd, buffers, r0, job.f.path, job.f.buffered_fd)
        if not len(redone):  # every read landed, and was decoded / copied / checked then
            return
        redone_members = _members_of(job, redone)
        if not job.zero_copy:  # ENDOR decodes, staged bundles are checked and copied out
            self._scatter(job, flat, redone_members)
        elif self.verify:
            self._check_rows(job, redone_members)

    def _items(self, job):
        """[(file, offset, bytes, staging position or iovec list)] for a prepared request."""
        sizes = (job.r1 - job.r0).tolist()
        if not job.zero_copy:
            return list(zip([job.f] * len(sizes), job.r0.tolist(), sizes, job.pos.tolist()))
        bounds = np.append(job.first, len(job.ids)).tolist()
        return [(job.f, r0, n, self._member_iovecs(job, r0, r0 + n, range(bounds[k], bounds[k + 1])))
                for k, (r0, n) in enumerate(zip(job.r0.tolist(), sizes))]

    def _finish(self, job, flat):
        if job.zero_copy:
            if self.verify:
                self._check_rows(job, range(len(job.ids)))
        else:
            self._scatter(job, flat)

    def _start_workers(self):
        if self._workers:
            return
        with self._lock:
            if not self._workers:
                self._tasks = queue.SimpleQueue()
                for i in range(self.threads):
                    w = threading.Thread(target=self._worker, name=f"flash-read-{i}", daemon=True)
                    w.start()
                    self._workers.append(w)

    def _worker(self):
        tasks = self._tasks
        while (task := tasks.get()) is not None:
            staging, items, done, tag = task
            try:
                self._io(staging, items)
                done.put((tag, None))
            except BaseException as e:  # noqa: BLE001  (handed to the caller, which raises it)
                done.put((tag, e))

    def _io(self, staging, items):
        """A worker's task: each item is (file, offset, bytes, staging position or iovec list)."""
        files, read_into = self.files, self._read_into
        for f, r0, n, dst in items:
            read_into(f, [staging[dst: dst + n]] if dst.__class__ is int else dst, r0, n)
            if not f.direct:
                files.drop_cache(f.fd, r0, n)

    def read_encoded(self, layer, out=None):
        """(words, offsets, ReadStats): the bundles of an ENDOR layer, all of them, read as stored
        (not decoded), for kernels that decode while they compute (mlx_flash.metal.endor).

        words: uint32 mx.array holding the layer's bundle bytes (`out`, a previous call's words,
        is reused when large enough); offsets: int64 [count + 1] byte offsets of the bundles in
        it. The worker threads read straight into it in `max_read` pieces (direct reads cover
        the aligned range); each bundle's crc32 is checked when the loader verifies."""
        entry = self.entry(layer)
        f = self._file(layer, entry)
        if entry.encoding != "endor":
            raise FlashError(f"{f.path}: layer {layer} is not ENDOR-encoded")
        with f.lock:
            if f.index is None:
                f.index = read_bundle_index(f.path, entry)
            if self.verify and f.crc is None:
                f.crc = read_checksum_table(f.path, entry)
        t0 = time.perf_counter()
        align = self.alignment if f.direct else 1
        r0 = entry.offset // align * align
        r1 = -(-(entry.offset + entry.length) // align) * align
        if out is None or out.size * 4 < r1 - r0:
            out = self._aligned_zeros((-(-(r1 - r0) // 4),), mx.uint32)
        buf = memoryview(host_bytes(out))
        items = [(f, r0 + p, min(self.max_read, r1 - r0 - p), p) for p in range(0, r1 - r0, self.max_read)]
        done, error = queue.SimpleQueue(), None
        if items:
            self._start_workers()
        per_task = max(1, -(-len(items) // self.threads))
        tasks = [items[i: i + per_task] for i in range(0, len(items), per_task)]
        for t in tasks:
            self._tasks.put((buf, t, done, 0))
        for _ in tasks:  # wait for every task: no worker may still write after we return
            error = error or done.get()[1]
        if error is not None:
            raise error
        offsets = f.index - r0
        if self.verify:  # every bundle's crc32 in one C++ pass over the thread pool, GIL released
            check_crc32s(host_bytes(out), offsets[:-1], np.diff(offsets), f.crc, str(f.path), offsets=f.index)
        sizes = [n for _, _, n, _ in items]
        stats = ReadStats(bundles=entry.count, reads=len(items), bytes_useful=entry.length,
                          bytes_read=r1 - r0, zero_copy_reads=len(items), direct=f.direct,
                          seconds=time.perf_counter() - t0)
        for n in sizes:
            stats.read_sizes[n] = stats.read_sizes.get(n, 0) + 1
        return out, offsets, stats

    def decode_encoded(self, layer, words, offsets, dest) -> float:
        """Decode every bundle of an ENDOR layer held as stored (`read_encoded`'s words and
        offsets) into `dest` (from `alloc`): one kernel pass over the thread pool, no crc32 check
        (read_encoded checked the bytes). Returns the seconds it took."""
        from ..pack.bitmap import decode_into

        t0 = time.perf_counter()
        entry = self.entry(layer)
        targets, rows, _ = self._targets(entry, dest)
        if rows < entry.count:
            raise FlashError(f"{self.pack}: layer {layer} decodes into {entry.count} rows, dest has {rows}")
        roles = endor_roles(entry, {c.name: mat for c, (_, _, mat) in zip(entry.components, targets)})
        decode_into(host_bytes(words), offsets[:-1], np.diff(offsets), np.arange(entry.count), roles,
                    str(self.pack / entry.file))
        return time.perf_counter() - t0

    def plan(self, layer, ids) -> ReadPlan:
        """The reads that bring bundles `ids` of `layer` in: sorted, aligned for direct I/O and
        merged by the cost model (io.planner). Pass it, or pieces of it (ReadPlan.take), to
        `read` / `read_many` in place of the ids, so a caller that splits its reads by their
        plan does not have them planned twice; rows `slots` then follow the plan's (sorted) ids."""
        entry = self.entry(layer)
        f = self._file(layer, entry)
        align = self.alignment if f.direct else 1
        cost = self.cost if self.merge_reads else None
        if entry.encoding != "endor":
            *arrays, member_read = plan_strided(ids, entry.count, entry.offset, entry.stride, align=align,
                                                cost=cost, max_read=self.max_read, path=f.path)
            return ReadPlan(layer, *arrays, align, member_read)
        ids, index = sort_bundle_ids(ids, entry.count, f.path)
        if f.index is None:
            with f.lock:
                if f.index is None:
                    f.index = read_bundle_index(f.path, entry)
        starts = f.index[ids]
        lengths = f.index[ids + 1] - starts
        r0, r1, first = plan_read_arrays(starts, lengths, align=align, cost=cost, max_read=self.max_read)
        return ReadPlan(layer, ids, index, starts, lengths, r0, r1, first, align)

    def _prepare(self, layer, ids, dest, slots):
        entry = self.entry(layer)
        f = self._file(layer, entry)
        if isinstance(ids, ReadPlan):
            plan = ids
            if plan.layer != layer or plan.align != (self.alignment if f.direct else 1):
                raise FlashError(f"{f.path}: a read plan of layer {plan.layer} "
                                 f"(alignment {plan.align}) given to a read of layer {layer}")
        else:
            plan = self.plan(layer, ids)
        slots = np.arange(len(plan)) if slots is None else np.asarray(slots, np.int64).reshape(-1)
        if len(slots) != len(plan):
            raise FlashError(f"{f.path}: {len(plan)} bundle ids but {len(slots)} slots")
        if plan is not ids:
            slots = slots[plan.index]  # rows follow the sorted ids
        targets, rows, raw = self._targets(entry, dest)
        if len(slots) and (slots.min() < 0 or slots.max() >= rows):
            raise FlashError(f"{f.path}: slot out of range 0..{rows - 1}")
        self._load_crcs(f, entry)
        ids, r0, r1, first = plan.ids, plan.r0, plan.r1, plan.first
        member_read = plan.member_read if plan.member_read is not None else member_reads(first, len(ids))
        if entry.encoding == "endor":
            if not isinstance(dest, dict):
                raise FlashError(f"{f.path}: ENDOR bundles decode into component arrays (use FlashLoader.alloc)")
            roles = endor_roles(entry, {c.name: mat for c, (_, _, mat) in zip(entry.components, targets)})
            return _Job(f, entry, targets, False, ids, slots, plan.starts, 0, False, [], 0, r0, r1,
                        first, member_read, lengths=plan.lengths, roles=roles)
        stride = entry.stride
        pieces, tight, zero_copy = self._layout(entry, f, targets)
        if zero_copy and stage_saves_time(self.cost, r1 - r0, _segments_per_read(targets, slots, first)):
            zero_copy = False  # one contiguous landing + a copy beats many small segments here
        return _Job(f, entry, targets, raw, ids, slots, plan.starts, stride, zero_copy, pieces, tight,
                    r0, r1, first, member_read)

    def _layout(self, entry, f, targets):
        """(pieces [(offset, length)] of the components in a bundle, tight: their bytes when packed
        back to back else 0, whether reads can land straight in `targets`' rows): constants of a
        layer and destination, kept with the cached targets (_targets) instead of redone per call."""
        key = (entry.file, id(targets))
        hit = self._layout_cache.get(key)
        if hit is not None and hit[0] is targets:
            return hit[1]
        pieces = [(c.offset, c.length) for c in entry.components]
        used = sum(n for _, n in pieces)
        tight = used if all(o == sum(n for _, n in pieces[:i]) for i, (o, _) in enumerate(pieces)) else 0
        align = self.alignment if f.direct and sys.platform != "darwin" else 1
        aligned = entry.stride % align == 0 and all(
            off % align == 0 and n % align == 0 and address(mat) % align == 0
            for off, n, mat in targets)
        if len(self._layout_cache) >= 1024:
            self._layout_cache.pop(next(iter(self._layout_cache)))
        self._layout_cache[key] = (targets, (pieces, tight, aligned))  # holds targets: ids stay unique
        return pieces, tight, aligned

    def _targets(self, entry, dest):
        """([(offset in bundle, length, uint8 matrix [rows, length])], rows, is raw).

        Cached per destination: a runtime reads into the same cache arrays every token."""
        return _per_dest(self._target_cache, entry.file, dest, lambda: self._make_targets(entry, dest))

    def _make_targets(self, entry, dest):
        if isinstance(dest, dict):
            out = []
            for c in entry.components:
                arr = dest.get(c.name)
                if arr is None or tuple(arr.shape[1:]) != tuple(c.shape) \
                        or arr.dtype != mx_dtype(c.dtype):
                    raise FlashError(f"destination {c['name']!r}: want [n, {c['shape']}] "
                                     f"{c['dtype']} (use FlashLoader.alloc)")
                out.append((c.offset, c.length, host_bytes(arr).reshape(arr.shape[0], -1)))
            return out, out[0][2].shape[0], False
        if dest.dtype != mx.uint8 or dest.ndim != 2 or dest.shape[1] != entry.stride:
            raise FlashError(f"raw destination must be uint8 [n, {entry['stride']}] "
                             f"(use FlashLoader.alloc_raw)")
        raw = host_bytes(dest).reshape(dest.shape[0], -1)
        return [(0, entry.stride, raw)], raw.shape[0], True

    def _read_into(self, f, buffers, offset, n):
        """One preadv; anything unusual (short read, EINTR, error) goes to the careful path."""
        if len(buffers) <= IOV_MAX:
            try:
                if self.files.preadv(f.fd, buffers, offset) == n:
                    return
            except OSError:
                pass
        read_full(self.files, f.fd, buffers, offset, f.path, f.buffered_fd)

    def _member_iovecs(self, job, r0, r1, members):
        """iovecs landing a read straight in the destination rows (gaps go to scratch)."""
        scratch, iov, pos = self._scratch(), [], r0
        for m in members:
            s, slot = int(job.starts[m]), int(job.slots[m])
            for off, n, mat in job.targets:
                if s + off > pos:
                    self._gap(iov, scratch, s + off - pos)
                iov.append(memoryview(mat[slot, :n]))
                pos = s + off + n
        if r1 > pos:
            self._gap(iov, scratch, r1 - pos)
        return iov

    @staticmethod
    def _gap(iov, scratch, n):
        while n:
            k = min(n, len(scratch))
            iov.append(scratch[:k])
            n -= k

    def _scatter(self, job, flat, members=None, checked=False):
        """Copy bundles `members` (indices into job.ids; default all) of a request from the staging
        buffer to their rows, checking crc32 first unless `checked` (ENDOR layers: decode them
        into their rows)."""
        if job.lengths is not None:
            return self._decode(job, flat, members)
        if members is None:  # every bundle: the job's own arrays
            members, offs, slots = np.arange(len(job.ids)), _staged_offsets(job), job.slots
        else:
            members = np.asarray(members, np.int64)
            reads = job.member_read[members]
            offs, slots = job.pos[reads] + job.starts[members] - job.r0[reads], job.slots[members]
        if self.verify and not checked:
            self._check(job, flat, offs, members)
        stride = job.stride
        if copy_rows_kernel is None:  # numpy: runs of bundles one stride apart in staging going
            # to consecutive rows (chunks, experts) are one strided copy per run and component
            bounds = np.flatnonzero((np.diff(offs) != stride) | (np.diff(slots) != 1)) + 1
            if len(bounds) < len(offs) // 4:  # runs of 4+ bundles
                starts, ends = [0, *bounds.tolist()], [*bounds.tolist(), len(offs)]
                for off, n, mat in job.targets:
                    for a, b, o, s in zip(starts, ends, offs[starts].tolist(), slots[starts].tolist()):
                        mat[s: s + b - a] = np.ndarray((b - a, n), np.uint8, flat, o + off, (stride, 1))
                return
        for off, n, mat in job.targets:  # one kernel call per component array (GIL released)
            copy_rows(flat, offs + off, n, mat, slots)

    def _decode(self, job, flat, members=None):
        """Check (crc32) and decode bundles `members` (indices into job.ids; default all) of an
        ENDOR request from staging into their rows: one kernel pass, GIL released."""
        from ..pack.bitmap import decode_into

        t0 = time.perf_counter()
        m = slice(None) if members is None else members
        reads = job.member_read[m]
        offs = job.pos[reads] + job.starts[m] - job.r0[reads]
        try:
            decode_into(flat, offs, job.lengths[m], job.slots[m], job.roles, str(job.f.path),
                        ids=job.ids[m], offsets=job.starts[m],
                        crcs=job.f.crc[job.ids[m]] if self.verify else None)
        finally:
            with self._lock:  # finishing threads decode batches of one request at once
                job.decode_s += time.perf_counter() - t0

    def _check(self, job, flat, offs, members):
        """crc32 of staged bundles `members` (indices into job.ids; bundle members[i] at
        flat[offs[i]:]) against the file's table: bundles whose components are packed back to back
        in one kernel pass (GIL released); bundles with padding between components one
        crc32_ranges call per component (the crcs chain through them), or one by one without the
        kernels."""
        ids, want, tight = job.ids[members], job.f.crc[job.ids[members]], job.tight
        if tight:
            check_crc32s(flat, offs, np.full(len(offs), tight), want, str(job.f.path),
                         offsets=job.starts[members], ids=ids)
            return
        if crc32_ranges is not None:
            starts, crcs = np.asarray(offs, np.int64), np.zeros(len(offs), np.uint32)
            for off, n in job.pieces:
                crc32_ranges(flat, starts + off, n, crcs)
            bad = np.flatnonzero(crcs != want)
        else:
            bad = [i for i, o in enumerate(offs.tolist()) if bundle_crc32(flat[o:], job.pieces, crc32) != want[i]]
        if len(bad):
            raise _checksum_mismatch(job, int(members[bad[0]]))

    def _check_rows(self, job, members):
        """crc32 of bundles that were read straight into their destination rows: with the kernels,
        one crc32_ranges call per component array over all `members`, else a call per row."""
        members = np.asarray(members, np.int64)
        if crc32_ranges is not None and not job.raw and len(members):
            crcs, slots = np.zeros(len(members), np.uint32), job.slots[members]
            for _, n, mat in job.targets:  # component order: each bundle's crc32 chains through them
                crc32_ranges(mat.reshape(-1), slots * mat.shape[1], n, crcs)
            _check_crcs(job, members, crcs)
            return
        for m in members.tolist():
            slot, crc = int(job.slots[m]), 0
            if job.raw:
                crc = bundle_crc32(job.targets[0][2][slot], job.pieces, crc32)
            else:
                for off, n, mat in job.targets:
                    crc = crc32(mat[slot, :n], crc)
            if crc != job.f.crc[job.ids[m]]:
                raise _checksum_mismatch(job, m)

    def _staging(self, n) -> memoryview:
        """The calling thread's page-aligned staging buffer (kept and grown: size = its largest
        read_many's bytes), so direct reads need no per-call allocation or page faults. The thread
        whose staging the decode primitives share (decode_reads) first waits for MLX's pending
        work: none of their reads may still be landing in it."""
        if self._stream_reads is not None and self._stream_reads[2] == threading.get_ident():
            mx.synchronize()
        buf = getattr(self._local, "staging", None)
        if buf is None or len(buf) < n:
            buf = self._local.staging = aligned_buffer(n)
        return buf

    def _scratch(self, n=0) -> memoryview:
        """This thread's page-aligned buffer for bytes a read must cover but nobody wants (at
        least `n` bytes; grown by replacing it, so holders of the old one keep it valid)."""
        buf = getattr(self._local, "scratch", None)
        if buf is None or len(buf) < n:
            buf = self._local.scratch = aligned_buffer(max(n, self.max_read + 2 * self.alignment))
        return buf

    def _file(self, layer, entry) -> _Open:
        f = self._open_files.get(layer)
        if f is not None:
            return f
        with self._lock:
            if layer not in self._open_files:
                path = self.pack / entry.file
                try:
                    size = path.stat().st_size
                    fd, direct = self.files.open(path, self.direct)
                except OSError as e:
                    raise FlashError(f"{path}: cannot open bundle file ({e.strerror or e})") from None
                f = _Open(path, fd, direct)
                if size < entry.file_length:
                    self.files.close(fd)
                    raise FlashError(f"{path}: truncated ({size} bytes, manifest says "
                                     f"{entry['file_length']})")
                if direct:
                    f.buffered_fd, _ = self.files.open(path, False)
                self._open_files[layer] = f
            return self._open_files[layer]

    def close(self):
        """Stop the reader threads, release the AIO contexts and close the pack's files (the
        model that owns this loader calls it when it is garbage-collected). Idempotent."""
        for _ in self._workers:
            self._tasks.put(None)
        for w in self._workers:
            if w is not threading.current_thread():  # a finalizer may run on a reader thread
                w.join()
        self._workers = []
        if self._finish_pool is not None:
            self._finish_pool.shutdown()
            self._finish_pool = None
        for ctx in self._aio_contexts:
            ctx.close()
        self._aio_contexts = []
        self._stream_reads = self._ahead_reads = None
        self._target_cache.clear()
        self._at_once_cache.clear()
        self._layout_cache.clear()
        for f in self._open_files.values():
            self.files.close(f.fd)
            if f.buffered_fd is not None:
                self.files.close(f.buffered_fd)
        self._open_files.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
