"""Page-cache control for honest cold reads: evict a pack's pages and report their residency.

Linux: posix_fadvise(DONTNEED) per file, checked with mincore(2) (libc via ctypes on an mmap of the
file); `drop_caches=True` as root additionally writes 1 to /proc/sys/vm/drop_caches when pages
survive. macOS: `purge` when permitted; otherwise reads rely on F_NOCACHE (the loader sets it).
"""

import ctypes
import ctypes.util
import mmap
import os
import shutil
import subprocess
import sys
from pathlib import Path

_libc = None


def _c():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        _libc.mmap.restype = ctypes.c_void_p
        _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                               ctypes.c_int, ctypes.c_long]
        _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return _libc


def pack_files(pack_dir) -> list[Path]:
    """Every regular file of a pack (bundle files, resident tensors, manifest, tokenizer)."""
    return sorted(p for p in Path(pack_dir).rglob("*") if p.is_file())


def file_residency(path) -> tuple[int, int]:
    """(cached pages, total pages) of one file, from mincore(2)."""
    size = os.path.getsize(path)
    page = mmap.PAGESIZE
    pages = (size + page - 1) // page
    if pages == 0:
        return 0, 0
    libc = _c()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap failed for mincore on {path}")
        try:
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore failed on {path}")
            return sum(v & 1 for v in vec), pages
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def residency(paths) -> float:
    """Fraction (0..1) of the files' pages currently in the page cache."""
    if isinstance(paths, (str, Path)):
        paths = pack_files(paths) if Path(paths).is_dir() else [paths]
    cached = total = 0
    for p in paths:
        c, t = file_residency(p)
        cached, total = cached + c, total + t
    return cached / total if total else 0.0


def evict(paths, *, drop_caches=False) -> dict:
    """Evict files (or a pack directory) from the page cache before a cold run.

    Returns {"method": what was used, "residency": fraction still cached afterwards (Linux;
    None where it cannot be measured)}.
    """
    if isinstance(paths, (str, Path)):
        paths = pack_files(paths) if Path(paths).is_dir() else [paths]
    paths = list(paths)
    if sys.platform == "darwin":
        if shutil.which("purge") and subprocess.run(["purge"], capture_output=True).returncode == 0:
            return {"method": "purge", "residency": None}
        return {"method": "F_NOCACHE (purge not permitted: pages may stay cached)", "residency": None}
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    method, left = "posix_fadvise(DONTNEED)", residency(paths)
    if left > 0 and drop_caches and os.geteuid() == 0:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        method, left = "drop_caches", residency(paths)
    return {"method": method, "residency": left}
