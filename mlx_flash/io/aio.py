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
import platform
import sys

import numpy as np

_SYSCALLS = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)}  # setup, destroy, getevents, submit
IOCB = np.dtype([("data", "<u8"), ("key", "<u4"), ("rw_flags", "<u4"), ("opcode", "<u2"),
                 ("reqprio", "<i2"), ("fildes", "<u4"), ("buf", "<u8"), ("nbytes", "<u8"),
                 ("offset", "<i8"), ("reserved2", "<u8"), ("flags", "<u4"), ("resfd", "<u4")])
IOVEC = np.dtype([("base", "<u8"), ("len", "<u8")])
PREAD, PREADV = 0, 7  # IOCB_CMD_PREAD, IOCB_CMD_PREADV
EVENT = np.dtype([("data", "<u8"), ("obj", "<u8"), ("res", "<i8"), ("res2", "<i8")])
assert IOCB.itemsize == 64 and EVENT.itemsize == 32 and IOVEC.itemsize == 16

_libc = None


def _read_loop_kernel():
    """The kernels' aio_read (kernels/aio_read.h: submit and reap every read in one C++ loop, GIL
    released), or None when the extension is missing, older, or not built for Linux."""
    try:
        return importlib.import_module("mlx_flash._ext").aio_read  # by name: the compiled module is optional
    except (ImportError, AttributeError):
        return None


read_loop_kernel = _read_loop_kernel()


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


class AioContext:
    """An io_setup context with room for `depth` reads in flight. Close it when done."""

    def __init__(self, depth: int):
        self.depth = depth
        self._nr = _SYSCALLS[platform.machine()]
        self._ctx = ctypes.c_ulong(0)
        if _syscall()(ctypes.c_long(self._nr[0]), ctypes.c_long(depth), ctypes.byref(self._ctx)) < 0:
            raise OSError(ctypes.get_errno(), "io_setup failed")
        self._events = np.zeros(depth, EVENT)
        self.min_batch = max(1, depth // 8)  # completions to wait for per call: fewer Python round trips
        self.all_submitted = False  # during on_done: nothing is left to submit

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
        res = np.empty(0, np.int64)
        keep, ptrs = [], np.empty(0, np.uint64)  # iocb arrays (alive until submitted), their addresses
        call, (_, _, getevents, submit) = _syscall(), self._nr
        ctx = ctypes.c_ulong(self._ctx.value)
        events, ev_ptr = self._events, self._events.ctypes.data
        submitted = completed = 0

        def add(fds, offsets, sizes, addresses, vectored):
            nonlocal res, ptrs
            n, first = len(sizes), len(res)
            iocbs = _iocbs(first, fds, offsets, sizes, addresses, vectored)
            keep.append(iocbs)
            ptrs = np.concatenate([ptrs, iocbs.ctypes.data + 64 * np.arange(n, dtype=np.uint64)])
            res = np.concatenate([res, np.full(n, -errno.ECANCELED, np.int64)])

        def reap(min_nr):
            nonlocal completed
            got = call(ctypes.c_long(getevents), ctx, ctypes.c_long(min_nr),
                       ctypes.c_long(self.depth), ctypes.c_void_p(ev_ptr), None)
            if got < 0:
                if ctypes.get_errno() == errno.EINTR:
                    return None
                raise OSError(ctypes.get_errno(), "io_getevents failed")
            idx = events["data"][:got].astype(np.int64)
            res[idx] = events["res"][:got]
            completed += got
            return idx

        add(fds, offsets, sizes, addresses, vectored)
        try:
            while completed < len(res) or more is not None:
                if submitted == len(res) and more is not None:
                    batch = more()
                    if batch is None:
                        more = None
                    else:
                        add(*batch)
                    continue
                room = min(self.depth - (submitted - completed), len(res) - submitted)
                if room > 0:
                    got = call(ctypes.c_long(submit), ctx, ctypes.c_long(room),
                               ctypes.c_void_p(ptrs.ctypes.data + 8 * submitted))
                    if got > 0:
                        submitted += got
                    elif got < 0 and ctypes.get_errno() not in (errno.EAGAIN, errno.EINTR):
                        raise OSError(ctypes.get_errno(), "io_submit failed")
                if submitted == completed or (submitted == len(res) and more is not None):
                    continue  # (the next batch is prepared while these reads fly)
                idx = reap(max(1, min(submitted - completed, wait_for)))
                if idx is not None and on_done is not None and len(idx):
                    self.all_submitted = submitted == len(res)  # (more is None by then)
                    on_done(idx, res)
        except BaseException:
            while completed < submitted:  # the kernel may still write into caller buffers
                reap(submitted - completed)
            raise
        return res

    def read_all(self, fds, offsets, sizes, addresses, vectored=None, landed=None) -> np.ndarray:
        """`read` without callbacks: every read submitted and reaped in one call of the kernels'
        loop (no Python per submission or completion; the GIL is released while reads fly), or
        `read` itself without the kernels. Same arguments and result (bytes read or -errno per read).

        landed (kernels only): (flat uint8, first int64 [reads + 1], starts int64, piece offsets,
        piece lengths, crcs uint32 out): as plain read k lands whole, crcs[b] <- the crc32 of bundle b
        (flat[starts[b]:] over the pieces, chained) for b in first[k]..first[k + 1] - 1, while later
        reads are still in flight; bundles of reads that did not land whole are left as they were."""
        if read_loop_kernel is None:
            if landed is not None:
                raise ValueError("read_all: landed crc32s need the kernels' loop")
            return self.read(fds, offsets, sizes, addresses, vectored)
        res = np.empty(len(sizes), np.int64)
        flags = None if vectored is None else np.ascontiguousarray(vectored, np.uint8)
        err = read_loop_kernel(self._ctx.value, np.ascontiguousarray(fds, np.int64),
                               np.ascontiguousarray(offsets, np.int64), np.ascontiguousarray(sizes, np.int64),
                               np.ascontiguousarray(addresses, np.uint64), flags, self.depth, res, landed)
        if err:
            raise OSError(-err, "io_submit / io_getevents failed")
        return res

    def submit(self, fds, offsets, sizes, addresses, vectored=None) -> dict:
        """Submit reads (the arguments of `read`) and return without waiting for them: up to
        `depth` go out now, the rest in `wait`. The caller keeps every buffer alive and calls
        `wait` (one pending submission per context at a time) before reusing them."""
        n = len(sizes)
        pending = {"iocbs": _iocbs(0, fds, offsets, sizes, addresses, vectored),
                   "res": np.full(n, -errno.ECANCELED, np.int64), "submitted": 0, "completed": 0}
        pending["ptrs"] = pending["iocbs"].ctypes.data + 64 * np.arange(n, dtype=np.uint64)
        try:
            self._submit_some(pending)
        except BaseException:
            self.wait(pending, submit=False)  # the kernel may still write into caller buffers
            raise
        return pending

    def wait(self, pending: dict, submit=True) -> np.ndarray:
        """Each read's result (bytes read, or -errno) of a `submit`, once all are in: reaps them
        (the GIL released while it waits) and submits what did not fit in flight before."""
        call, getevents = _syscall(), self._nr[2]
        ctx, ev_ptr, res = ctypes.c_ulong(self._ctx.value), self._events.ctypes.data, pending["res"]
        error = None
        while pending["completed"] < pending["submitted"] or (submit and pending["submitted"] < len(res)):
            if submit and error is None:
                try:
                    self._submit_some(pending)
                except OSError as e:
                    error, submit = e, False
            if pending["completed"] == pending["submitted"]:
                continue
            got = call(ctypes.c_long(getevents), ctx, ctypes.c_long(1), ctypes.c_long(self.depth),
                       ctypes.c_void_p(ev_ptr), None)
            if got < 0:
                if ctypes.get_errno() == errno.EINTR:
                    continue
                raise OSError(ctypes.get_errno(), "io_getevents failed")
            idx = self._events["data"][:got].astype(np.int64)
            res[idx] = self._events["res"][:got]
            pending["completed"] += got
        if error is not None:
            raise error
        return res

    def _submit_some(self, pending: dict) -> None:
        """io_submit as many of a pending submission's reads as the context has room for."""
        n, done = len(pending["res"]), pending["submitted"]
        room = min(self.depth - (done - pending["completed"]), n - done)
        if room <= 0:
            return
        got = _syscall()(ctypes.c_long(self._nr[3]), ctypes.c_ulong(self._ctx.value), ctypes.c_long(room),
                         ctypes.c_void_p(pending["ptrs"].ctypes.data + 8 * done))
        if got > 0:
            pending["submitted"] += got
        elif got < 0 and ctypes.get_errno() not in (errno.EAGAIN, errno.EINTR):
            raise OSError(ctypes.get_errno(), "io_submit failed")

    def close(self):
        if self._ctx.value:
            _syscall()(ctypes.c_long(self._nr[1]), ctypes.c_ulong(self._ctx.value))
            self._ctx = ctypes.c_ulong(0)
