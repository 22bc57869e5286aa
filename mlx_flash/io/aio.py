"""Linux native AIO (io_submit / io_getevents via libc's syscall) for O_DIRECT reads.

One thread keeps `depth` reads in flight with no Python work per read: the iocbs are a numpy
structured array filled in one vectorised step and completions come back as a numpy array. This
is what lets a Python loader keep up with fio on small random reads, where a pool of Python
threads spends more time passing the GIL around than the device spends reading.
Reads are plain (IOCB_CMD_PREAD into one buffer) or vectored (IOCB_CMD_PREADV: one read whose
iovecs land each piece of a block in its own destination row, zero copy).
Only used on Linux, for files opened with O_DIRECT (native AIO on buffered files is synchronous).
"""

import ctypes
import ctypes.util
import errno
import importlib
import os
import platform
import sys
from dataclasses import dataclass

import numpy as np

from ..errors import FlashError

_SYSCALLS = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)}  # setup, destroy, getevents, submit
IOCB = np.dtype([("data", "<u8"), ("key", "<u4"), ("rw_flags", "<u4"), ("opcode", "<u2"),
                 ("reqprio", "<i2"), ("fildes", "<u4"), ("buf", "<u8"), ("nbytes", "<u8"),
                 ("offset", "<i8"), ("reserved2", "<u8"), ("flags", "<u4"), ("resfd", "<u4")])
IOVEC = np.dtype([("base", "<u8"), ("len", "<u8")])
PREAD, PREADV = 0, 7  # IOCB_CMD_PREAD, IOCB_CMD_PREADV
EVENT = np.dtype([("data", "<u8"), ("obj", "<u8"), ("res", "<i8"), ("res2", "<i8")])
assert IOCB.itemsize == 64 and EVENT.itemsize == 32 and IOVEC.itemsize == 16


# Off by default: idle, a 2 ms spin left flash's wall time per token where it was (bench host,
# 4 alternated rounds: median 54.4 ms spinning vs 53.5 blocking) and cost ~14 ms of main-thread CPU
# per token, which slowed the evaluations beside it (docs/benchmarks.md, "Idle re-measurements
# (2026-11-26, 17:51-18:11 UTC, at f226da7 and 50d52fc)").
DEFAULT_SPIN_US = 0


def spin_ns() -> int:
    """read_all's spin before each blocking wait (ns): MLX_FLASH_AIO_SPIN_US microseconds
    (default DEFAULT_SPIN_US, 0: block at once). A decode call's reads take 0.1-2 ms; a sleep's
    wake-up costs tens of microseconds on an idle VM and up to a scheduler time slice (~20 ms
    measured) on a busy core, where the spin's CPU comes out of the process's share instead."""
    value = os.environ.get("MLX_FLASH_AIO_SPIN_US", str(DEFAULT_SPIN_US))
    try:
        us = float(value)
    except ValueError:
        us = -1.0
    if not us >= 0:
        raise FlashError(f"MLX_FLASH_AIO_SPIN_US={value!r}: expected microseconds >= 0")
    return int(us * 1000)

_libc = None


def _read_loop_kernel():
    """The kernels' aio_read (kernels/aio_read.h: submit and reap every read in one C++ loop, GIL
    released), or None when the extension is missing, older, or not built for Linux."""
    try:
        return importlib.import_module("mlx_flash._ext").aio_read  # by name: the compiled module is optional
    except (ImportError, AttributeError):
        return None


read_loop_kernel = _read_loop_kernel()
# the kernels' aio_read_staged (a small staged call: reads, crc32 checks and copy out in one call)
read_staged_kernel = getattr(importlib.import_module("mlx_flash._ext"), "aio_read_staged", None) \
    if read_loop_kernel is not None else None
# the kernels' aio_read_ids (a decode call from bundle ids to rows: plan, reads, checks, copy out)
read_ids_kernel = getattr(importlib.import_module("mlx_flash._ext"), "aio_read_ids", None) \
    if read_loop_kernel is not None else None


def available() -> bool:
    return sys.platform.startswith("linux") and platform.machine() in _SYSCALLS


def _syscall():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        _libc.syscall.restype = ctypes.c_long
    return _libc.syscall


def _iocbs(first: int, fds, offsets, sizes, addresses, vectored) -> np.ndarray:
    """IOCB array of reads numbered first, first + 1, ... (AioContext.read's arguments)."""
    iocbs = np.zeros(len(sizes), IOCB)
    iocbs["data"] = first + np.arange(len(sizes))
    iocbs["fildes"] = fds
    iocbs["buf"] = addresses
    iocbs["nbytes"] = sizes
    iocbs["offset"] = offsets
    if vectored is not None:
        iocbs["opcode"] = np.where(vectored, PREADV, PREAD)
    return iocbs


@dataclass
class Pending:
    """Reads of one submission: iocb arrays (alive until submitted: io_submit copies them), the
    address of each read's iocb, each read's result (bytes read, -errno; -ECANCELED until it
    completes) and how many were submitted (in turn) and completed (in any order) so far."""
    iocbs: list
    ptrs: np.ndarray
    res: np.ndarray
    submitted: int = 0
    completed: int = 0

    def extend(self, more: "Pending") -> None:
        """Append a later batch's reads (numbered on from these)."""
        self.iocbs += more.iocbs
        self.ptrs = np.concatenate([self.ptrs, more.ptrs])
        self.res = np.concatenate([self.res, more.res])


class AioContext:
    """An io_setup context with room for `depth` reads in flight. Close it when done."""

    def __init__(self, depth: int):
        self.spin_ns = spin_ns()  # read_all's spin before each blocking wait (0: block at once)
        self.depth = depth
        self._nr = _SYSCALLS[platform.machine()]
        self._ctx = ctypes.c_ulong(0)
        if _syscall()(ctypes.c_long(self._nr[0]), ctypes.c_long(depth), ctypes.byref(self._ctx)) < 0:
            raise OSError(ctypes.get_errno(), "io_setup failed")
        self._events = np.zeros(depth, EVENT)
        self.min_batch = max(1, depth // 8)  # completions to wait for per call: fewer Python round trips
        self.all_submitted = False  # during on_done: nothing is left to submit
        self.waits = np.zeros(2, np.int64)  # read_all's waits so far: (ended spinning, blocked)

    @property
    def handle(self) -> int:
        """The io_setup context's id, for a kernel that submits on it (one thread at a time)."""
        return self._ctx.value

    def read(self, fds, offsets, sizes, addresses, vectored=None, *, on_done=None, more=None,
             min_batch=None) -> np.ndarray:
        """Read sizes[i] bytes at offsets[i] of fds[i] into memory at addresses[i], all arrays.

        vectored: optional bool array; where True, addresses[i] is the address of an IOVEC array
        and sizes[i] its number of entries (the read fills them in order). The caller keeps every
        buffer alive until this returns (iocbs and iovec arrays only until they are submitted:
        io_submit copies them).
        more: optional callable returning the next batch (fds, offsets, sizes, addresses,
        vectored) or None; called whenever everything so far has been submitted, so the caller
        prepares later batches while earlier reads are in flight. Batch reads are numbered on
        from the previous batches' (0, 1, ... over all batches).
        min_batch: completions to wait for per io_getevents when more are in flight (default
        depth // 8: fewer Python round trips for small reads; 1 checks each read as it lands).
        Returns each read's result (bytes read, or -errno); the caller retries anything short.
        on_done(indices, results) is called with each batch of finished reads while others
        are in flight (results: the array returned at the end, filled so far; it grows with
        each batch from `more`, so use the one passed in); self.all_submitted then says whether
        every read has been submitted (work done in on_done no longer delays a submission).
        """
        wait_for = self.min_batch if min_batch is None else max(1, int(min_batch))
        pending = self._pending(fds, offsets, sizes, addresses, vectored)
        try:
            while pending.completed < len(pending.res) or more is not None:
                if pending.submitted == len(pending.res) and more is not None:
                    batch = more()
                    if batch is None:
                        more = None
                    else:
                        pending.extend(self._pending(*batch, first=len(pending.res)))
                    continue
                self._submit_some(pending)
                if pending.submitted == pending.completed or \
                        (pending.submitted == len(pending.res) and more is not None):
                    continue  # (the next batch is prepared while these reads fly)
                idx = self._reap(pending, max(1, min(pending.submitted - pending.completed, wait_for)))
                if idx is not None and on_done is not None and len(idx):
                    self.all_submitted = pending.submitted == len(pending.res)  # (more is None by then)
                    on_done(idx, pending.res)
        except BaseException:
            self._drain(pending)  # the kernel may still write into caller buffers
            raise
        return pending.res

    def read_all(self, fds, offsets, sizes, addresses, vectored=None, landed=None) -> np.ndarray:
        """`read` without callbacks: every read submitted and reaped in one call of the kernels'
        loop (no Python per submission or completion; the GIL is released while reads fly), or
        `read` itself without the kernels. Same arguments and result (bytes read or -errno per read).

        landed (kernels only): (flat uint8, first int64 [reads + 1], starts int64, piece offsets,
        piece lengths, crcs uint32 out): as plain read k lands whole, crcs[b] <- the crc32 of bundle b
        (flat[starts[b]:] over the pieces, chained) for b in first[k]..first[k + 1] - 1, while later
        reads are still in flight; bundles of reads that did not land whole are left as they were.
        Each wait for completions first watches the completion ring for `spin_ns` (self.waits counts
        the waits that ended there and those that then blocked)."""
        if read_loop_kernel is None:
            if landed is not None:
                raise ValueError("read_all: landed crc32s need the kernels' loop")
            return self.read(fds, offsets, sizes, addresses, vectored)
        res = np.empty(len(sizes), np.int64)
        flags = None if vectored is None else np.ascontiguousarray(vectored, np.uint8)
        err = read_loop_kernel(self._ctx.value, np.ascontiguousarray(fds, np.int64),
                               np.ascontiguousarray(offsets, np.int64), np.ascontiguousarray(sizes, np.int64),
                               np.ascontiguousarray(addresses, np.uint64), flags, self.depth, res, landed,
                               self.spin_ns, self.waits)
        if err:
            raise OSError(-err, "io_submit / io_getevents failed")
        return res

    def read_staged(self, fd, r0, r1, pos, first, starts, ids, table, flat, pieces, targets, slots):
        """A small call's reads of plain bundles into staging, checked and copied out in one kernel
        call (GIL released; kernels/aio_read.h, aio_read_staged): read k (r0[k]..r1[k] of fd) lands
        at flat[pos[k]:] and holds bundles first[k]..first[k + 1] - 1 (first: reads + 1 entries;
        file offsets `starts`, ids `ids`); each bundle's crc32 over `pieces` ((offset, length)
        arrays) is compared with table[ids] (table None: no check), then `targets`' components
        [(offset in bundle, bytes, uint8 rows)] are copied to rows `slots`. Returns (reads that did
        not land whole: nothing was compared or copied then, index of the first bundle whose crc32
        differs or -1, each read's result, each bundle's crc32 as it landed)."""
        res, crcs = np.empty(len(r0), np.int64), np.empty(len(starts), np.uint32)
        status, bad = read_staged_kernel(self._ctx.value, fd, r0, r1, pos, first, starts, ids, table, flat,
                                         pieces[0], pieces[1], targets, slots, self.depth, self.spin_ns,
                                         self.waits, res, crcs)
        if status < 0:
            raise OSError(-status, "io_submit / io_getevents failed")
        return status, bad, res, crcs

    def read_ids(self, fd, layout, rule, ids, slots, table, flat, pieces, targets, plan):
        """A decode call from bundle ids to rows in one kernel call (GIL released; kernels/aio_read.h,
        aio_read_ids): bundles `ids` of a plain layer (layout: (count, offset, stride) bytes of
        fd) planned by rule (align, merge, merge gap, max read) into plan (int64 [8, len(ids)],
        plan_strided_reads' rows), staged in flat, checked against table[ids] (None: no check) and
        copied to rows `slots` of `targets` (read_staged's). Returns (reads: < 0 for a bad id,
        staged bytes, fits: False when flat is too small (nothing read then), reads that did not
        land whole (0: done), first bundle whose crc32 differs or -1): the caller redoes a call
        that did not finish through its general path, so no per-read result is kept."""
        res, crcs = np.empty(len(ids), np.int64), np.empty(len(ids), np.uint32)
        reads, staged, fits, status, bad = read_ids_kernel(
            self._ctx.value, fd, *layout, *rule, ids, slots, table, flat, pieces[0], pieces[1], targets,
            self.depth, self.spin_ns, self.waits, plan, res, crcs)
        if status < 0:
            raise OSError(-status, "io_submit / io_getevents failed")
        return reads, staged, fits, status, bad

    def submit(self, fds, offsets, sizes, addresses, vectored=None) -> "Pending":
        """Submit reads (the arguments of `read`) and return without waiting for them: up to
        `depth` go out now, the rest in `wait`. The caller keeps every buffer alive and calls
        `wait` (one pending submission per context at a time) before reusing them."""
        pending = self._pending(fds, offsets, sizes, addresses, vectored)
        try:
            self._submit_some(pending)
        except BaseException:
            self._drain(pending)  # the kernel may still write into caller buffers
            raise
        return pending

    def wait(self, pending: "Pending") -> np.ndarray:
        """Each read's result (bytes read, or -errno) of a `submit`, once all are in: reaps them
        (the GIL released while it waits) and submits what did not fit in flight before."""
        try:
            while pending.completed < len(pending.res):
                self._submit_some(pending)
                if pending.completed < pending.submitted:
                    self._reap(pending, 1)
        except BaseException:
            self._drain(pending)
            raise
        return pending.res

    def _pending(self, fds, offsets, sizes, addresses, vectored, first=0) -> "Pending":
        """The iocbs of reads numbered first, first + 1, ..., none submitted yet."""
        iocbs = _iocbs(first, fds, offsets, sizes, addresses, vectored)
        return Pending([iocbs], iocbs.ctypes.data + 64 * np.arange(len(iocbs), dtype=np.uint64),
                       np.full(len(iocbs), -errno.ECANCELED, np.int64))

    def _submit_some(self, pending: "Pending") -> None:
        """io_submit as many of `pending`'s unsubmitted reads as the context has room for (none
        when it is full: EAGAIN and EINTR are tried again by the caller's loop)."""
        room = min(self.depth - (pending.submitted - pending.completed), len(pending.res) - pending.submitted)
        if room <= 0:
            return
        got = _syscall()(ctypes.c_long(self._nr[3]), ctypes.c_ulong(self._ctx.value), ctypes.c_long(room),
                         ctypes.c_void_p(pending.ptrs.ctypes.data + 8 * pending.submitted))
        if got > 0:
            pending.submitted += got
        elif got < 0 and ctypes.get_errno() not in (errno.EAGAIN, errno.EINTR):
            raise OSError(ctypes.get_errno(), "io_submit failed")

    def _reap(self, pending: "Pending", min_nr: int):
        """Wait (GIL released) for at least min_nr completions and record their results in
        pending.res; returns the indices of the reads that completed, or None when interrupted
        (EINTR: call again)."""
        got = _syscall()(ctypes.c_long(self._nr[2]), ctypes.c_ulong(self._ctx.value), ctypes.c_long(min_nr),
                         ctypes.c_long(self.depth), ctypes.c_void_p(self._events.ctypes.data), None)
        if got < 0:
            if ctypes.get_errno() == errno.EINTR:
                return None
            raise OSError(ctypes.get_errno(), "io_getevents failed")
        idx = self._events["data"][:got].astype(np.int64)
        pending.res[idx] = self._events["res"][:got]
        pending.completed += got
        return idx

    def _drain(self, pending: "Pending") -> None:
        """Reap every submitted read of `pending` (after an error: no read may still land in a
        caller's buffer once it is given back)."""
        while pending.completed < pending.submitted:
            self._reap(pending, pending.submitted - pending.completed)

    def close(self):
        if self._ctx.value:
            _syscall()(ctypes.c_long(self._nr[1]), ctypes.c_ulong(self._ctx.value))
            self._ctx = ctypes.c_ulong(0)
