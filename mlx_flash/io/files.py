"""The file layer under the loader: uncached opens, full positional reads, aligned buffers.

Everything that touches a file descriptor goes through a `FileLayer`, so tests can inject faults
(short reads, EIO, EINTR) by passing their own `FileLayer` subclass to the loader.
"""

import errno
import mmap
import os
import sys
import warnings

import numpy as np

from ..errors import FlashError

IOV_MAX = 1024  # Linux and macOS limit on iovecs per preadv call
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


def address(buf) -> int:
    """Memory address of a buffer (memoryview / mmap / numpy array)."""
    return np.frombuffer(buf, np.uint8).ctypes.data if not isinstance(buf, np.ndarray) \
        else buf.ctypes.data


def aligned_buffer(nbytes: int) -> memoryview:
    """A page-aligned writable buffer (anonymous mmap) of at least `nbytes` bytes."""
    return memoryview(mmap.mmap(-1, max(nbytes, mmap.PAGESIZE)))


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
