"""io/files.py: buffers direct reads land in (pre-faulted, 2 MiB pages where the kernel grants them)."""

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_flash.io import FlashLoader, host_bytes
from mlx_flash.io.files import HUGE_PAGE, aligned_buffer, use_huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
linux_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
    reason="transparent huge pages: Linux with THP 'madvise' or 'always'")


def mapping_kb(addr, nbytes=1) -> dict:
    """{'Rss': kB, 'AnonHugePages': kB, ...} summed over the mappings holding bytes addr..addr +
    nbytes (/proc/self/smaps)."""
    fields, inside = {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < addr + nbytes and addr < hi
        elif inside and line.split()[-1] == "kB":
            fields[head.rstrip(":")] = fields.get(head.rstrip(":"), 0) + int(line.split()[1])
    return fields


def resident_pages(addr, nbytes) -> tuple:
    """(pages resident, pages) of memory addr..addr + nbytes (mincore)."""
    import ctypes
    import mmap

    pages = -(-nbytes // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(nbytes), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec), pages


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps, mincore")
def test_aligned_buffer_is_private_and_faulted_in():
    for n in (5000, 3 * HUGE_PAGE + 12345):
        buf = aligned_buffer(n)
        addr = np.frombuffer(buf, np.uint8).ctypes.data
        assert len(buf) == n and addr % 4096 == 0
        got, pages = resident_pages(addr, n)
        assert got == pages  # every page faulted in at allocation, not in the first read
        np.frombuffer(buf, np.uint8)[:] = 7
        assert np.frombuffer(buf, np.uint8).sum() == 7 * n


@linux_thp
def test_reads_land_in_huge_pages():
    buf = aligned_buffer(3 * HUGE_PAGE)
    addr = np.frombuffer(buf, np.uint8).ctypes.data
    assert addr % HUGE_PAGE == 0 and mapping_kb(addr).get("AnonHugePages", 0) >= 2048
    # an MLX array: its 2 MiB-aligned part, zero-filled, in huge pages (the others keep 4 KiB pages)
    arr = mx.ones((5 * HUGE_PAGE,), mx.uint8)
    host = host_bytes(arr)
    advised = use_huge_pages(host)
    lo = -host.ctypes.data % HUGE_PAGE
    assert advised == (host.size - lo) // HUGE_PAGE * HUGE_PAGE >= 4 * HUGE_PAGE
    assert host[lo: lo + advised].max() == 0 and host[:lo].min() == 1 and host[lo + advised:].min() == 1
    assert mapping_kb(host.ctypes.data + lo).get("AnonHugePages", 0) * 1024 >= advised // 2
    assert use_huge_pages(host[: HUGE_PAGE - 1]) == 0  # too small to hold one


@linux_thp
def test_a_buffer_past_a_huge_page_multiple_takes_whole_huge_pages():
    """aligned_buffer(n) for n between two multiples of 2 MiB: its last bytes in a huge page too
    (with only the 2 MiB-aligned part huge, a whole-layer direct read landing in its 4 KiB tail ran
    1.5x slower), and huge_page_bytes(n), what the memory plan counts, is what it takes."""
    from mlx_flash.io.files import huge_page_bytes

    n = HUGE_PAGE + 3 * HUGE_PAGE // 4  # a 3.5 MB staging buffer (one SmolLM2 layer, float16)
    assert huge_page_bytes(n) == 2 * HUGE_PAGE and huge_page_bytes(HUGE_PAGE - 1) == HUGE_PAGE - 1
    buf = aligned_buffer(n)
    addr = np.frombuffer(buf, np.uint8).ctypes.data
    assert len(buf) == n and addr % HUGE_PAGE == 0
    huge = mapping_kb(addr).get("AnonHugePages", 0)
    if huge == 0:
        pytest.skip("the kernel granted no huge page now (memory fragmented)")
    assert huge * 1024 >= huge_page_bytes(n)


@linux_thp
def test_loader_destinations_use_huge_pages(tiny_llama, tmp_path):
    from mlx_flash.pack import write_pack

    pack = write_pack(tiny_llama("src", dtype="float16", intermediate=256), tmp_path / "pack", progress=False)
    with FlashLoader(pack, threads=2, plan=False) as loader:
        bank = loader.alloc_raw(0, -(-4 * HUGE_PAGE // loader.entry(0).stride))  # a slot bank of > 8 MiB
        host = host_bytes(bank)
        assert host.max() == 0  # still zeros
        start = host.ctypes.data + (-host.ctypes.data % HUGE_PAGE)
        assert mapping_kb(start).get("AnonHugePages", 0) >= 2 * 2048
        loader.read(0, np.arange(8), bank)
        assert host[: 8 * loader.entry(0).stride].any()


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("length,row_bytes", [(4096, 4096), (256, 320), (4096, 4100), (100, 128)])
def test_copy_rows_puts_each_staged_range_in_its_row(monkeypatch, kernel, length, row_bytes):
    """files.copy_rows: dest[slots[b], :length] = flat[starts[b]:][:length]; whole aligned 64-byte
    lines (streamed by the kernels' AVX2 copy), rows off the 64-byte grid and odd lengths (memcpy)
    alike, with the kernels and with numpy; the rest of each row is left alone."""
    from mlx_flash.io import files

    if kernel and files.copy_rows_kernel is None:
        pytest.skip("kernels not built")
    if not kernel:
        monkeypatch.setattr(files, "copy_rows_kernel", None)
    rng = np.random.default_rng(0)
    flat = rng.integers(0, 256, 1 << 16, np.uint8)
    buf = files.aligned_buffer(9 * row_bytes)
    dest = np.frombuffer(buf, np.uint8)[: 9 * row_bytes].reshape(9, row_bytes)
    dest[:] = 7
    starts = rng.integers(0, len(flat) - length, 6)
    slots = np.array([8, 0, 3, 5, 1, 6])
    files.copy_rows(flat, starts, length, dest, slots)
    want = np.full((9, row_bytes), 7, np.uint8)
    for s, r in zip(starts, slots):
        want[r, :length] = flat[s: s + length]
    assert (dest == want).all()
    if kernel:
        with pytest.raises(ValueError, match="outside flat"):
            files.copy_rows(flat, np.array([len(flat) - length + 1]), length, dest, np.array([0]))
        with pytest.raises(ValueError, match="slot out of range"):
            files.copy_rows(flat, np.array([0]), length, dest, np.array([9]))
