"""FlashLoader: read neuron / expert bundles of a pack straight into preallocated MLX arrays."""

import os
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..errors import FlashError
from ..pack.layout import layer_bundles, mx_dtype, read_manifest
from ..pack.reader import read_checksum_table
from .files import IOV_MAX, FileLayer, address, aligned_buffer, read_full
from .planner import DEFAULT_MAX_READ, ReadCost, calibrate, flash_home, load_cost, plan_reads


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
    direct: bool = False
    read_sizes: dict = field(default_factory=dict)  # bytes per read -> number of reads

    def add(self, other: "ReadStats"):
        for k in ("bundles", "reads", "bytes_useful", "bytes_read", "zero_copy_reads",
                  "bounced_reads", "seconds"):
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


@dataclass
class _Open:
    path: Path
    fd: int
    direct: bool
    buffered_fd: int | None = None
    crc: np.ndarray | None = None
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
    zero_copy: bool  # every iovec meets the direct-I/O alignment: read straight into dest
    pieces: list  # [(offset, length)] of the components inside a bundle
    tight: int  # bytes covered by the components when they are packed without padding, else 0
    r0: np.ndarray | None = None  # file offset of each planned read
    pos: np.ndarray | None = None  # staging position of each planned read
    member_read: np.ndarray | None = None  # planned read holding each bundle


class FlashLoader:
    """Reads bundles of one pack. Thread-safe for reads into disjoint destination rows.

    threads: parallel reads in flight (default 32, as in the paper).
    direct: bypass the page cache (O_DIRECT / F_NOCACHE; posix_fadvise fallback).
    verify: check each bundle's crc32 after reading it (costs ~1 CPU-second per 1.5 GB).
    plan: merge neighbouring bundles into larger reads using `cost` (a ReadCost); cost=None
      loads the machine profile, calibrating once (a few seconds) if there is none.
    files: the FileLayer (inject faults in tests).
    """

    def __init__(self, pack_dir, *, threads=32, direct=True, verify=True, plan=True,
                 cost: ReadCost | None = None, max_read=DEFAULT_MAX_READ,
                 files: FileLayer | None = None):
        self.pack = Path(pack_dir)
        self.manifest = read_manifest(self.pack)
        self.bundles = layer_bundles(self.manifest)
        self.alignment = self.manifest["alignment"]
        self.threads, self.direct, self.verify, self.plan = threads, direct, verify, plan
        self.max_read = max_read
        self.files = files or FileLayer()
        self._open_files: dict[int, _Open] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="flash-read")
        if plan and cost is None and self.bundles:
            first = self.pack / next(iter(self.bundles.values()))["file"]
            scratch = first.parent if os.access(first.parent, os.W_OK) else flash_home()
            cost = load_cost(first, threads) or calibrate(scratch, threads=threads, key_path=first)
        self.cost = cost

    # -- layout -------------------------------------------------------------------------------
    def entry(self, layer) -> dict:
        try:
            return self.bundles[layer]
        except KeyError:
            raise FlashError(f"{self.pack}: no bundle file for layer {layer}") from None

    def alloc(self, layer, n) -> dict:
        """{component name: zeroed mx.array [n, *component shape]} to read `n` bundles into."""
        return {c["name"]: self._aligned_zeros((n, *c["shape"]), mx_dtype(c["dtype"]))
                for c in self.entry(layer)["components"]}

    def alloc_raw(self, layer, n) -> mx.array:
        """A uint8 mx.array [n, stride] of whole bundles."""
        return self._aligned_zeros((n, self.entry(layer)["stride"]), mx.uint8)

    def _aligned_zeros(self, shape, dtype) -> mx.array:
        """Zeroed, evaluated MLX array whose memory starts on an `alignment` boundary (a view
        into a slightly larger buffer), so direct reads can land in it when row sizes allow."""
        nbytes = int(np.prod(shape)) * dtype.size
        base = mx.zeros((nbytes + self.alignment,), dtype=mx.uint8)
        mx.eval(base)
        skip = -address(host_bytes(base)) % self.alignment
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

    def read_many(self, requests) -> ReadStats:
        """Several `read`s, [(layer, ids, dest, slots or None)], issued together on the pool.

        Workers only do I/O (into the destination rows, or into this thread's staging buffer at
        precomputed positions); the calling thread then checks and scatters each request with a
        handful of vectorised numpy copies, so per-read Python work stays a few microseconds.
        """
        t0 = time.perf_counter()
        stats = ReadStats()
        jobs, items, pos = [], [], 0
        for layer, ids, dest, slots in requests:
            job, plan = self._prepare(layer, ids, dest, slots)
            jobs.append(job)
            stats.direct = job.f.direct
            stats.bundles += len(job.ids)
            stats.bytes_useful += len(job.ids) * sum(n for _, n in job.pieces)
            job.r0 = np.array([r[0] for r in plan], np.int64)
            sizes = np.array([r[1] - r[0] for r in plan], np.int64)
            job.member_read = np.repeat(np.arange(len(plan)), [len(r[2]) for r in plan])
            if job.zero_copy:
                for r0, r1, members in plan:
                    items.append((job.f, r0, r1 - r0, self._member_iovecs(job, r0, r1, members)))
            else:
                job.pos = pos + np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
                items.extend(zip([job.f] * len(plan), job.r0.tolist(), sizes.tolist(),
                                 job.pos.tolist()))
                pos += int(sizes.sum())
            stats.reads += len(plan)
            stats.bytes_read += int(sizes.sum())
            for n in sizes.tolist():
                stats.read_sizes[n] = stats.read_sizes.get(n, 0) + 1
            stats.zero_copy_reads += len(plan) if job.zero_copy else 0
            stats.bounced_reads += 0 if job.zero_copy else len(plan)
        staging = self._staging(pos) if pos else None
        groups = [items[i::self.threads] for i in range(min(self.threads, len(items)))]
        futures = [self._pool.submit(self._io, staging, g) for g in groups]
        error = None
        for fut in futures:  # wait for all: no worker may still write after we return
            try:
                fut.result()
            except FlashError as e:
                error = error or e
        if error:
            raise error
        flat = np.frombuffer(staging, np.uint8) if staging is not None else None
        for job in jobs:
            if job.zero_copy:
                if self.verify:
                    self._check_rows(job, range(len(job.ids)))
            else:
                self._scatter(job, flat)
        stats.seconds = time.perf_counter() - t0
        return stats

    def _io(self, staging, items):
        """A worker: each item is (file, offset, bytes, staging position or iovec list)."""
        files, read_into = self.files, self._read_into
        for f, r0, n, dst in items:
            read_into(f, [staging[dst: dst + n]] if dst.__class__ is int else dst, r0, n)
            if not f.direct:
                files.drop_cache(f.fd, r0, n)

    def _prepare(self, layer, ids, dest, slots):
        entry = self.entry(layer)
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        slots = np.arange(len(ids)) if slots is None else np.asarray(slots, np.int64).reshape(-1)
        f = self._file(layer, entry)
        if len(slots) != len(ids):
            raise FlashError(f"{f.path}: {len(ids)} bundle ids but {len(slots)} slots")
        if len(ids) and (ids.min() < 0 or ids.max() >= entry["count"]):
            raise FlashError(f"{f.path}: bundle id out of range 0..{entry['count'] - 1}")
        if len(set(ids.tolist())) != len(ids):
            raise FlashError(f"{f.path}: duplicate bundle ids in one read")
        targets, rows, raw = self._targets(entry, dest)
        if len(slots) and (slots.min() < 0 or slots.max() >= rows):
            raise FlashError(f"{f.path}: slot out of range 0..{rows - 1}")
        if self.verify and f.crc is None:
            with f.lock:
                if f.crc is None:
                    f.crc = read_checksum_table(f.path, entry)
        order = np.argsort(ids, kind="stable")
        ids, slots = ids[order], slots[order]
        stride = entry["stride"]
        starts = entry["offset"] + ids * stride
        plan = plan_reads(starts.tolist(), stride, align=self.alignment if f.direct else 1,
                          cost=self.cost if self.plan else None, max_read=self.max_read)
        pieces = [(c["offset"], c["length"]) for c in entry["components"]]
        used = sum(n for _, n in pieces)
        tight = used if all(o == sum(n for _, n in pieces[:i]) for i, (o, _) in enumerate(pieces)) else 0
        align = self.alignment if f.direct and sys.platform != "darwin" else 1
        zero_copy = stride % align == 0 and all(
            off % align == 0 and n % align == 0 and address(mat) % align == 0
            for off, n, mat in targets)
        job = _Job(f, entry, targets, raw, ids, slots, starts, stride, zero_copy, pieces, tight)
        return job, plan

    def _targets(self, entry, dest):
        """([(offset in bundle, length, uint8 matrix [rows, length])], rows, is raw)."""
        if isinstance(dest, dict):
            out = []
            for c in entry["components"]:
                arr = dest.get(c["name"])
                if arr is None or tuple(arr.shape[1:]) != tuple(c["shape"]) \
                        or arr.dtype != mx_dtype(c["dtype"]):
                    raise FlashError(f"destination {c['name']!r}: want [n, {c['shape']}] "
                                     f"{c['dtype']} (use FlashLoader.alloc)")
                out.append((c["offset"], c["length"], host_bytes(arr).reshape(arr.shape[0], -1)))
            return out, out[0][2].shape[0], False
        if dest.dtype != mx.uint8 or dest.ndim != 2 or dest.shape[1] != entry["stride"]:
            raise FlashError(f"raw destination must be uint8 [n, {entry['stride']}] "
                             f"(use FlashLoader.alloc_raw)")
        raw = host_bytes(dest).reshape(dest.shape[0], -1)
        return [(0, entry["stride"], raw)], raw.shape[0], True

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

    def _scatter(self, job, flat):
        """Copy a request's bundles from the staging buffer to their rows, checking crc32 first."""
        offs = job.pos[job.member_read] + job.starts - job.r0[job.member_read]
        rows = np.lib.stride_tricks.sliding_window_view(flat, job.stride)[offs]
        if self.verify:
            self._check(job, rows)
        for off, n, mat in job.targets:
            mat[job.slots] = rows[:, off: off + n]

    def _check(self, job, rows):
        crc_table, crc32, tight = job.f.crc, zlib.crc32, job.tight
        for i in range(len(rows)):
            if tight:
                crc = crc32(rows[i, :tight])
            else:
                crc = 0
                for off, n in job.pieces:
                    crc = crc32(rows[i, off: off + n], crc)
            if crc != crc_table[job.ids[i]]:
                raise FlashError(f"{job.f.path}: checksum mismatch in bundle {job.ids[i]} "
                                 f"(offset {int(job.starts[i])})")

    def _check_rows(self, job, members):
        """crc32 of bundles that were read straight into their destination rows."""
        for m in members:
            slot, crc = int(job.slots[m]), 0
            if job.raw:
                row = job.targets[0][2][slot]
                for off, n in job.pieces:
                    crc = zlib.crc32(row[off: off + n], crc)
            else:
                for off, n, mat in job.targets:
                    crc = zlib.crc32(mat[slot, :n], crc)
            if crc != job.f.crc[job.ids[m]]:
                raise FlashError(f"{job.f.path}: checksum mismatch in bundle {job.ids[m]} "
                                 f"(offset {int(job.starts[m])})")

    def _staging(self, n) -> memoryview:
        """The calling thread's page-aligned staging buffer (kept and grown: size = its largest
        read_many's bytes), so direct reads need no per-call allocation or page faults."""
        buf = getattr(self._local, "staging", None)
        if buf is None or len(buf) < n:
            buf = self._local.staging = aligned_buffer(n)
        return buf

    def _scratch(self) -> memoryview:
        buf = getattr(self._local, "scratch", None)
        if buf is None:
            buf = self._local.scratch = aligned_buffer(self.max_read + 2 * self.alignment)
        return buf

    def _file(self, layer, entry) -> _Open:
        f = self._open_files.get(layer)
        if f is not None:
            return f
        with self._lock:
            if layer not in self._open_files:
                path = self.pack / entry["file"]
                try:
                    size = path.stat().st_size
                    fd, direct = self.files.open(path, self.direct)
                except OSError as e:
                    raise FlashError(f"{path}: cannot open bundle file ({e.strerror or e})") from None
                f = _Open(path, fd, direct)
                if size < entry["file_length"]:
                    self.files.close(fd)
                    raise FlashError(f"{path}: truncated ({size} bytes, manifest says "
                                     f"{entry['file_length']})")
                if direct:
                    f.buffered_fd, _ = self.files.open(path, False)
                self._open_files[layer] = f
            return self._open_files[layer]

    def close(self):
        self._pool.shutdown(wait=True)
        for f in self._open_files.values():
            self.files.close(f.fd)
            if f.buffered_fd is not None:
                self.files.close(f.buffered_fd)
        self._open_files.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
