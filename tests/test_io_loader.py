"""Flash loader: zero-copy destinations, exact bundle reads, alignment edges, injected faults; a pack
is only ever read (the read cost profile is measured on its own files, read-only, or skipped)."""

import contextlib
import errno
import json
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from mlx_flash.config import FlashConfig
from mlx_flash.errors import FlashError
from mlx_flash.io import FileLayer, FlashLoader, ReadCost, aio, host_bytes
from mlx_flash.io import files as io_files
from mlx_flash.io import loader as loader_module
from mlx_flash.io.planner import load_cost
from mlx_flash.models.flash import build_flash_model
from mlx_flash.pack import read_layer_components, read_manifest, write_pack
from mlx_flash.pack.reader import read_bundle_index

COST = ReadCost(latency_s=1e-4, bandwidth=1e9)  # merge gaps up to 100 kB


@pytest.fixture
def make_pack(tiny_llama, tmp_path):
    def make(name="src", down_bits=None, **kwargs):
        return write_pack(tiny_llama(name, **kwargs), tmp_path / f"{name}.pack", progress=False,
                          down_bits=down_bits)
    return make


def test_buffer_is_zero_copy():
    arr = mx.zeros((4, 6), dtype=mx.bfloat16)
    mx.eval(arr)
    raw = host_bytes(arr)
    assert raw.flags.writeable and raw.size == 4 * 6 * 2
    raw[2 * 12 + 2: 2 * 12 + 4] = np.frombuffer(np.float32(3.0).tobytes()[2:], np.uint8)  # bf16 3.0
    assert arr[2, 1].item() == 3.0 and mx.sum(arr).item() == 3.0  # read back through MLX
    assert host_bytes(arr).ctypes.data == raw.ctypes.data  # same memory every time


def check_rows(pack, loader, layer, ids, dest, slots):
    entry = read_manifest(pack)["bundles"][layer]
    full = read_layer_components(pack, entry)
    if isinstance(dest, dict):
        for name, arr in dest.items():
            got, want = arr[mx.array(slots)], full[name][mx.array(ids)]
            assert mx.array_equal(got, want).item(), name
    else:  # raw bundles: compare with the file bytes
        data = np.fromfile(pack / entry["file"], np.uint8)
        got = np.array(dest, copy=False)
        for i, s in zip(ids, slots):
            off = entry["offset"] + i * entry["stride"]
            assert (got[s] == data[off: off + entry["stride"]]).all()


def corrupt_bundle(pack, bundle: int, layer: int = 0):
    """Flip one bit inside bundle `bundle` of `layer`'s file (its crc32 no longer matches)."""
    entry = read_manifest(pack)["bundles"][layer]
    path = pack / entry["file"]
    data = bytearray(path.read_bytes())
    data[entry["offset"] + bundle * entry["stride"] + 11] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("dtype,quant", [("float32", None), ("float16", None), ("bfloat16", None),
                                         ("float16", (4, 32)), ("float32", (8, 64))])
@pytest.mark.parametrize("direct,plan,engine", [(True, True, "auto"), (True, False, "auto"),
                                               (True, True, "threads"), (True, False, "threads"),
                                               (False, True, "auto"), (False, False, "auto")])
def test_random_subsets_equal_source_rows(make_pack, dtype, quant, direct, plan, engine):
    pack = make_pack(dtype=dtype, quantize=quant, intermediate=128)
    rng = np.random.default_rng(0)
    with FlashLoader(pack, threads=4, direct=direct, plan=plan, cost=COST, engine=engine) as loader:
        for layer in (0, 1):
            dest = loader.alloc(layer, 128)
            for _ in range(3):
                ids = rng.choice(128, size=rng.integers(1, 40), replace=False)
                slots = rng.choice(128, size=len(ids), replace=False)
                stats = loader.read(layer, ids, dest, slots)
                assert stats.bundles == len(ids) and stats.direct == direct
                check_rows(pack, loader, layer, ids, dest, slots)
            raw = loader.alloc_raw(layer, 10)
            ids = rng.choice(128, size=10, replace=False)
            loader.read(layer, ids, raw)
            check_rows(pack, loader, layer, ids, raw, list(range(10)))


def test_read_many_layers_at_once(make_pack):
    pack = make_pack(dtype="float16", quantize=(4, 32))
    with FlashLoader(pack, threads=3, cost=COST) as loader:
        d0, d1 = loader.alloc(0, 5), loader.alloc(1, 5)
        stats = loader.read_many([(0, [9, 2, 70], d0, [4, 0, 1]), (1, [95, 94, 0, 1, 50], d1, None)])
        assert stats.bundles == 8 and sum(stats.read_sizes.values()) == stats.reads
    check_rows(pack, None, 0, [9, 2, 70], d0, [4, 0, 1])
    check_rows(pack, None, 1, [95, 94, 0, 1, 50], d1, [0, 1, 2, 3, 4])


@pytest.mark.parametrize("direct,raw", [(True, False), (True, True), (False, False)])
def test_started_reads_land_what_read_lands_when_finished(make_pack, direct, raw):
    """start_read submits and returns; finish_read reaps, checks and copies out: the rows equal
    the pack's, two keys in flight at once, a synchronous read on the calling thread between
    them; without O_DIRECT (no native AIO) start_read reads at once. A corrupt bundle fails at
    finish_read."""
    pack = make_pack(dtype="float16", quantize=(4, 32), intermediate=128)
    rng = np.random.default_rng(5)
    with FlashLoader(pack, threads=4, direct=direct, cost=COST) as loader:
        alloc = loader.alloc_raw if raw else loader.alloc
        d0, d1, d2 = alloc(0, 40), alloc(1, 40), alloc(0, 40)
        ids0, ids1, ids2 = (np.sort(rng.choice(128, size=40, replace=False)) for _ in range(3))
        s0 = loader.start_read(0, ids0, d0, None, key=0)
        s1 = loader.start_read(1, ids1, d1, np.arange(40)[::-1], key=1)
        assert ("job" in s0) == (direct and aio.available())
        loader.read(0, ids2, d2)
        stats = [loader.finish_read(s) for s in (s1, s0)]
        assert [s.bundles for s in stats] == [40, 40] and all(s.bytes_read > 0 for s in stats)
        check_rows(pack, loader, 0, ids0, d0, list(range(40)))
        check_rows(pack, loader, 1, ids1, d1, list(range(40))[::-1])
        check_rows(pack, loader, 0, ids2, d2, list(range(40)))
    entry = read_manifest(pack)["bundles"][0]
    path = pack / entry["file"]
    data = bytearray(path.read_bytes())
    data[entry["offset"] + 7 * entry["stride"] + 11] ^= 0x40
    path.write_bytes(bytes(data))
    with FlashLoader(pack, threads=2, direct=direct, cost=COST) as loader:
        with pytest.raises(FlashError, match=r"layer_000\.bin: checksum mismatch in bundle 7 "):
            loader.finish_read(loader.start_read(0, [6, 7, 8], (loader.alloc_raw if raw else loader.alloc)(0, 3)))


def test_quantized_sparse_matmul_on_loaded_rows(make_pack):
    pack = make_pack(dtype="float32", quantize=(4, 32), down_bits=4)  # a quantized down column
    entry = read_manifest(pack)["bundles"][0]
    full = read_layer_components(pack, entry)
    ids = [3, 17, 40, 95]
    with FlashLoader(pack, threads=2, cost=COST) as loader:
        d = loader.alloc(0, len(ids))
        loader.read(0, ids, d)
    h = mx.random.normal((2, len(ids)), key=mx.random.key(0))
    q = dict(group_size=32, bits=4)
    y = mx.quantized_matmul(h, d["down_t.weight"], d["down_t.scales"], d["down_t.biases"],
                            transpose=False, **q)
    down_t = mx.dequantize(full["down_t.weight"], full["down_t.scales"], full["down_t.biases"], **q)
    assert mx.allclose(y, h @ down_t[mx.array(ids)], atol=1e-5).item()


@pytest.mark.parametrize("direct", [True, False])
def test_alignment_edges(make_pack, direct):
    # stride 1160 bytes (not a multiple of 4096); 96 bundles end mid-block
    pack = make_pack(dtype="float16", hidden=96, intermediate=96)
    entry = read_manifest(pack)["bundles"][0]
    assert entry["stride"] % 4096 and entry["length"] % 4096
    with FlashLoader(pack, threads=3, direct=direct, cost=COST) as loader:
        dest = loader.alloc(0, 96)
        for ids in ([0], [95], [0, 95], [94, 95], [3, 4, 5], list(range(96))):
            loader.read(0, ids, dest, ids)
            check_rows(pack, loader, 0, ids, dest, ids)
        # a bundle straddling a 4 KiB boundary
        k = next(i for i in range(96) if (i * entry["stride"]) // 4096 !=
                 ((i + 1) * entry["stride"] - 1) // 4096)
        loader.read(0, [k], dest, [0])
        check_rows(pack, loader, 0, [k], dest, [0])


def test_direct_reads_zero_copy_when_aligned(make_pack):
    # hidden 1024 float32, gated: bundle = 3 x 4096 bytes, so raw destinations need no bounce
    pack = make_pack(dtype="float32", hidden=1024, intermediate=16, layers=1, vocab=16)
    with FlashLoader(pack, threads=2, cost=COST) as loader:
        raw = loader.alloc_raw(0, 16)
        ids = [1, 2, 3, 9, 15]
        stats = loader.read(0, ids, raw)
        if not stats.direct:
            pytest.skip("filesystem refuses O_DIRECT")
        assert stats.zero_copy_reads == stats.reads and stats.bounced_reads == 0
        check_rows(pack, loader, 0, ids, raw, list(range(5)))


def test_odirect_refused_falls_back_once(make_pack, monkeypatch):
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT")
    pack = make_pack()
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", no_direct)
    monkeypatch.setattr(io_files, "_warned", set())
    with pytest.warns(RuntimeWarning, match="refuses O_DIRECT"):
        with FlashLoader(pack, threads=2, cost=COST) as loader:
            d = loader.alloc(0, 4)
            stats = loader.read(0, [1, 50, 51, 90], d)
            check_rows(pack, None, 0, [1, 50, 51, 90], d, [0, 1, 2, 3])
            assert not loader.read(1, [2], d).direct
    assert not stats.direct


class ShortReads(FileLayer):
    """Short reads (2048 bytes on O_DIRECT descriptors, as a block device would return; 700 bytes
    otherwise) and EINTR every third call."""
    calls = 0

    def preadv(self, fd, buffers, offset):
        ShortReads.calls += 1
        if ShortReads.calls % 3 == 0:
            raise InterruptedError(errno.EINTR, "Interrupted system call")
        import fcntl
        direct = fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0)
        first = memoryview(buffers[0])[:2048 if direct else 700]
        return os.preadv(fd, [first], offset)


class FailingReads(FileLayer):
    def __init__(self, err=None, eof=False):
        self.err, self.eof = err, eof

    def preadv(self, fd, buffers, offset):
        if self.eof:
            return 0
        raise OSError(self.err, os.strerror(self.err))


@pytest.mark.parametrize("direct", [True, False])
def test_short_reads_and_eintr_are_retried(make_pack, direct):
    pack = make_pack(dtype="bfloat16", quantize=(8, 32))
    with FlashLoader(pack, threads=2, direct=direct, cost=COST, files=ShortReads()) as loader:
        d = loader.alloc(1, 8)
        ids = [0, 1, 2, 30, 60, 93, 94, 95]
        loader.read(1, ids, d)
        check_rows(pack, loader, 1, ids, d, list(range(8)))
    assert ShortReads.calls > 8


@pytest.mark.parametrize("files,match", [
    (FailingReads(errno.EIO), r"layer_000\.bin: read error at offset \d+ \(Input/output error\)"),
    (FailingReads(eof=True), r"layer_000\.bin: truncated \(end of file at offset \d+"),
])
def test_read_errors_are_flash_errors(make_pack, files, match):
    pack = make_pack()
    with FlashLoader(pack, threads=2, cost=COST, files=files) as loader:
        with pytest.raises(FlashError, match=match):
            loader.read(0, [4, 5, 80], loader.alloc(0, 3))


ALIGNED = dict(dtype="float32", hidden=1024, intermediate=16, layers=2, vocab=16)  # 4096-byte rows


def aio_only(monkeypatch) -> list:
    """Fail any read that leaves native AIO; returns the list each AIO call's vectored flags
    are appended to."""
    real_read, calls = aio.AioContext.read, []

    def spy(self, fds, offsets, sizes, addresses, vectored=None, *, more=None, **kw):
        calls.append(vectored)

        def spied_more():  # later batches of the same call
            batch = more()
            if batch is not None:
                calls[-1] = np.concatenate([calls[-1], batch[4]]) if batch[4] is not None else None
            return batch
        return real_read(self, fds, offsets, sizes, addresses, vectored,
                         more=spied_more if more else None, **kw)

    real_read_all = aio.AioContext.read_all

    def spy_all(self, fds, offsets, sizes, addresses, vectored=None, landed=None):  # a small call's reads at once
        calls.append(vectored)
        return real_read_all(self, fds, offsets, sizes, addresses, vectored, landed)

    monkeypatch.setattr(aio.AioContext, "read", spy)
    monkeypatch.setattr(aio.AioContext, "read_all", spy_all)
    monkeypatch.setattr(FileLayer, "preadv", lambda *a: pytest.fail("a read left AIO"))
    return calls


def pipelined_aio(monkeypatch):
    """Every AIO call through AioContext.read's loop (reads checked as they land), as a call above
    STAGED_BATCH bytes is read, instead of the kernels' read-everything-at-once loop."""
    monkeypatch.setattr(aio, "read_loop_kernel", None)


@pytest.mark.skipif(not aio.available(), reason="Linux native AIO")
def test_zero_copy_reads_are_vectored_aio_into_component_rows(make_pack, monkeypatch):
    # gate, up and down rows of 4096 bytes: every component row is direct-I/O aligned, so each read
    # is one IOCB_CMD_PREADV whose iovecs land the rows in place (merge gaps go to scratch)
    pack = make_pack(**ALIGNED)
    calls = aio_only(monkeypatch)
    ids, slots = [1, 2, 3, 9, 15, 0], [7, 0, 3, 12, 5, 9]
    with FlashLoader(pack, threads=4, cost=COST, engine="aio") as loader:
        dest = loader.alloc(0, 16)
        stats = loader.read(0, ids, dest, slots)
        if not stats.direct:
            pytest.skip("filesystem refuses O_DIRECT")
        assert stats.zero_copy_reads == stats.reads < len(ids)  # merged across gaps: 0-3, 9, 15
        assert len(calls) == 1 and calls[0].all()
        check_rows(pack, loader, 0, ids, dest, slots)
        d0, d1 = loader.alloc(0, 4), loader.alloc(1, 4)  # several requests in one AIO batch
        loader.read_many([(0, [14, 4], d0, [3, 1]), (1, [8, 9, 10], d1, None)])
        check_rows(pack, loader, 0, [14, 4], d0, [3, 1])
        check_rows(pack, loader, 1, [8, 9, 10], d1, [0, 1, 2])


@pytest.mark.skipif(not aio.available(), reason="Linux native AIO")
def test_checks_run_on_the_calling_thread_once_every_read_is_submitted(make_pack, monkeypatch):
    """While reads wait to be submitted, landed bundles are checked on the finishing threads (the
    submitting thread keeps the queue full); once all are submitted, the calling thread checks
    what lands itself (no hand-over, no wake-up)."""
    import threading

    pack = make_pack(**ALIGNED)
    threads_of_checks, real_check = [], FlashLoader._check_rows

    def check(self, job, members):
        threads_of_checks.append(threading.current_thread().name)
        return real_check(self, job, members)

    monkeypatch.setattr(FlashLoader, "_check_rows", check)
    pipelined_aio(monkeypatch)
    with FlashLoader(pack, threads=2, plan=False, engine="aio") as loader:  # a read per bundle
        ids = list(range(0, 16, 2))  # 8 reads, 2 in flight
        dest = loader.alloc(0, len(ids))
        main = threading.current_thread().name
        finishing = False
        for _ in range(5):  # which thread lands a read first is up to the scheduler: try a few times
            threads_of_checks.clear()
            if not loader.read(0, ids, dest).direct:
                pytest.skip("filesystem refuses O_DIRECT")
            check_rows(pack, loader, 0, ids, dest, list(range(len(ids))))
            assert main in threads_of_checks  # (a finishing thread's check may still end after it)
            assert all(t == main or t.startswith("flash-finish") for t in threads_of_checks)
            finishing = any(t.startswith("flash-finish") for t in threads_of_checks)
            if finishing:
                break
        assert finishing, "no landed bundle was checked on a finishing thread in 5 reads"
        threads_of_checks.clear()
        loader.read(0, [5], dest, [0])  # a single read: checked where it was asked for
        assert threads_of_checks == [main]


@pytest.mark.skipif(not aio.available(), reason="Linux native AIO")
@pytest.mark.parametrize("kwargs,ids", [(dict(dtype="float16", quantize=(4, 32)),
                                         [0, 3, 17, 40, 41, 42, 77, 95]),
                                        (ALIGNED, [0, 3, 4, 5, 9, 11, 14, 15])])
def test_aio_short_and_failed_reads_are_redone(make_pack, monkeypatch, kwargs, ids):
    import ctypes

    pack = make_pack(**kwargs)  # staged reads, then zero-copy vectored reads
    real_read = aio.AioContext.read

    def flaky_read(self, fds, offsets, sizes, addresses, vectored=None, *, on_done=None, more=None,
                   **kw):
        sent = []  # (address, size, vectored) of every read, over all batches

        def record(batch):
            if batch is not None:
                _, _, n, addr, vec = batch
                sent.extend(zip(addr.tolist(), n.tolist(), vec.tolist() if vec is not None
                                else [False] * len(n)))
            return batch

        def spoil(idx, res):  # every third read: short, or EIO; the bytes that landed are wiped
            for k in idx[idx % 3 == 0].tolist():
                addr, n, vec = sent[k]
                pieces = np.ctypeslib.as_array((ctypes.c_uint64 * (2 * n)).from_address(addr)) \
                    .reshape(-1, 2).tolist() if vec else [(addr, n)]
                for base, length in pieces:
                    ctypes.memset(base, 0, length)
                res[k] = 512 if k % 4 == 0 else -errno.EIO
            on_done(idx, res)
        record((fds, offsets, sizes, addresses, vectored))
        return real_read(self, fds, offsets, sizes, addresses, vectored, on_done=spoil,
                         more=more and (lambda: record(more())), **kw)

    monkeypatch.setattr(aio.AioContext, "read", flaky_read)
    pipelined_aio(monkeypatch)
    with FlashLoader(pack, threads=4, cost=ReadCost(0.0, 1e9), engine="aio") as loader:
        d = loader.alloc(0, len(ids))
        stats = loader.read(0, ids, d)
        if not stats.direct:
            pytest.skip("filesystem refuses O_DIRECT")
        assert stats.reads >= 2  # some spoiled, some not
        check_rows(pack, loader, 0, ids, d, list(range(len(ids))))
        d0, d1 = loader.alloc(0, len(ids)), loader.alloc(1, len(ids))  # the second request's
        loader.read_many([(0, ids, d0, None), (1, ids[::-1], d1, None)])  # reads: a later batch
        check_rows(pack, loader, 0, ids, d0, list(range(len(ids))))
        check_rows(pack, loader, 1, ids[::-1], d1, list(range(len(ids))))
        # and when the careful re-read fails too, the error names the file and offset
        monkeypatch.setattr(FileLayer, "preadv", lambda self, fd, b, o: (_ for _ in ()).throw(
            OSError(errno.EIO, "Input/output error")))
        with pytest.raises(FlashError, match=r"layer_001\.bin: read error at offset \d+"):
            loader.read(1, ids, loader.alloc(1, len(ids)))


@pytest.mark.skipif(aio.read_loop_kernel is None, reason="the kernels' AIO loop (mlx_flash._ext, Linux)")
@pytest.mark.parametrize("kwargs,ids", [(dict(dtype="float16", quantize=(4, 32)),
                                         [0, 3, 17, 40, 41, 42, 77, 95]),
                                        (ALIGNED, [0, 3, 4, 5, 9, 11, 14, 15])])
def test_small_calls_read_at_once_and_redo_short_and_failed_reads(make_pack, monkeypatch, kwargs, ids):
    """A call of at most STAGED_BATCH bytes goes to the kernels' loop in one AioContext.read_all
    (never the pipelined read); its reads that come back short or failed (bytes wiped) are redone,
    and every bundle lands checked, staged (first pack) or zero copy (second)."""
    import ctypes

    pack = make_pack(**kwargs)
    real_read_all, spoiled = aio.AioContext.read_all, []

    def flaky_read_all(self, fds, offsets, sizes, addresses, vectored=None, landed=None):
        res = real_read_all(self, fds, offsets, sizes, addresses, vectored, landed)
        for k in range(0, len(res), 3):  # every third read: short, or EIO; its bytes are wiped
            vec = vectored is not None and vectored[k]
            pieces = np.ctypeslib.as_array((ctypes.c_uint64 * (2 * int(sizes[k]))).from_address(
                int(addresses[k]))).reshape(-1, 2).tolist() if vec else [(int(addresses[k]), int(sizes[k]))]
            for base, length in pieces:
                ctypes.memset(base, 0, length)
            res[k] = 512 if k % 2 else -errno.EIO
            spoiled.append(k)
        return res

    monkeypatch.setattr(aio.AioContext, "read_all", flaky_read_all)
    monkeypatch.setattr(aio.AioContext, "read", lambda *a, **k: pytest.fail("a small call was pipelined"))
    monkeypatch.setattr(aio, "read_staged_kernel", None)  # its own test below
    with FlashLoader(pack, threads=4, cost=ReadCost(0.0, 1e9), engine="aio") as loader:
        d = loader.alloc(0, len(ids))
        stats = loader.read(0, ids, d)
        if not stats.direct:
            pytest.skip("filesystem refuses O_DIRECT")
        assert stats.reads >= 2 and spoiled  # some spoiled, some not
        check_rows(pack, loader, 0, ids, d, list(range(len(ids))))
        d0, d1 = loader.alloc(0, len(ids)), loader.alloc(1, len(ids))  # two requests in one call
        loader.read_many([(0, ids, d0, None), (1, ids[::-1], d1, None)])
        check_rows(pack, loader, 0, ids, d0, list(range(len(ids))))
        check_rows(pack, loader, 1, ids[::-1], d1, list(range(len(ids))))


@pytest.mark.skipif(aio.read_staged_kernel is None, reason="the kernels' aio_read_staged (mlx_flash._ext, Linux)")
def test_a_staged_call_is_read_checked_and_copied_in_one_kernel_call(make_pack, monkeypatch):
    """A small staged call of one request (a decode token's) is one aio_read_staged call: no
    read_all, the rows land checked. When some of its reads come back short or failed (their
    staged bytes wiped, every destination row wiped too), the loader redoes them and copies every
    bundle out again; a bundle whose bytes differ from its crc32 names the file."""
    import ctypes

    pack = make_pack(dtype="float16", quantize=(4, 32))
    ids = [0, 3, 17, 40, 41, 42, 77, 95]
    real, spoiled, calls = aio.read_staged_kernel, [], []

    def flaky(ctx, fd, r0, r1, pos, first, starts, bundle_ids, table, flat, p_off, p_len, targets, slots,
              depth, spin_ns, waits, res, crcs):
        out = real(ctx, fd, r0, r1, pos, first, starts, bundle_ids, table, flat, p_off, p_len, targets, slots,
                   depth, spin_ns, waits, res, crcs)
        calls.append(len(r0))
        if not spoil:
            return out
        for k in range(0, len(r0), 3):  # every third read: short, or EIO; its staged bytes wiped
            ctypes.memset(flat.ctypes.data + int(pos[k]), 0, int(r1[k] - r0[k]))
            res[k] = 512 if k % 2 else -errno.EIO
            spoiled.append(k)
        for _, _, rows in targets:
            rows[slots] = 0
        return len(range(0, len(r0), 3)), -1

    monkeypatch.setattr(aio, "read_staged_kernel", flaky)
    monkeypatch.setattr(aio.AioContext, "read_all", lambda *a, **k: pytest.fail("read_all in a staged call"))
    with FlashLoader(pack, threads=4, cost=ReadCost(0.0, 1e9), engine="aio") as loader:
        spoil = False
        d = loader.alloc(0, len(ids))
        stats = loader.read(0, ids, d, list(range(len(ids)))[::-1])
        if not stats.direct:
            pytest.skip("filesystem refuses O_DIRECT")
        assert calls == [stats.reads] and stats.reads >= 2
        check_rows(pack, loader, 0, ids, d, list(range(len(ids)))[::-1])
        spoil = True
        d = loader.alloc(1, len(ids))
        loader.read(1, ids, d)
        assert spoiled and len(calls) == 2
        check_rows(pack, loader, 1, ids, d, list(range(len(ids))))
    entry = read_manifest(pack)["bundles"][0]
    path = pack / entry["file"]
    data = bytearray(path.read_bytes())
    data[entry["offset"] + 41 * entry["stride"] + 5] ^= 0x10
    path.write_bytes(bytes(data))
    spoil = False
    with FlashLoader(pack, threads=4, cost=ReadCost(0.0, 1e9), engine="aio") as loader:
        with pytest.raises(FlashError, match=r"layer_000\.bin: checksum mismatch in bundle 41"):
            loader.read(0, ids, loader.alloc(0, len(ids)))
    assert len(calls) == 3


@pytest.mark.skipif(aio.read_ids_kernel is None, reason="the kernels' aio_read_ids (mlx_flash._ext, Linux)")
@pytest.mark.parametrize("verify", [True, False])
def test_read_at_once_lands_what_read_lands_in_one_kernel_call(make_pack, monkeypatch, verify):
    """read_at_once (a decode call: plan, reads, crc32 checks and copy out in one aio_read_ids
    call) lands the rows `read` lands, counted the same, for ids in any order to any rows; no
    other read path runs. Over `max_bytes` it reads nothing and says so (None); reads that come
    back short or failed are redone by `read`."""
    import ctypes

    pack = make_pack(dtype="float16", quantize=(4, 32), layers=2)
    real, calls, spoil = aio.read_ids_kernel, [], [False]

    def counted(ctx, fd, count, offset, stride, align, merge, gap, max_read, ids, slots, table, flat, p_off,
                p_len, targets, depth, spin_ns, waits, plan, res, crcs):
        out = real(ctx, fd, count, offset, stride, align, merge, gap, max_read, ids, slots, table, flat, p_off,
                   p_len, targets, depth, spin_ns, waits, plan, res, crcs)
        calls.append((out, table is not None))
        if not spoil[0] or not out[2]:
            return out
        ctypes.memset(flat.ctypes.data, 0, int(out[1]))  # every read short: staged bytes and rows wiped
        for _, _, rows in targets:
            rows[slots] = 0
        return out[0], out[1], out[2], out[0], -1

    monkeypatch.setattr(aio, "read_ids_kernel", counted)
    rng = np.random.default_rng(3)
    with FlashLoader(pack, threads=4, cost=COST, engine="aio", verify=verify) as loader:
        n = loader.entry(0).count
        for trial in range(6):
            ids = rng.choice(n, size=int(rng.integers(1, n)), replace=False)
            slots = rng.choice(n, size=len(ids), replace=False)
            monkeypatch.setattr(aio, "read_staged_kernel", None)  # `read` below: not the kernel under test
            want_rows = loader.alloc(0, n)
            want = loader.read(0, ids, want_rows, slots)
            if not want.direct:
                pytest.skip("filesystem refuses O_DIRECT")
            monkeypatch.setattr(aio.AioContext, "read_all", lambda *a, **k: pytest.fail("not one kernel call"))
            monkeypatch.setattr(aio.AioContext, "read", lambda *a, **k: pytest.fail("not one kernel call"))
            got_rows = loader.alloc(0, n)
            got = loader.read_at_once(0, ids, got_rows, slots)
            monkeypatch.undo()
            monkeypatch.setattr(aio, "read_ids_kernel", counted)
            assert got is not None and calls[-1][1] == verify
            check_rows(pack, loader, 0, ids, got_rows, slots)
            assert (got.bundles, got.reads, got.bytes_read, got.bytes_useful, got.read_sizes, got.direct) == \
                (want.bundles, want.reads, want.bytes_read, want.bytes_useful, want.read_sizes, want.direct)
        ids = np.arange(0, n, 2)
        untouched = loader.alloc(1, n)
        assert loader.read_at_once(1, ids, untouched, max_bytes=4096 * 2) is None
        assert not any(np.asarray(a).any() for a in untouched.values())  # nothing read
        spoil[0] = True
        rows = loader.alloc(1, n)
        assert loader.read_at_once(1, ids, rows) is not None  # short: redone by `read`
        check_rows(pack, loader, 1, ids, rows, list(range(len(ids))))
    with FlashLoader(pack, threads=4, cost=COST, engine="threads") as loader:
        assert loader.read_at_once(0, [1, 2], loader.alloc(0, 2)) is None


@pytest.mark.skipif(aio.read_ids_kernel is None, reason="the kernels' aio_read_ids (mlx_flash._ext, Linux)")
def test_read_at_once_refuses_bad_ids_and_corrupt_bundles_like_read(make_pack):
    """A bundle whose bytes fail their crc32, an id outside the layer, a repeated id: read_at_once
    raises what `read` raises (naming the file); a layout `read` lands zero copy is left to it."""
    pack = make_pack(dtype="float16")
    corrupt_bundle(pack, 7)
    with FlashLoader(pack, threads=2, cost=COST, engine="aio") as loader:
        dest = loader.alloc(0, 4)
        if loader.read_at_once(0, [5, 6, 8], dest) is None:
            pytest.skip("filesystem refuses O_DIRECT")
        with pytest.raises(FlashError, match=r"layer_000\.bin: checksum mismatch in bundle 7 "):
            loader.read_at_once(0, [6, 7, 8], dest)
        with pytest.raises(FlashError, match=r"layer_000\.bin: bundle id out of range"):
            loader.read_at_once(0, [6, loader.entry(0).count], dest)
        with pytest.raises(FlashError, match=r"layer_000\.bin: duplicate bundle ids"):
            loader.read_at_once(0, [6, 2, 6], dest)
    aligned = make_pack("aligned", dtype="float32", hidden=1024, intermediate=16, layers=1, vocab=16)
    with FlashLoader(aligned, threads=2, cost=COST) as loader:
        assert loader.read_at_once(0, [1, 2], loader.alloc_raw(0, 2)) is None


@pytest.mark.skipif(aio.read_loop_kernel is None, reason="the kernels' AIO loop (mlx_flash._ext, Linux)")
def test_only_the_main_thread_spins_in_its_aio_waits(make_pack, monkeypatch):
    """The calling thread's AIO context spins before it sleeps (aio.spin_ns); a reader thread's
    (prefetch, expert preload: they read while the main thread computes) blocks at once."""
    import threading

    monkeypatch.setenv("MLX_FLASH_AIO_SPIN_US", "300")
    pack = make_pack(dtype="float16")
    with FlashLoader(pack, threads=4, cost=ReadCost(0.0, 1e9), engine="aio") as loader:
        stats = loader.read(0, [1, 5, 9], loader.alloc(0, 3))
        if not stats.direct:
            pytest.skip("filesystem refuses O_DIRECT")
        reader = threading.Thread(target=lambda: loader.read(1, [2, 3], loader.alloc(1, 2)))
        reader.start()
        reader.join()
        assert [c.spin_ns for c in loader._aio_contexts] == [300_000, 0]


def test_truncated_bundle_file_is_refused(make_pack):
    pack = make_pack()
    entry = read_manifest(pack)["bundles"][0]
    os.truncate(pack / entry["file"], 4096)
    with pytest.raises(FlashError, match=r"layer_000\.bin: truncated \(4096 bytes"):  # before any read
        FlashLoader(pack, threads=2, cost=COST)


@pytest.mark.parametrize("raw", [False, True])
def test_checksum_mismatch_is_caught(make_pack, raw):
    pack = make_pack(dtype="float16")
    corrupt_bundle(pack, 7)
    with FlashLoader(pack, threads=2, cost=COST) as loader:
        dest = loader.alloc_raw(0, 3) if raw else loader.alloc(0, 3)
        loader.read(0, [5, 6, 8], dest)  # neighbours are fine
        with pytest.raises(FlashError, match=r"layer_000\.bin: checksum mismatch in bundle 7 "):
            loader.read(0, [6, 7, 8], dest)
    with FlashLoader(pack, threads=2, cost=COST, verify=False) as loader:
        loader.read(0, [7], loader.alloc(0, 1))  # verification is what caught it


@pytest.mark.parametrize("kernels", [True, False])
def test_checksum_of_staged_bundles_with_padding_between_components(make_pack, monkeypatch, kernels):
    # 4-bit group-32 rows of 96 with float16 scales: 6-byte scales/biases, each component at a
    # 4-byte boundary, so the bundle's crc32 chains over pieces and skips the padding
    import mlx_flash.io.loader as loader_module

    if not kernels:
        monkeypatch.setattr(loader_module, "crc32_ranges", None)
    pack = make_pack(quantize=(4, 32), dtype="float16", hidden=96)
    entry = read_manifest(pack)["bundles"][0]
    pieces = [(c["offset"], c["length"]) for c in entry["components"]]
    assert any(o != sum(n for _, n in pieces[:i]) for i, (o, _) in enumerate(pieces))  # not tight
    path = pack / entry["file"]
    original = path.read_bytes()
    pad = pieces[1][0] + pieces[1][1]  # the byte after the first scales: padding
    assert pad < pieces[2][0]
    for at, caught in ((entry["offset"] + 7 * entry["stride"] + pad, False),
                       (entry["offset"] + 7 * entry["stride"] + pieces[-1][0] + 3, True)):
        data = bytearray(original)
        data[at] ^= 0x40
        path.write_bytes(bytes(data))
        with FlashLoader(pack, threads=2, cost=COST) as loader:
            dest = loader.alloc(0, 3)
            loader.read(0, [5, 6, 8], dest)  # neighbours are fine
            if caught:
                with pytest.raises(FlashError, match=r"layer_000\.bin: checksum mismatch in bundle 7 "):
                    loader.read(0, [6, 7, 8], dest)
            else:
                loader.read(0, [6, 7, 8], dest)


def test_other_format_version_is_refused(make_pack):
    pack = make_pack()
    m = json.loads((pack / "manifest.json").read_text())
    m["format_version"] = 3  # 1 dense, 2 ENDOR
    (pack / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(FlashError, match="manifest.json: pack format version 3"):
        FlashLoader(pack, cost=COST)


def test_bad_requests(make_pack):
    pack = make_pack()
    with FlashLoader(pack, threads=2, cost=COST) as loader:
        d = loader.alloc(0, 2)
        for ids, slots, match in (([96], None, "out of range"), ([1, 1], None, "duplicate"),
                                  ([1], [2], "slot out of range")):
            with pytest.raises(FlashError, match=match):
                loader.read(0, ids, d, slots)
        with pytest.raises(FlashError, match="no bundle file for layer 7"):
            loader.read(7, [0], d)
        with pytest.raises(FlashError, match="use FlashLoader.alloc"):
            loader.read(0, [0], {"up.weight": d["up.weight"]})


@pytest.mark.parametrize("encoding", ["dense", "endor"])
def test_read_plans_land_the_same_bytes_planned_once(make_pack, tiny_llama, tmp_path, monkeypatch, encoding):
    """loader.plan + read(plan) (and pieces of a plan, ReadPlan.take) fill the same rows as
    read(ids), and a read given a plan does not plan again."""
    if encoding == "endor":
        from test_calibration_prune import pruned_model

        src, _ = pruned_model(tiny_llama, tmp_path, intermediate=128)
        pack, layer = write_pack(src, tmp_path / "endor", encoding="endor", progress=False), 1
    else:
        pack, layer = make_pack(dtype="float16", quantize=(4, 32), intermediate=128), 0
    rng = np.random.default_rng(1)
    with FlashLoader(pack, threads=4, cost=COST, max_read=16384) as loader:
        ids = rng.choice(128, size=50, replace=False)
        slots = rng.permutation(64)[:50]
        plan = loader.plan(layer, ids)
        assert np.array_equal(plan.ids, np.sort(ids)) and np.array_equal(ids[plan.index], plan.ids)
        assert len(plan.r0) < len(ids)  # neighbours merged
        plans = []
        for name in ("plan_read_arrays", "plan_strided"):  # ENDOR layers / plain layers
            real = getattr(loader_module, name)
            monkeypatch.setattr(loader_module, name, lambda *a, real=real, **k: plans.append(1) or real(*a, **k))
        dest = loader.alloc(layer, 64)
        stats = loader.read(layer, plan, dest, slots[plan.index])
        assert plans == [] and stats.reads == len(plan.r0) and stats.bundles == 50
        check_rows(pack, loader, layer, ids, dest, slots)
        dest = loader.alloc(layer, 64)
        cuts = [0, 7, 8, 23, 50]  # pieces cutting merged reads: each read covers its own bundles
        for lo, hi in zip(cuts, cuts[1:]):
            piece = plan.take(lo, hi)
            assert np.array_equal(piece.ids, plan.ids[lo:hi])
            end = piece.starts[-1] + piece.lengths[-1]  # a cut read covers only this piece's bundles
            a = plan.align
            assert piece.r0[0] == piece.starts[0] // a * a and piece.r1[-1] == -(-end // a) * a
            loader.read(layer, piece, dest, slots[piece.index])
        assert plans == []
        check_rows(pack, loader, layer, ids, dest, slots)
        loader.read(layer, ids, dest, slots)  # ids: planned here
        assert plans == [1]
        with pytest.raises(FlashError, match=f"a read plan of layer {layer}"):
            loader.read(1 - layer, plan, loader.alloc(1 - layer, 64))
        with pytest.raises(FlashError, match="50 bundle ids but 3 slots"):
            loader.read(layer, plan, dest, [0, 1, 2])


def test_expert_blocks_and_biased_neurons_through_the_loader(tmp_path):
    # MoE layers: one contiguous block per expert; OPT-style FFN: up row + down column + up bias
    from conftest import write_tiny_opt

    rng = np.random.default_rng(0)
    hidden, inter, experts = 32, 48, 6
    moe = {"model.layers.0.mlp.gate.weight": rng.standard_normal((experts, hidden)),
           "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((hidden, hidden))}
    for role, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
        moe[f"model.layers.0.mlp.switch_mlp.{role}_proj.weight"] = rng.standard_normal((experts, *shape))
    src = tmp_path / "moe"
    src.mkdir()
    mx.save_safetensors(str(src / "model.safetensors"),
                        {k: mx.array(v.astype(np.float16)) for k, v in moe.items()})
    (src / "config.json").write_text(json.dumps({"model_type": "qwen2_moe"}))
    packs = {"moe": write_pack(src, tmp_path / "moe.pack", progress=False),
             "opt": write_pack(write_tiny_opt(tmp_path / "opt"), tmp_path / "opt.pack", progress=False)}
    for name, pack in packs.items():
        entry = read_manifest(pack)["bundles"][0]
        assert entry["kind"] == ("experts" if name == "moe" else "neurons")
        ids = [5, 0, 3] if name == "moe" else [127, 0, 64, 1]
        for direct in (True, False):
            with FlashLoader(pack, threads=2, direct=direct, cost=COST) as loader:
                dest = loader.alloc(0, len(ids))
                assert loader.read(0, ids, dest).bundles == len(ids)
                check_rows(pack, loader, 0, ids, dest, list(range(len(ids))))
        if name == "moe":  # each expert's block equals the source expert's matrices
            w = moe["model.layers.0.mlp.switch_mlp.up_proj.weight"].astype(np.float16)
            assert np.array_equal(np.array(dest["up.weight"]), w[ids])


# ---- read-only packs ----

def snapshot(root):
    """{relative path: (size, mtime_ns)} of everything under root, hidden files included."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            out[os.path.relpath(p, root)] = (st.st_size, st.st_mtime_ns)
    return out


@contextlib.contextmanager
def read_only(pack, tmp_path):
    """The pack where writing fails: a read-only bind mount as root (chmod does not stop root),
    else the pack with every write permission removed."""
    if os.geteuid() == 0:
        view = tmp_path / "ro-view"
        view.mkdir()
        ok = subprocess.run(["mount", "--bind", str(pack), str(view)], capture_output=True).returncode == 0
        if ok and subprocess.run(["mount", "-o", "remount,ro,bind", str(view)],
                                 capture_output=True).returncode == 0:
            try:
                yield view
            finally:
                subprocess.run(["umount", str(view)], check=True)
            return
        if ok:
            subprocess.run(["umount", str(view)], check=True)
    modes = {p: p.stat().st_mode for p in [pack, *pack.rglob("*")]}
    for p, m in modes.items():
        p.chmod(m & ~0o222)
    try:
        yield pack
    finally:
        for p, m in modes.items():
            p.chmod(m)


def test_read_only_pack_runs_and_nothing_is_written_into_it(tiny_llama, tmp_path, monkeypatch):
    """The pack is big enough to measure (threshold lowered): the profile is measured by reading
    the pack's bundle files and stored in the cache home."""
    monkeypatch.setenv("MLX_FLASH_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(loader_module, "CALIBRATION_MIN_BYTES", 1 << 20)
    src = tiny_llama("src", hidden=256, intermediate=512, layers=2)
    pack = write_pack(src, tmp_path / "pack", progress=False)
    before = snapshot(pack)
    with read_only(pack, tmp_path) as view:
        with pytest.raises(OSError):
            (view / "probe").write_text("x")
        model = build_flash_model(view, FlashConfig("naive"))
        import mlx.core as mx

        mx.eval(model(mx.array([[1, 2, 3]])))
        first_bundle = view / "bundles" / "layer_000.bin"
        assert load_cost(first_bundle, 32, model.flash_runtime.loader.cost_engine()) is not None
        model.flash_runtime.loader.close()
    assert snapshot(pack) == before
    assert (tmp_path / "home" / "io_profile.json").is_file()


def test_small_pack_is_measured_in_the_cache_home(tiny_llama, tmp_path, monkeypatch):
    """Bundle files too small to measure in place: a scratch file in the cache home (on the pack's
    device here), never in the pack."""
    monkeypatch.setenv("MLX_FLASH_HOME", str(tmp_path / "home"))
    pack = write_pack(tiny_llama("src"), tmp_path / "pack", progress=False)
    before = snapshot(pack)
    model = build_flash_model(pack, FlashConfig("naive"))
    assert model.flash_runtime.loader.cost is not None
    assert snapshot(pack) == before and (tmp_path / "home" / "io_profile.json").is_file()
    assert not [p for p in (tmp_path / "home").iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("quantize", [None, 8])
@pytest.mark.parametrize("direct,plan", [(True, True), (True, False), (False, True)])
def test_endor_random_subsets_decode_to_the_layer_rows(tiny_llama, tmp_path, quantize, direct, plan):
    from test_calibration_prune import pruned_model

    src, _ = pruned_model(tiny_llama, tmp_path, intermediate=128)
    pack = write_pack(src, tmp_path / "endor", quantize=quantize, encoding="endor", progress=False)
    rng = np.random.default_rng(0)
    with FlashLoader(pack, threads=4, direct=direct, plan=plan, cost=COST) as loader:
        dest = loader.alloc(1, 128)
        for _ in range(3):
            ids = rng.choice(128, size=rng.integers(1, 40), replace=False)
            slots = rng.choice(128, size=len(ids), replace=False)
            stats = loader.read(1, ids, dest, slots)
            check_rows(pack, loader, 1, ids, dest, slots)
            index = loader._open_files[1].index
            assert stats.bytes_useful == int((index[ids + 1] - index[ids]).sum())
            assert stats.bytes_read >= stats.bytes_useful
        with pytest.raises(FlashError, match="ENDOR-encoded"):
            loader.alloc_raw(1, 4)


@pytest.mark.parametrize("direct", [True, False])
def test_endor_read_encoded_holds_the_bundles_as_stored(tiny_llama, tmp_path, direct):
    """read_encoded: the layer's bundles byte for byte (they decode to what read() decodes), the
    buffer reused, each bundle's crc32 checked, a dense layer refused."""
    from test_calibration_prune import pruned_model

    from mlx_flash.pack.bitmap import decode_bundles
    from mlx_flash.pack.reader import endor_roles

    src, _ = pruned_model(tiny_llama, tmp_path, intermediate=128)
    pack = write_pack(src, tmp_path / "endor", encoding="endor", progress=False)
    with FlashLoader(pack, threads=4, direct=direct, cost=COST, max_read=8192) as loader:
        words, offsets, stats = loader.read_encoded(1)
        entry = loader.entry(1)
        assert stats.bytes_useful == entry.length and stats.reads > 1 and offsets[-1] - offsets[0] == entry.length
        dest = {c.name: np.zeros((128, c.length), np.uint8) for c in entry.components}
        decode_bundles(np.array(words).view(np.uint8), offsets[:-1], np.diff(offsets), np.arange(128),
                       endor_roles(entry, dest))
        want = loader.alloc(1, 128)
        loader.read(1, np.arange(128), want)
        for c in entry.components:
            assert np.array_equal(dest[c.name], np.array(want[c.name]).view(np.uint8).reshape(128, -1))
        again, offsets0, _ = loader.read_encoded(0, words)
        e0 = loader.entry(0)
        stored = np.fromfile(pack / e0.file, np.uint8)[e0.offset: e0.offset + e0.length]
        assert again is words and np.array_equal(np.array(again).view(np.uint8)[offsets0[0]: offsets0[-1]], stored)
    path = pack / entry.file
    raw = bytearray(path.read_bytes())
    raw[int(entry.offset) + int(offsets[5] - offsets[0]) + 1] ^= 0xFF
    path.write_bytes(bytes(raw))
    with FlashLoader(pack, threads=2, direct=direct, cost=COST) as loader:
        with pytest.raises(FlashError, match="checksum mismatch in bundle 5"):
            loader.read_encoded(1)
    dense = write_pack(tiny_llama("plain"), tmp_path / "plain-pack", progress=False)
    with FlashLoader(dense, threads=2, cost=COST) as loader:
        with pytest.raises(FlashError, match="not ENDOR-encoded"):
            loader.read_encoded(0)


@pytest.mark.skipif(not aio.available(), reason="Linux native AIO")
def test_endor_bundles_decode_as_their_reads_land(tiny_llama, tmp_path, monkeypatch):
    """ENDOR bundles are checked and decoded batch by batch while later reads are in flight; a
    short or failed read is redone before its bundles are decoded (its staging bytes are wiped
    here, so decoding them early would fail the crc32 check)."""
    import ctypes

    from test_calibration_prune import pruned_model

    src, _ = pruned_model(tiny_llama, tmp_path, intermediate=128)
    pack = write_pack(src, tmp_path / "endor", encoding="endor", progress=False)
    real_read = aio.AioContext.read

    def flaky_read(self, fds, offsets, sizes, addresses, vectored=None, *, on_done=None, **kw):
        assert vectored is None or not vectored.any()  # ENDOR bundles are staged, then decoded
        def spoil(idx, res):  # one request: one batch, so idx indexes this batch's arrays
            for k in idx[::3].tolist():
                ctypes.memset(int(addresses[k]), 0, int(sizes[k]))
                res[k] = -errno.EIO
            on_done(idx, res)
        return real_read(self, fds, offsets, sizes, addresses, vectored, on_done=spoil, **kw)

    monkeypatch.setattr(aio.AioContext, "read", flaky_read)
    pipelined_aio(monkeypatch)
    batches = []
    real_decode = FlashLoader._decode
    monkeypatch.setattr(FlashLoader, "_decode", lambda self, job, flat, members=None: (
        batches.append(len(job.ids) if members is None else len(members)), real_decode(self, job, flat, members)))
    with FlashLoader(pack, threads=4, plan=False, engine="aio") as loader:
        ids = np.arange(0, 128, 3)
        dest = loader.alloc(1, len(ids))
        stats = loader.read(1, ids, dest)
        if not stats.direct:
            pytest.skip("filesystem refuses O_DIRECT")
        check_rows(pack, loader, 1, ids, dest, np.arange(len(ids)))
        assert stats.reads > 4 and len(batches) > 2 and sum(batches) == len(ids)


@pytest.mark.parametrize("engine", ["aio", "threads"])
def test_endor_corrupt_bundle_fails_its_crc32(tiny_llama, tmp_path, engine):
    from test_calibration_prune import pruned_model

    src, _ = pruned_model(tiny_llama, tmp_path, intermediate=128)
    pack = write_pack(src, tmp_path / "endor", encoding="endor", progress=False)
    entry = read_manifest(pack).bundles[1]
    data = bytearray((pack / entry.file).read_bytes())
    data[int(read_bundle_index(pack / entry.file, entry)[41]) - 1] ^= 0x10  # bundle 40's last byte
    (pack / entry.file).write_bytes(bytes(data))
    with FlashLoader(pack, threads=4, cost=COST, engine=engine) as loader:
        with pytest.raises(FlashError, match=r"layer_001\.bin: checksum mismatch in bundle 40 \(offset"):
            loader.read(1, np.arange(128), loader.alloc(1, 128))
        with FlashLoader(pack, threads=4, cost=COST, engine=engine, verify=False) as unchecked:
            unchecked.read(1, np.arange(128), unchecked.alloc(1, 128))  # the bundle still decodes


def test_crc32_equals_zlib():
    import zlib

    rng = np.random.default_rng(0)
    for n in (0, 1, 7, 4096, 100_003):
        data = rng.integers(0, 256, n, dtype=np.uint8)
        assert loader_module.crc32(data) == zlib.crc32(data)
        assert loader_module.crc32(data[n // 3:], 12345) == zlib.crc32(data[n // 3:], 12345)


@pytest.mark.skipif(loader_module.crc32_ranges is None, reason="the kernels' crc32_ranges")
def test_crc32_ranges_chain_like_zlib():
    """crc32_ranges: each range's crc32 chained on the crc passed in (a bundle's components held
    in separate arrays, one call per array); ranges outside the buffer are refused."""
    import zlib

    rng = np.random.default_rng(1)
    a, b = rng.integers(0, 256, (2, 50, 300), dtype=np.uint8)
    rows = np.array([3, 0, 49, 17])
    crcs = np.zeros(len(rows), np.uint32)
    loader_module.crc32_ranges(a.reshape(-1), rows * 300, 300, crcs)
    loader_module.crc32_ranges(b.reshape(-1), rows * 300 + 10, 200, crcs)
    assert crcs.tolist() == [zlib.crc32(b[r, 10:210], zlib.crc32(a[r])) for r in rows]
    with pytest.raises(ValueError, match="outside"):
        loader_module.crc32_ranges(a.reshape(-1), np.array([49 * 300 + 1]), 300, np.zeros(1, np.uint32))


@pytest.mark.skipif(not aio.available(), reason="Linux native AIO")
def test_expert_blocks_are_zero_copy_vectored_reads_into_the_slot_bank(tmp_path, monkeypatch):
    # float32 experts of 64 x 64: every component is 16 KiB, so a block lands in the bank's rows
    # in place: one vectored AIO read per run of neighbouring experts, none through staging
    from conftest import write_tiny_moe

    pack = write_pack(write_tiny_moe(tmp_path / "moe", "olmoe", hidden=64, expert_ffn=64,
                                     experts=8, layers=1), tmp_path / "moe.pack", progress=False)
    layer = next(b.layer for b in read_manifest(pack).bundles if b.kind == "experts")
    calls = aio_only(monkeypatch)
    with FlashLoader(pack, threads=4, cost=ReadCost(0.0, 1e9), engine="aio") as loader:
        bank = loader.alloc(layer, 5)
        stats = loader.read(layer, [6, 1, 2, 4], bank, [0, 4, 2, 3])
        if not stats.direct:
            pytest.skip("filesystem refuses O_DIRECT")
        assert stats.reads == 3 and stats.zero_copy_reads == 3  # experts 1-2 touch: one read
        assert len(calls) == 1 and calls[0].all()
        check_rows(pack, loader, layer, [6, 1, 2, 4], bank, [0, 4, 2, 3])


@pytest.mark.skipif(not aio.available(), reason="Linux native AIO")
@pytest.mark.parametrize("staged", [False, True])
def test_zero_copy_rows_are_checked_as_their_reads_land(make_pack, staged):
    # staged: the same aligned bundles, landed in staging because the cost model prices their
    # segments (1 ms each) above the copy; the check is the same
    cost = ReadCost(0.0, 1e9, 1e-3, 1e9) if staged else ReadCost(0.0, 1e9)
    pack = make_pack(**ALIGNED)
    entry = read_manifest(pack)["bundles"][0]
    path = pack / entry["file"]
    data = bytearray(path.read_bytes())
    data[entry["offset"] + 7 * entry["stride"] + 5000] ^= 0x01  # bundle 7's up row
    path.write_bytes(bytes(data))
    with FlashLoader(pack, threads=4, cost=cost, engine="aio") as loader:
        dest = loader.alloc(0, 4)
        stats = loader.read(0, [2, 4, 9, 12], dest)
        if not stats.direct:
            pytest.skip("filesystem refuses O_DIRECT")
        assert (stats.bounced_reads if staged else stats.zero_copy_reads) == stats.reads == 4
        with pytest.raises(FlashError, match=r"layer_000\.bin: checksum mismatch in bundle 7 "):
            loader.read(0, [1, 7, 13], dest)


@pytest.mark.parametrize("engine", ["aio", "threads"])
def test_reads_are_staged_when_the_cost_model_prices_segments_above_the_copy(make_pack, engine):
    """A zero-copy read lands each bundle's gate / up / down rows as three segments in three
    arrays; when the cost model says copying a read's bytes out of staging takes less than its
    extra segments, the read lands contiguously in staging instead; the same rows either way."""
    pack = make_pack(**ALIGNED)
    if engine == "aio" and not aio.available():
        pytest.skip("Linux native AIO")
    ids, slots = [1, 2, 3, 9, 15, 0], [7, 0, 3, 12, 5, 9]
    # 12 KiB bundles: copying one (12 us at 1 GB/s) vs its 2 extra segments (2 ms, or 2 ns)
    for cost, staged in ((ReadCost(0.0, 1e9, segment_s=1e-3, copy_bandwidth=1e9), True),
                         (ReadCost(0.0, 1e9, segment_s=1e-9, copy_bandwidth=1e9), False),
                         (ReadCost(0.0, 1e9, segment_s=1e-3), False)):  # copy unmeasured: zero copy
        with FlashLoader(pack, threads=4, cost=cost, engine=engine) as loader:
            dest = loader.alloc(0, 16)
            stats = loader.read(0, ids, dest, slots)
            if not stats.direct:
                pytest.skip("filesystem refuses O_DIRECT")
            assert stats.reads == 3  # touching bundles merged: 0-3, 9, 15
            assert (stats.bounced_reads, stats.zero_copy_reads) == ((3, 0) if staged else (0, 3))
            check_rows(pack, loader, 0, ids, dest, slots)
            # whole bundles into consecutive rows: one segment per read, nothing to save
            raw = loader.alloc_raw(0, 3)
            assert loader.read(0, [4, 5, 6], raw).zero_copy_reads == 1
            check_rows(pack, loader, 0, [4, 5, 6], raw, [0, 1, 2])



@pytest.mark.skipif(not aio.available(), reason="Linux native AIO")
def test_staged_bundles_are_copied_out_in_batches_as_their_reads_land(make_pack, monkeypatch):
    """Staged AIO reads are checked and copied out once STAGED_BATCH bytes of them have landed,
    not after the request's last read: every bundle once, the last batch small; the rows are the
    file's."""
    pack = make_pack(**{**ALIGNED, "intermediate": 64})
    batches = []
    real = FlashLoader._scatter

    def spy(self, job, flat, members=None):
        batches.append(len(job.ids) if members is None else len(members))
        return real(self, job, flat, members)

    monkeypatch.setattr(FlashLoader, "_scatter", spy)
    monkeypatch.setattr(loader_module, "STAGED_BATCH", 2 * 12288)  # two 12 KiB bundles
    ids = np.arange(0, 32, 2)  # 16 one-bundle reads (no neighbours to merge)
    with FlashLoader(pack, threads=2, cost=ReadCost(0.0, 1e9, 1e-3, 1e9), engine="aio") as loader:
        dest = loader.alloc(0, 16)
        stats = loader.read(0, ids, dest)
        if not stats.direct:
            pytest.skip("filesystem refuses O_DIRECT")
        assert stats.bounced_reads == stats.reads == 16
        assert sum(batches) == 16 and len(batches) >= 4 and max(batches) <= 8
        check_rows(pack, loader, 0, ids, dest, np.arange(16))
