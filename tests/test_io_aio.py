"""io/aio.py: native AIO reads, in batches handed over while earlier reads are in flight."""

import errno
import os

import numpy as np
import pytest

from mlx_flash.io import aio
from mlx_flash.io.files import address, aligned_buffer

pytestmark = pytest.mark.skipif(not aio.available(), reason="Linux native AIO")


def direct_file(tmp_path, nbytes):
    """(fd opened O_DIRECT, the file's bytes); skips where the filesystem refuses O_DIRECT."""
    data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    path = tmp_path / "blocks.bin"
    path.write_bytes(data.tobytes())
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT), data
    except OSError as e:
        if e.errno == errno.EINVAL:
            pytest.skip("filesystem refuses O_DIRECT")
        raise


@pytest.mark.parametrize("min_batch", [None, 1])
def test_batches_from_more_are_read_and_numbered_on(tmp_path, min_batch):
    """Three batches (5, 3 and 4 reads of 8 KiB, the second one vectored into two halves): every
    read lands where it was sent, results and on_done indices run 0..11 over the batches, and
    `more` is asked for a batch only once everything before it is submitted."""
    fd, data = direct_file(tmp_path, 64 * 8192)
    ctx = aio.AioContext(4)
    buf = aligned_buffer(12 * 8192)
    out = np.frombuffer(buf, np.uint8)
    block = np.random.default_rng(1).permutation(64)[:12]  # block read by read i
    base = address(buf)

    def plain(reads):
        return (np.full(len(reads), fd), block[reads] * 8192, np.full(len(reads), 8192),
                base + np.array(reads) * 8192, None)

    iov = np.zeros(6, aio.IOVEC)  # reads 5-7: second half first in memory, then the first half
    for j, r in enumerate(range(5, 8)):
        iov[2 * j] = (base + r * 8192 + 4096, 4096)
        iov[2 * j + 1] = (base + r * 8192, 4096)
    vectored = (np.full(3, fd), block[5:8] * 8192, np.full(3, 2),
                iov.ctypes.data + 32 * np.arange(3, dtype=np.uint64), np.ones(3, bool))
    batches, seen, asked = [vectored, plain(range(8, 12))], [], []

    def more():
        asked.append(len(seen))
        return batches.pop(0) if batches else None

    flags = []  # (reads seen so far, all_submitted) at each on_done

    def on_done(idx, r):
        seen.extend(idx.tolist())
        flags.append((len(seen), ctx.all_submitted))

    try:
        res = ctx.read(*plain(range(5)), on_done=on_done, more=more, min_batch=min_batch)
    finally:
        ctx.close()
        os.close(fd)
    assert res.tolist() == [8192] * 12 and sorted(seen) == list(range(12))
    # all submitted only once the last batch is out: with 4 in flight, not before 8 reads landed
    assert flags[-1][1] and not any(done for n, done in flags if n < 8)
    assert len(asked) == 3 and asked[0] >= 1  # the first batch was in flight while asked
    rows = out.reshape(12, 2, 4096)
    want = data.reshape(64, 2, 4096)[block]
    assert np.array_equal(rows[:5], want[:5]) and np.array_equal(rows[8:], want[8:])
    assert np.array_equal(rows[5:8, 0], want[5:8, 1]) and np.array_equal(rows[5:8, 1], want[5:8, 0])


def test_failed_read_in_a_later_batch_is_reported(tmp_path):
    fd, _ = direct_file(tmp_path, 16 * 8192)
    ctx = aio.AioContext(4)
    buf = aligned_buffer(4 * 8192)
    base = address(buf)
    later = [(np.full(2, fd), np.array([0, 8192]), np.array([8192, 8192]),
              base + np.array([2, 3]) * 8192 + np.array([0, 1]), None)]  # read 3: misaligned buffer
    try:
        res = ctx.read(np.full(2, fd), np.array([8192, 3 * 8192]), np.full(2, 8192),
                       base + np.arange(2) * 8192, more=lambda: later.pop() if later else None)
    finally:
        ctx.close()
        os.close(fd)
    assert res[:3].tolist() == [8192] * 3 and res[3] == -errno.EINVAL


@pytest.mark.skipif(aio.read_loop_kernel is None, reason="the kernels' AIO loop (mlx_flash._ext, Linux)")
def test_read_all_lands_plain_and_vectored_reads_with_more_reads_than_depth(tmp_path):
    """read_all (the kernels' loop): 10 reads through a context of depth 3 (refilled as reads
    land), reads 4-6 vectored into two swapped halves; a misaligned O_DIRECT buffer fails its read
    alone (-EINVAL), the others still land."""
    fd, data = direct_file(tmp_path, 64 * 8192)
    ctx = aio.AioContext(3)
    buf = aligned_buffer(10 * 8192)
    out, base = np.frombuffer(buf, np.uint8), address(buf)
    block = np.random.default_rng(2).permutation(64)[:10]
    iov = np.zeros(6, aio.IOVEC)
    for j, r in enumerate(range(4, 7)):
        iov[2 * j] = (base + r * 8192 + 4096, 4096)
        iov[2 * j + 1] = (base + r * 8192, 4096)
    vectored = np.zeros(10, bool)
    vectored[4:7] = True
    sizes = np.where(vectored, 2, 8192)
    addresses = base + np.arange(10, dtype=np.uint64) * 8192
    addresses[4:7] = iov.ctypes.data + 32 * np.arange(3, dtype=np.uint64)
    addresses[9] += 1  # misaligned
    try:
        res = ctx.read_all(np.full(10, fd), block * 8192, sizes, addresses, vectored)
    finally:
        ctx.close()
        os.close(fd)
    assert res[:9].tolist() == [8192] * 9 and res[9] == -errno.EINVAL
    rows, want = out.reshape(10, 2, 4096), data.reshape(64, 2, 4096)[block]
    assert np.array_equal(rows[:4], want[:4]) and np.array_equal(rows[7:9], want[7:9])
    assert np.array_equal(rows[4:7, 0], want[4:7, 1]) and np.array_equal(rows[4:7, 1], want[4:7, 0])


@pytest.mark.skipif(aio.read_loop_kernel is None, reason="the kernels' AIO loop (mlx_flash._ext, Linux)")
def test_read_all_reports_a_failed_submission(tmp_path):
    """A read io_submit refuses (a closed file descriptor): OSError, after every read submitted
    before it has completed."""
    fd, _ = direct_file(tmp_path, 4 * 8192)
    ctx = aio.AioContext(4)
    buf = aligned_buffer(2 * 8192)
    try:
        with pytest.raises(OSError) as err:
            ctx.read_all(np.array([fd, 10 ** 6]), np.array([0, 8192]), np.full(2, 8192),
                         address(buf) + np.arange(2, dtype=np.uint64) * 8192)
        assert err.value.errno == errno.EBADF
    finally:
        ctx.close()
        os.close(fd)


def test_submit_returns_at_once_and_wait_lands_every_read(tmp_path):
    """submit sends at most `depth` reads and returns; wait reaps them and submits the rest: 7
    reads of 8 KiB through a context of depth 3 land in order, a misaligned one fails alone."""
    fd, data = direct_file(tmp_path, 32 * 8192)
    ctx = aio.AioContext(3)
    buf = aligned_buffer(7 * 8192)
    out, base = np.frombuffer(buf, np.uint8), address(buf)
    block = np.random.default_rng(3).permutation(32)[:7]
    addresses = base + np.arange(7, dtype=np.uint64) * 8192
    addresses[5] += 1  # misaligned
    try:
        pending = ctx.submit(np.full(7, fd), block * 8192, np.full(7, 8192), addresses)
        assert pending.submitted == 3 and pending.completed == 0
        res = ctx.wait(pending)
    finally:
        ctx.close()
        os.close(fd)
    assert pending.completed == pending.submitted == 7
    assert res.tolist() == [8192] * 5 + [-errno.EINVAL, 8192]
    rows, want = out.reshape(7, 8192), data.reshape(32, 8192)[block]
    assert np.array_equal(rows[:5], want[:5]) and np.array_equal(rows[6], want[6])


@pytest.mark.skipif(aio.read_loop_kernel is None, reason="the kernels' AIO loop (mlx_flash._ext, Linux)")
def test_read_all_watches_the_completion_ring_before_it_sleeps(tmp_path):
    """read_all's waits: with a long spin every wait ends on the completion ring (no sleep in
    io_getevents); with spin_ns 0 every wait blocks. The reads land either way."""
    fd, data = direct_file(tmp_path, 32 * 8192)
    ctx = aio.AioContext(4)
    buf = aligned_buffer(10 * 8192)
    out, base = np.frombuffer(buf, np.uint8), address(buf)
    block = np.random.default_rng(4).permutation(32)[:10]
    args = (np.full(10, fd), block * 8192, np.full(10, 8192), base + np.arange(10, dtype=np.uint64) * 8192)
    try:
        ctx.spin_ns = 10 ** 9
        assert ctx.read_all(*args).tolist() == [8192] * 10
        spun = ctx.waits.copy()
        out[:] = 0
        ctx.spin_ns = 0
        assert ctx.read_all(*args).tolist() == [8192] * 10
        blocked = ctx.waits - spun
    finally:
        ctx.close()
        os.close(fd)
    assert spun[0] >= 3 and spun[1] == 0  # 10 reads through depth 4: at least three waits
    assert blocked[0] == 0 and blocked[1] >= 3
    assert np.array_equal(out.reshape(10, 8192), data.reshape(32, 8192)[block])


def test_the_spin_is_set_by_the_environment(monkeypatch):
    """MLX_FLASH_AIO_SPIN_US sets a context's spin (microseconds; 0 blocks at once); a value that is
    not a number >= 0 is refused with a message naming the variable."""
    from mlx_flash.errors import FlashError

    monkeypatch.delenv("MLX_FLASH_AIO_SPIN_US", raising=False)
    assert aio.spin_ns() == aio.DEFAULT_SPIN_US * 1000
    monkeypatch.setenv("MLX_FLASH_AIO_SPIN_US", "0")
    ctx = aio.AioContext(2)
    try:
        assert ctx.spin_ns == 0
    finally:
        ctx.close()
    monkeypatch.setenv("MLX_FLASH_AIO_SPIN_US", "150.5")
    assert aio.spin_ns() == 150500
    for bad in ("-1", "soon", "nan"):
        monkeypatch.setenv("MLX_FLASH_AIO_SPIN_US", bad)
        with pytest.raises(FlashError, match="MLX_FLASH_AIO_SPIN_US"):
            aio.AioContext(2)
