"""FlashLoader: read neuron / expert bundles of a pack straight into preallocated MLX arrays."""

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..errors import FlashError
from ..pack.layout import layer_bundles, mx_dtype, read_manifest
from ..pack.reader import read_checksum_table
from .files import FileLayer, address, aligned_buffer, read_full
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
        out = {c["name"]: mx.zeros((n, *c["shape"]), dtype=mx_dtype(c["dtype"]))
               for c in self.entry(layer)["components"]}
        mx.eval(out)
        return out

    def alloc_raw(self, layer, n) -> mx.array:
        """A uint8 mx.array [n, stride] of whole bundles whose memory starts page-aligned."""
        stride = self.entry(layer)["stride"]
        base = mx.zeros((n * stride + self.alignment,), dtype=mx.uint8)
        mx.eval(base)
        skip = -address(host_bytes(base)) % self.alignment
        raw = base[skip: skip + n * stride].reshape(n, stride)
        mx.eval(raw)
        return raw

    # -- reading ------------------------------------------------------------------------------
    def read(self, layer, ids, dest, slots=None) -> ReadStats:
        """Read bundles `ids` of `layer` into rows `slots` (default 0..len-1) of `dest`.

        dest: the dict from `alloc` (components scattered into separate arrays) or the uint8
        array from `alloc_raw` (whole bundles). On FlashError the destination rows are undefined.
        """
        return self.read_many([(layer, ids, dest, slots)])

    def read_many(self, requests) -> ReadStats:
        """Several `read`s, [(layer, ids, dest, slots or None)], issued together on the pool."""
        t0 = time.perf_counter()
        work, stats = [], ReadStats()
        for layer, ids, dest, slots in requests:
            job, plan = self._prepare(layer, ids, dest, slots)
            work.extend((job, r) for r in plan)
            stats.direct = job[0].direct
            stats.bundles += len(job[4])
            stats.bytes_useful += len(job[4]) * sum(c["length"] for c in job[1]["components"])
        groups = [work[i::self.threads] for i in range(min(self.threads, len(work)))]
        futures = [self._pool.submit(self._read_group, g) for g in groups]
        error = None
        for fut in futures:  # wait for all: no worker may still write after we return
            try:
                stats.add(fut.result())
            except FlashError as e:
                error = error or e
        if error:
            raise error
        stats.seconds = time.perf_counter() - t0
        return stats

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
        return (f, entry, targets, raw, ids, slots, starts), plan

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

    def _read_group(self, group) -> ReadStats:
        stats = ReadStats()
        for job, (r0, r1, members) in group:
            f, entry, targets, raw, ids, slots, starts = job
            stride = entry["stride"]
            iov = self._zero_copy_iovecs(f, targets, r0, r1, members, starts, slots, stride)
            if iov is not None:
                read_full(self.files, f.fd, iov, r0, f.path, f.buffered_fd)
                stats.zero_copy_reads += 1
            else:
                buf = self._bounce(r1 - r0)
                read_full(self.files, f.fd, [buf[: r1 - r0]], r0, f.path, f.buffered_fd)
                for m in members:
                    base = int(starts[m]) - r0
                    for off, n, mat in targets:
                        o = base + off
                        mat[slots[m], :n] = np.frombuffer(buf, np.uint8, n, o)
                stats.bounced_reads += 1
            if not f.direct:
                self.files.drop_cache(f.fd, r0, r1 - r0)
            if self.verify:
                self._check(f, entry, targets, raw, members, ids, slots, starts)
            stats.reads += 1
            stats.bytes_read += r1 - r0
            stats.read_sizes[r1 - r0] = stats.read_sizes.get(r1 - r0, 0) + 1
        return stats

    def _zero_copy_iovecs(self, f, targets, r0, r1, members, starts, slots, stride):
        """iovecs that land the read straight in the destination rows, or None if not allowed."""
        align = self.alignment if f.direct else 1
        scratch = self._scratch()
        iov, pos = [], r0
        pieces = []
        for m in members:
            s = int(starts[m])
            if s < pos:
                return None
            for off, n, mat in targets:
                pieces.append((s + off, n, mat, int(slots[m])))
        for start, n, mat, slot in pieces:
            if start < pos:
                return None
            if start > pos:
                if not self._gap(iov, scratch, start - pos, align):
                    return None
            row = memoryview(mat[slot, :n])
            if align > 1 and (n % align or address(mat[slot]) % align):
                return None
            iov.append(row)
            pos = start + n
        if r1 > pos and not self._gap(iov, scratch, r1 - pos, align):
            return None
        return iov

    @staticmethod
    def _gap(iov, scratch, n, align):
        if n % align:
            return False
        while n:
            k = min(n, len(scratch))
            iov.append(scratch[:k])
            n -= k
        return True

    def _check(self, f, entry, targets, raw, members, ids, slots, starts):
        import zlib
        for m in members:
            crc = 0
            for off, n, mat in targets:
                row = mat[slots[m]]
                if raw:  # whole bundle: the checksum covers components, not padding
                    for c in entry["components"]:
                        crc = zlib.crc32(row[c["offset"]: c["offset"] + c["length"]], crc)
                else:
                    crc = zlib.crc32(row[:n], crc)
            if crc != f.crc[ids[m]]:
                raise FlashError(f"{f.path}: checksum mismatch in bundle {ids[m]} "
                                 f"(offset {int(starts[m])})")

    def _bounce(self, n) -> memoryview:
        buf = getattr(self._local, "bounce", None)
        if buf is None or len(buf) < n:
            buf = self._local.bounce = aligned_buffer(max(n, self.max_read + 2 * self.alignment))
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
