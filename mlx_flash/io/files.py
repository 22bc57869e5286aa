"""The file layer under the loader: uncached opens, full positional reads, aligned buffers.

Everything that touches a file descriptor goes through a `FileLayer`, so tests can inject faults
(short reads, EIO, EINTR) by passing their own `FileLayer` subclass to the loader.
"""

import ctypes
import ctypes.util
import errno
import mmap
import os
import sys
import warnings

import numpy as np

from ..errors import FlashError

IOV_MAX = 1024  # Linux and macOS limit on iovecs per preadv call
HUGE_PAGE = 2 << 20  # bytes: a transparent huge page on Linux x86-64 / arm64 (4 KiB base pages)
_MADV_HUGEPAGE, _MADV_DONTNEED = 14, 4  # Linux madvise advice values
F_NOCACHE = 48  # macOS fcntl: do not keep this file's data in the unified buffer cache
_warned = set()


def warn_once(key, message):
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


class FileLayer:
    """open / preadv / close / drop-cache, one method each. Override any of them to inject faults."""

    def open(self, path, direct: bool) -> tuple[int, bool]:
        """(fd, is_direct). Direct = O_DIRECT (Linux) or F_NOCACHE (macOS)."""
        if direct and hasattr(os, "O_DIRECT"):
            try:
                return os.open(path, os.O_RDONLY | os.O_DIRECT), True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                warn_once(("odirect", os.stat(path).st_dev),
                          f"{path}: the filesystem refuses O_DIRECT; reading through the page cache "
                          f"and dropping pages with posix_fadvise(DONTNEED) after each read")
        fd = os.open(path, os.O_RDONLY)
        if direct and sys.platform == "darwin":
            import fcntl  # F_NOCACHE: macOS only
            fcntl.fcntl(fd, F_NOCACHE, 1)
            return fd, True
        return fd, False

    def preadv(self, fd, buffers, offset) -> int:
        return os.preadv(fd, buffers, offset)

    def drop_cache(self, fd, offset, length):
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)

    def close(self, fd):
        os.close(fd)


def _copy_rows_kernel():
    """The kernels' copy_rows(flat, starts, length, dest, slots) (dest[slots[b], :length] =
    flat[starts[b]:][:length], GIL released, streaming stores on AVX2), or None when the extension
    is missing or older."""
    try:
        import importlib
        return importlib.import_module("mlx_flash._ext").copy_rows  # by name: the module is optional
    except (ImportError, AttributeError):
        return None


copy_rows_kernel = _copy_rows_kernel()


def copy_rows(flat, starts, length, dest, slots):
    """dest[slots[b], :length] = flat[starts[b]: starts[b] + length] for every b: staged reads
    copied out to their rows (flat: uint8 array; dest: uint8 matrix with contiguous rows; starts,
    slots: int64 arrays). The kernels' copy when built (one call, GIL released), else numpy, in
    blocks of 64 rows (a block of gathered rows stays in cache on its way to the destination)."""
    if copy_rows_kernel is not None:
        copy_rows_kernel(flat, np.ascontiguousarray(starts, np.int64), int(length), dest,
                         np.ascontiguousarray(slots, np.int64))
        return
    rows = np.lib.stride_tricks.sliding_window_view(flat, length)  # a view: row i = flat[i: i + length]
    for a in range(0, len(starts), 64):
        dest[slots[a: a + 64], :length] = rows[starts[a: a + 64]]


def address(buf) -> int:
    """Memory address of a buffer (memoryview / mmap / numpy array)."""
    return np.frombuffer(buf, np.uint8).ctypes.data if not isinstance(buf, np.ndarray) \
        else buf.ctypes.data


def aligned_buffer(nbytes: int) -> memoryview:
    """A page-aligned writable buffer of at least `nbytes` bytes: private anonymous memory,
    faulted in here (not inside the first read that lands in it). From 2 MiB on Linux it starts
    on a 2 MiB boundary and takes huge_page_bytes(nbytes), all in transparent huge pages
    (use_huge_pages)."""
    nbytes = max(nbytes, mmap.PAGESIZE)
    huge = _takes_huge_pages(nbytes)
    backed = huge_page_bytes(nbytes)  # whole huge pages: a read's tail lands in one too
    m = mmap.mmap(-1, backed + (HUGE_PAGE if huge else 0), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    skip = -address(m) % HUGE_PAGE if huge else 0
    view = np.frombuffer(m, np.uint8)[skip: skip + backed]
    use_huge_pages(view)
    view[::mmap.PAGESIZE] = 0  # fault the other pages in now too
    return memoryview(m)[skip: skip + nbytes]


def huge_page_bytes(nbytes: int) -> int:
    """The memory aligned_buffer(nbytes) takes (what the memory plan counts for a staging
    buffer): on Linux from HUGE_PAGE on, whole huge pages. With only its 2 MiB-aligned part in a
    huge page, a 3.55 MB staging buffer took 4.0 ms per whole-layer direct read here against 2.6-2.7
    ms into whole huge pages: a read's tail landed in 4 KiB pages, one segment each."""
    return -(-nbytes // HUGE_PAGE) * HUGE_PAGE if _takes_huge_pages(nbytes) else nbytes


def _takes_huge_pages(nbytes: int) -> bool:
    """Whether aligned_buffer(nbytes) starts on a huge-page boundary and rounds up to whole ones."""
    return nbytes >= HUGE_PAGE and sys.platform.startswith("linux")


def use_huge_pages(buf: np.ndarray) -> int:
    """Back the 2 MiB-aligned part of `buf` (a uint8 view of private anonymous memory whose
    contents are zeros or garbage: they become zeros) with transparent huge pages, faulted in now.
    Direct reads landing in huge pages ran 1.3-1.5x faster than into 4 KiB pages here (KVM,
    virtio disk: `bench io --parts dest`). Returns the bytes advised (0: none, or not Linux).
    Huge pages when the kernel grants them (THP 'madvise' or 'always'); else 4 KiB pages."""
    if not sys.platform.startswith("linux") or buf.size < HUGE_PAGE:
        return 0
    lo = -buf.ctypes.data % HUGE_PAGE
    hi = lo + (buf.size - lo) // HUGE_PAGE * HUGE_PAGE
    if hi <= lo:
        return 0
    libc = _libc()
    start, length = ctypes.c_void_p(buf.ctypes.data + lo), ctypes.c_size_t(hi - lo)
    if libc.madvise(start, length, _MADV_HUGEPAGE) != 0:
        return 0  # THP not built in: 4 KiB pages as before
    libc.madvise(start, length, _MADV_DONTNEED)  # drop the 4 KiB pages: the next touch maps huge ones
    buf[lo:hi:mmap.PAGESIZE] = 0  # fault them in now (zero-filled), not inside a read
    return hi - lo


_libc_handle = None


def _libc():
    global _libc_handle
    if _libc_handle is None:
        _libc_handle = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    return _libc_handle


def read_full(files: FileLayer, fd, buffers, offset, path, fallback_fd=None) -> None:
    """preadv until every buffer is full: retries EINTR and short reads, splits at IOV_MAX.

    A short read that leaves the file offset unaligned cannot continue on an O_DIRECT descriptor,
    so the remainder goes through `fallback_fd` (a buffered descriptor of the same file) if given.
    Raises FlashError naming the file and offset on EOF (truncated file) or I/O error.
    """
    bufs = [memoryview(b).cast("B") for b in buffers]
    bufs = [b for b in bufs if len(b)]
    pos, use_fd = offset, fd
    while bufs:
        chunk = bufs[:IOV_MAX]
        want = sum(len(b) for b in chunk)
        try:
            n = files.preadv(use_fd, chunk, pos)
        except InterruptedError:
            continue
        except OSError as e:
            if e.errno == errno.EINTR:
                continue
            raise FlashError(f"{path}: read error at offset {pos} ({e.strerror or e})") from None
        if n == 0:
            raise FlashError(f"{path}: truncated (end of file at offset {pos}, wanted {want} more bytes)")
        if n < 0 or n > want:
            raise FlashError(f"{path}: bad read size {n} at offset {pos}")
        pos += n
        if n < want and fallback_fd is not None:
            use_fd = fallback_fd  # the rest may be unaligned: finish through the page cache
        while n:
            if n >= len(bufs[0]):
                n -= len(bufs[0])
                bufs.pop(0)
            else:
                bufs[0] = bufs[0][n:]
                n = 0
