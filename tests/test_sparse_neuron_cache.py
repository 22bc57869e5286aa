"""Neuron cache (paper section 3.3) under random activation sequences, on a real tiny pack."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_flash.io import FlashLoader, host_bytes
from mlx_flash.pack import write_pack
from mlx_flash.sparse.neuron_cache import NeuronCache, cache_update_kernel

N = 96  # neurons per layer of the tiny model


@pytest.fixture(scope="module")
def loader(tmp_path_factory):
    from conftest import write_tiny_llama

    base = tmp_path_factory.mktemp("cache")
    src = write_tiny_llama(base / "src", intermediate=N, quantize=(4, 32))
    pack = write_pack(src, base / "pack", progress=False)
    with FlashLoader(pack, threads=4, plan=False) as ld:
        yield ld


def all_bundles(loader, layer):
    """{component: uint8 [N, bytes]}: every neuron's bundle, read in neuron order."""
    rows = loader.alloc(layer, N)
    loader.read(layer, np.arange(N), rows)
    return {name: host_bytes(a).reshape(N, -1).copy() for name, a in rows.items()}


def snapshot(cache):
    return [h.copy() for h in cache._host]


@pytest.mark.parametrize("capacity, window, p_active", [(40, 3, 0.15), (12, 5, 0.2), (N, 2, 0.5)])
def test_invariants_under_random_activations(loader, capacity, window, p_active):
    rng = np.random.default_rng(capacity)
    bundles = all_bundles(loader, 1)
    cache = NeuronCache(loader, 1, capacity)
    history = []
    for step in range(60):
        active = np.nonzero(rng.random(N) < p_active)[0]
        before, n_before = snapshot(cache), cache.num_used
        upd = cache.update(active, step, window)
        cache.check(bundles)  # no duplicates, pointers match rows, num_used <= capacity, contents
        assert cache.num_used <= capacity
        live = cache.live_ids()  # the int32 ids the FFN kernels take, one array rewritten in place
        assert live.dtype == mx.int32 and live.tolist() == cache.ids[: cache.num_used].tolist()
        # every needed neuron is either cached now or returned as overflow, never both
        cached = set(cache.ids[: cache.num_used].tolist())
        over = set(upd.overflow.tolist())
        assert cached.isdisjoint(over) and set(active.tolist()) <= cached | over
        assert upd.hits + upd.loaded + len(over) == len(active) == upd.needed
        # rows written this step: only swap-delete holes and loader fills
        changed = {r for h0, h1 in zip(before, cache._host)
                   for r in np.nonzero((h0 != h1).any(axis=1))[0].tolist()}
        assert len(changed) <= upd.rows_moved + upd.loaded
        assert all(r < max(cache.num_used, n_before) for r in changed)
        history.append(set(active.tolist()))
        # the sliding window: with room for everything, the last `window` steps' neurons all stay
        if capacity == N:
            recent = set().union(*history[-window:])
            assert recent <= cached
        # nothing older than the window survives
        if cache.num_used:
            assert cache.last_active[: cache.num_used].min() > step - window


def test_window_shrinks_when_full(loader):
    cache = NeuronCache(loader, 0, 10)
    cache.update(np.arange(0, 6), 0, window=5)
    upd = cache.update(np.arange(6, 12), 1, window=5)
    # 6 new neurons, 4 free rows: the two oldest survivors of step 0 leave, the window shrinks
    assert upd.evicted == 2 and upd.loaded == 6 and not len(upd.overflow)
    assert upd.window == 2 and cache.num_used == 10
    upd = cache.update(np.arange(20, 32), 2, window=5)
    # 12 needed, 10 rows: all older rows leave, two neurons overflow to the caller
    assert upd.loaded == 10 and len(upd.overflow) == 2 and upd.window == 1
    cache.check(all_bundles(loader, 0))


def test_hits_do_not_read(loader):
    cache = NeuronCache(loader, 0, 32)
    first = cache.update(np.array([3, 7, 50]), 0, window=4)
    again = cache.update(np.array([3, 7, 50]), 1, window=4)
    assert first.loaded == 3 and first.bytes_read > 0
    assert again.hits == 3 and again.loaded == 0 and again.bytes_read == 0 and again.rows_moved == 0


def test_swap_delete_keeps_live_rows_contiguous(loader):
    cache = NeuronCache(loader, 0, 8)
    cache.load(np.arange(10, 18), step=0)
    moved = cache.delete([1, 2, 7])
    assert moved == 2 and cache.num_used == 5  # rows 1 and 2 refilled from rows 5 and 6
    assert sorted(cache.ids[:5].tolist()) == [10, 13, 14, 15, 16]
    assert (cache.ids[5:] == -1).all()
    cache.check(all_bundles(loader, 0))


def test_load_and_claim_take_the_rows_after_the_live_ones(loader):
    """load reads into, and claim hands out, the same next free rows; neither takes more rows
    than are free (nothing changes)."""
    bundles = all_bundles(loader, 0)
    cache = NeuronCache(loader, 0, 10)
    cache.load([7, 3, 50], step=0)
    slots = cache.claim([60, 2], step=0)
    assert slots.tolist() == [3, 4]
    loader.read(0, np.array([60, 2]), cache.rows, slots)
    cache.load([11], step=1)
    assert cache.ids[: cache.num_used].tolist() == [7, 3, 50, 60, 2, 11]
    cache.check(bundles)
    for take in (cache.load, cache.claim):
        with pytest.raises(ValueError, match="5 neurons do not fit"):
            take([20, 21, 22, 23, 24], 2)
        assert cache.num_used == 6
    cache.check(bundles)


def test_copy_rows_fills_claimed_rows_from_another_read(loader):
    """The lookahead's path: claimed rows are copied from a buffer another read filled (its rows in
    its own order); the rows then hold their neurons' bundles. Only claimed rows can be written."""
    bundles = all_bundles(loader, 1)
    cache = NeuronCache(loader, 1, 8)
    cache.load([4, 9], step=0)
    slots = cache.claim([30, 12, 77], step=1)
    buf = loader.alloc(1, 4)
    loader.read(1, np.array([77, 5, 30, 12]), buf)
    cache.copy_rows(slots, buf, [2, 3, 0])
    cache.check(bundles)
    with pytest.raises(ValueError, match="not all claimed"):
        cache.copy_rows([cache.num_used], buf, [1])
    cache.check(bundles)


def test_zero_capacity_streams_everything(loader):
    cache = NeuronCache(loader, 0, 0)  # a budget that leaves a layer no cache rows
    upd = cache.update(np.array([1, 4, 9]), 0, window=3)
    assert cache.num_used == 0 and upd.loaded == 0 and upd.overflow.tolist() == [1, 4, 9]
    assert cache.row_bytes == NeuronCache(loader, 0, 4).row_bytes > 0


def test_chunked_reads_stage_at_most_their_limit_and_are_planned_once(tmp_path_factory, monkeypatch):
    from conftest import write_tiny_llama
    from mlx_flash.io import loader as loader_module
    from mlx_flash.io.planner import ReadCost
    from mlx_flash.sparse.neuron_cache import plan_chunks

    base = tmp_path_factory.mktemp("chunks")
    pack = write_pack(write_tiny_llama(base / "src", intermediate=N), base / "pack", progress=False)
    # a cost model whose merge gap spans a few bundles: reads merge across gaps, as on disk;
    # reads of at most 8 KiB, so a 12 KiB limit holds one or more whole reads
    with FlashLoader(pack, threads=4, cost=ReadCost(1e-4, 1e9), max_read=8192) as ld:
        entry, ids = ld.entry(0), np.sort(np.random.default_rng(0).choice(N, 60, replace=False))
        limit = 3 * ld.alignment
        pieces = plan_chunks(ld, 0, ids, max_bytes=limit, max_rows=7)
        assert len(pieces) > 1 and np.array_equal(np.concatenate([p.index for p in pieces]), np.arange(len(ids)))
        for p in pieces:
            assert np.array_equal(p.ids, ids[p.index]) and len(p) <= 7
            assert int((p.r1 - p.r0).sum()) <= limit and (p.r1 - p.r0 <= ld.max_read).all()
            ends = np.append(p.first[1:], len(p))  # each read covers its bundles
            for k, (a, b) in enumerate(zip(p.first, ends)):
                assert p.r0[k] <= p.starts[a] and p.starts[b - 1] + entry.stride <= p.r1[k]
        whole = all_bundles(ld, 0)
        ld._local.staging = None  # staging grows to the largest call from here on
        plans = []  # every plan of a plain layer by the loader: one per update, however many pieces
        real = loader_module.plan_strided
        monkeypatch.setattr(loader_module, "plan_strided", lambda *a, **k: plans.append(1) or real(*a, **k))
        cache = NeuronCache(ld, 0, 70, max_read_bytes=limit)
        cache.update(ids, 0, 5)
        cache.check({k: v for k, v in whole.items()})  # the same bytes landed in every row
        assert len(ld._local.staging) <= limit and len(plans) == 1


def test_a_plan_within_the_limits_is_the_loaders_plan_unsplit(loader, monkeypatch):
    from mlx_flash.sparse.neuron_cache import plan_chunks

    ids = np.array([1, 4, 9, 10])
    plan = loader.plan(0, ids)
    monkeypatch.setattr(loader, "plan", lambda layer, i: plan)
    pieces = plan_chunks(loader, 0, ids, max_bytes=plan.read_bytes, max_rows=len(plan))
    assert len(pieces) == 1 and pieces[0] is plan  # no copy of a plan that needs no split
    assert plan_chunks(loader, 0, ids, max_bytes=plan.read_bytes - 1, max_rows=len(plan))[0] is not plan


needs_kernel = pytest.mark.skipif(cache_update_kernel() is None, reason="CPU kernels not built")


@needs_kernel
@pytest.mark.parametrize("capacity, window, p_active", [(40, 3, 0.15), (12, 5, 0.2), (N, 2, 0.5), (1, 2, 0.1),
                                                        (0, 3, 0.2), (30, 1, 0.05)])
def test_update_kernel_equals_numpy_update_row_for_row(loader, capacity, window, p_active):
    """update(read=False) by the kernels' cache_update against the numpy update on the same
    activations: the same counters, overflow, fill and slots, and afterwards the same ids,
    pointers, last_active and row bytes (swap-delete copies included) at every step."""
    rng = np.random.default_rng(7 + capacity)
    kernel, numpy_ = NeuronCache(loader, 1, capacity), NeuronCache(loader, 1, capacity)
    numpy_.update_kernel = None
    for hk, hn in zip(kernel._host, numpy_._host):  # the same random bytes: any row mix-up shows
        hk[:] = hn[:] = rng.integers(0, 256, hk.shape, dtype=np.uint8)
    moved = 0
    for step in range(80):
        p = p_active if step % 9 else 0.6  # now and then more than fits: the window shrinks
        active = np.nonzero(rng.random(N) < p)[0]
        a, b = kernel.update(active, step, window, read=False), numpy_.update(active, step, window, read=False)
        for f in ("needed", "hits", "loaded", "evicted", "rows_moved", "window"):
            assert getattr(a, f) == getattr(b, f), (step, f)
        assert a.overflow.tolist() == b.overflow.tolist()
        assert (a.fill is None) == (b.fill is None)
        if a.fill is not None:
            assert a.fill.tolist() == b.fill.tolist() and a.fill_slots.tolist() == b.fill_slots.tolist()
        assert kernel.num_used == numpy_.num_used
        for name in ("ids", "slot_of", "last_active"):
            assert np.array_equal(getattr(kernel, name), getattr(numpy_, name)), (step, name)
        for hk, hn in zip(kernel._host, numpy_._host):
            assert np.array_equal(hk, hn), step
        assert (kernel.rows_moved, kernel.rows_loaded) == (numpy_.rows_moved, numpy_.rows_loaded)
        moved += a.rows_moved
    assert capacity < 2 or moved > 0  # swap-delete ran


@needs_kernel
def test_update_kernel_rejects_unsorted_or_out_of_range_ids(loader):
    cache = NeuronCache(loader, 0, 8)
    for bad in ([5, 3], [2, 2], [N]):
        with pytest.raises(ValueError, match="sorted, unique and below"):
            cache.update(np.array(bad), 0, window=3, read=False)
    assert cache.num_used == 0


@pytest.mark.parametrize("direct, seed, n_ids", [(True, 0, 30), (True, 2, 12), (False, 1, 50), (False, 3, 20),
                                                 (False, 4, 70)])
def test_a_plan_over_the_limit_by_its_gaps_stays_one_call_with_its_smallest_merges(tmp_path_factory, direct, seed,
                                                                                   n_ids):
    """A merged plan that stages more than the limit only through the gaps it reads across is one
    piece with merges undone (fit_merges): within the limit, every bundle in its read, the same
    bytes landing; the merges kept are the plan's own, every one undone has a gap no smaller than
    any kept, and keeping the smallest undone one would pass the limit."""
    from conftest import write_tiny_llama
    from mlx_flash.io.planner import ReadCost
    from mlx_flash.sparse.neuron_cache import fit_merges, plan_chunks, read_in_chunks

    base = tmp_path_factory.mktemp(f"fit{seed}")
    pack = write_pack(write_tiny_llama(base / "src", intermediate=N), base / "pack", progress=False)
    # merge gap: many bundles; direct=False: reads aligned to 1 byte, every gap between bundles shows
    with FlashLoader(pack, threads=4, cost=ReadCost(1e-3, 1e8), direct=direct) as ld:
        entry, ids = ld.entry(0), np.random.default_rng(seed).choice(N, n_ids, replace=False)
        plan = ld.plan(0, ids)
        align = plan.align
        a0, a1 = plan.starts // align * align, -(-(plan.starts + plan.lengths) // align) * align
        own = int((a1 - a0).sum()) + int(np.minimum(a0[1:] - a1[:-1], 0).sum())
        assert len(plan.r0) < len(plan) and own < plan.read_bytes  # the plan reads through gaps
        limit = (own + plan.read_bytes) // 2
        pieces = plan_chunks(ld, 0, ids, max_bytes=limit)
        assert len(pieces) == 1
        p = pieces[0]
        assert p.read_bytes <= limit and np.array_equal(p.ids, plan.ids) and np.array_equal(p.index, plan.index)
        ends = np.append(p.first[1:], len(p))
        for k, (a, b) in enumerate(zip(p.first, ends)):
            assert p.r0[k] == a0[a] and p.r1[k] == a1[b - 1] and (a1[a:b - 1] <= p.r1[k]).all()
        gaps = a0[1:] - a1[:-1]
        kept = np.ones(len(p) - 1, bool)
        kept[p.first[1:] - 1] = False
        plans_own = np.ones(len(p) - 1, bool)
        plans_own[plan.first[1:] - 1] = False
        assert not (kept & ~plans_own).any()  # no merge the plan did not make
        undone = plans_own & ~kept
        assert undone.any() and (gaps[undone] > 0).all()
        assert gaps[undone].min() >= gaps[kept].max(initial=0)
        assert p.read_bytes + gaps[undone].min() > limit
        assert fit_merges(plan, own - 1) is None  # the bundles' own reads stage more: plan_chunks splits
        assert fit_merges(plan, own).read_bytes == own
        whole = all_bundles(ld, 0)
        rows = ld.alloc(0, len(ids))
        read_in_chunks(ld, 0, ids, rows, np.arange(len(ids)), max_bytes=limit)
        for name, a in rows.items():  # row i holds bundle ids[i]
            assert np.array_equal(host_bytes(a).reshape(len(ids), -1), whole[name][ids])
