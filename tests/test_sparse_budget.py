"""sparse/budget.py: how a memory budget is spent per mode, and the per-layer flash plan."""

import sys

import numpy as np
import pytest

from mlx_flash.errors import FlashError
from mlx_flash.pack.layout import Bundle, Component, Manifest, Resident
from mlx_flash.sparse.budget import (layer_bytes, plan_flash_layers, plan_memory, prefetch_bytes,
                                     stream_bytes)


def fake_manifest(layers=6, count=1000, row=1000):
    """A Manifest with `layers` layers of `count` neurons of `row` bytes (no files behind it)."""
    comps = [Component("up.weight", "up.weight", "uint8", (row // 2,), 0, row // 2),
             Component("down_t.weight", "down.weight", "uint8", (row - row // 2,), row // 2, row - row // 2)]
    bundles = tuple(Bundle(i, "neurons", f"bundles/layer_{i:03d}.bin", 0, count, row, count * row,
                           count * row, tuple(comps), {}) for i in range(layers))
    return Manifest(4096, bundles, Resident("resident.safetensors", 10_000_000, 0), {}, {})


def bytes_cost(manifest, density_of_reads):
    """A read cost in seconds proportional to bytes, with `density_of_reads(k)` the fraction of the
    layer a read of k neurons really covers (merged small bundles cover the whole layer)."""
    e = manifest["bundles"][0]
    return lambda layer, k: density_of_reads(k / e["count"]) * e["count"] * e["stride"] / 1e9


def test_dense_predictions_never_make_a_layer_sparse_and_resident_layers_come_first():
    m = fake_manifest()
    lb = layer_bytes(m["bundles"][0])
    budget = m["resident"]["length"] + prefetch_bytes(m) + 2 * lb + lb // 2
    # a predictor marking 98% of neurons whose reads merge into whole-layer reads saves nothing
    plan = plan_flash_layers(m, budget, {i: 50_000 for i in range(6)}, {i: 0.98 for i in range(6)},
                             bytes_cost(m, lambda f: 1.0 if f > 0.5 else f))
    assert plan.capacity == {} and plan.predictors == 0
    assert plan.resident_layers == [0, 1] and plan.streamed_layers == [2, 3, 4, 5]
    assert plan.weights <= budget
    assert plan.expected_read_s == pytest.approx(4 * lb / 1e9)


def test_sparse_layers_chosen_where_the_predictor_saves_reads():
    m = fake_manifest(layers=12)
    lb = layer_bytes(m["bundles"][0])
    budget = m["resident"]["length"] + stream_bytes(m) + lb
    plan = plan_flash_layers(m, budget, {i: 20_000 for i in range(12)}, {i: 0.05 for i in range(12)},
                             bytes_cost(m, lambda f: f))
    assert len(plan.capacity) == 12 and plan.weights <= budget and not plan.streamed_layers
    # the leftover budget went to neuron-cache rows, never past it
    assert sum(plan.capacity.values()) > 0
    assert plan.expected_read_s == pytest.approx(12 * 0.05 * lb / 1e9)


def test_plan_is_never_worse_than_streaming_every_non_resident_layer():
    m = fake_manifest(layers=8)
    lb = layer_bytes(m["bundles"][0])
    rng = np.random.default_rng(0)
    for _ in range(20):
        density = {i: float(rng.uniform(0.02, 1.0)) for i in range(8)}
        budget = m["resident"]["length"] + prefetch_bytes(m) + stream_bytes(m) + int(rng.uniform(0, 5)) * lb
        cost = bytes_cost(m, lambda f: f)
        plan = plan_flash_layers(m, budget, {i: 30_000 for i in range(8)}, density, cost)
        whole = (budget - m["resident"]["length"] - prefetch_bytes(m)) // lb  # hybrid-like choice
        assert plan.expected_read_s <= (8 - min(8, whole)) * cost(0, 1000) + 1e-12
        assert plan.weights <= budget


def test_flash_plan_below_its_minimum_is_refused():
    m = fake_manifest()
    with pytest.raises(FlashError, match="below the minimum resident set of mode flash"):
        plan_memory(m, "flash", m["resident"]["length"] + 1000, predictor_bytes={i: 10 for i in range(6)},
                    density={i: 1.0 for i in range(6)}, read_cost=lambda layer, k: 1.0)


def test_without_prefetch_the_plan_is_hybrids_plan():
    m = fake_manifest()
    lb = layer_bytes(m["bundles"][0])
    budget = m["resident"]["length"] + stream_bytes(m) + 2 * lb + lb // 2
    flash = plan_memory(m, "flash", budget, predictor_bytes={i: 50_000 for i in range(6)},
                        density={i: 0.98 for i in range(6)}, read_cost=bytes_cost(m, lambda f: 1.0 if f > 0.5 else f),
                        prefetch=False)
    hybrid = plan_memory(m, "hybrid", budget)
    assert flash.resident_layers == hybrid.resident_layers == [0, 1]
    assert flash.streamed_layers == [2, 3, 4, 5] and not flash.prefetch and flash.stream == hybrid.stream
    # the ring does not fit next to one resident layer less: the sync plan is the fallback
    tight = m["resident"]["length"] + stream_bytes(m) + lb // 2
    plan = plan_memory(m, "flash", tight, predictor_bytes={i: 50_000 for i in range(6)},
                       density={i: 0.98 for i in range(6)}, read_cost=bytes_cost(m, lambda f: 1.0))
    assert not plan.prefetch and plan.streamed_layers == list(range(6)) and plan.weights <= tight


def test_measured_sparse_read_fraction_overrides_the_random_neuron_price():
    m = fake_manifest()
    lb = layer_bytes(m["bundles"][0])
    budget = m["resident"]["length"] + prefetch_bytes(m) + 2 * lb + lb // 2
    cost = bytes_cost(m, lambda f: 1.0 if f > 0.1 else f)  # random sets of 15% read the whole layer
    kw = dict(predictor_bytes={i: 50_000 for i in range(6)}, density={i: 0.15 for i in range(6)},
              read_cost=cost)
    assert plan_memory(m, "flash", budget, **kw).capacity == {}
    # calibration measured that its real (clustered) predictions read 8% of the layer's cost with
    # a cache of the window's 100 rows, 50% without one
    plan = plan_memory(m, "flash", budget, sparse_read_fraction={i: (0.08, 0.5) for i in range(6)},
                       requested_capacity={i: 100 for i in range(6)}, **kw)
    assert len(plan.capacity) + len(plan.resident_layers) == 6 and len(plan.capacity) >= 3
    assert set(plan.capacity.values()) == {100}  # the rows the cheap price needs, paid for
    assert plan.expected_read_s == pytest.approx(len(plan.capacity) * 0.08 * lb / 1e9)
    assert plan.weights <= budget
    # a cache as large as the layer costs more than keeping the layer: sparse layers run uncached
    plan = plan_memory(m, "flash", budget, sparse_read_fraction={i: (0.08, 0.5) for i in range(6)},
                       requested_capacity={i: 1000 for i in range(6)}, **kw)
    n_sparse, n_streamed = len(plan.capacity), len(plan.streamed_layers)
    assert n_sparse >= 1 and all(rows < 1000 for rows in plan.capacity.values())
    assert plan.expected_read_s == pytest.approx((n_sparse * 0.5 + n_streamed) * lb / 1e9)
    assert plan.weights <= budget


def test_measured_read_seconds_reads_only_what_the_window_has_not_seen():
    from types import SimpleNamespace

    from mlx_flash.sparse.budget import measured_read_seconds

    entry = SimpleNamespace(offset=0, stride=4096, count=100)
    loader = SimpleNamespace(entry=lambda layer: entry, cost=None, plan=True, alignment=4096, max_read=1 << 20)
    masks = np.zeros((4, 100), bool)
    masks[0, :10] = masks[1, :10] = masks[2, 10:20] = True
    masks[3, 5:15] = True
    got = measured_read_seconds(loader, 0, masks, max_window=3)
    per = 4096 / 1e9  # no cost model: one aligned read per neuron at 1 GB/s
    assert got["whole_s"] == pytest.approx(100 * per)
    # window 1: every token reads its own; 2: token 1 repeats token 0, token 3 half of token 2; 3: token 3 saw all
    assert got["window_s"] == pytest.approx([10 * per, 6.25 * per, 5 * per])


def test_hybrid_holds_endor_layers_encoded_then_decoded_as_room_allows():
    """ENDOR layers count their encoded bytes (the aligned range read_encoded holds + offsets):
    as many layers as fit encoded are held, then decoded while the room left allows."""
    from dataclasses import replace

    from mlx_flash.sparse.budget import encoded_bytes, resident_bytes

    m = fake_manifest(layers=6)
    endor = tuple(replace(b, encoding="endor", offset=4096, length=560_000) for b in m.bundles)
    m = replace(m, bundles=endor)
    enc, dec = encoded_bytes(endor[0], 4096), layer_bytes(endor[0])
    assert enc == 137 * 4096 + 4096 + 8 * 1001 and enc < dec  # pages 1..137 + slack + offsets
    fixed = resident_bytes(m) + stream_bytes(m)
    plan = plan_memory(m, "hybrid", fixed + 4 * enc + (dec - enc))  # 4 encoded, one of them decoded
    assert plan.resident_layers == [0] and plan.encoded_layers == [1, 2, 3]
    assert plan.weights <= plan.budget and "4/6 layer FFNs resident (3 ENDOR-encoded)" in plan.describe()
    plan = plan_memory(m, "hybrid", fixed + 5 * enc)  # exactly 5 encoded, no room to decode one
    assert plan.resident_layers == [] and plan.encoded_layers == [0, 1, 2, 3, 4]


def test_measured_cache_read_seconds_runs_the_runtimes_cache_at_each_size():
    from types import SimpleNamespace

    from mlx_flash.sparse.budget import measured_cache_read_seconds

    entry = SimpleNamespace(offset=0, stride=4096, count=16)
    loader = SimpleNamespace(entry=lambda layer: entry, cost=None, plan=True, alignment=4096, max_read=4096)
    masks = np.zeros((6, 16), bool)
    masks[:, :2] = True  # two neurons on every token
    masks[0::2, 2:4] = masks[1::2, 4:6] = True  # two pairs alternating
    got = measured_cache_read_seconds(loader, 0, masks, window=5, fractions=(2 / 16, 4 / 16, 6 / 16), tokens=4)
    per = 4096 / 1e9  # no cost model: one read per neuron at 1 GB/s
    assert got["window"] == 5 and got["rows"] == [2, 4, 6]
    # 2 rows: the every-token pair stays; each token reads its alternating pair (overflow: not cached)
    # 4 rows: the alternating pair evicts the other one (least recently active) every token
    # 6 rows: everything stays: nothing read once warm
    assert got["seconds"] == pytest.approx([2 * per, 2 * per, 0.0])


def test_smaller_measured_caches_are_plan_options_with_their_rows():
    m = fake_manifest(layers=12)
    lb = layer_bytes(m["bundles"][0])
    budget = m["resident"]["length"] + prefetch_bytes(m) + stream_bytes(m) + 3 * lb
    kw = dict(predictor_bytes={i: 50_000 for i in range(12)}, density={i: 0.15 for i in range(12)},
              read_cost=bytes_cost(m, lambda f: f), requested_capacity={i: 900 for i in range(12)},
              sparse_read_fraction={i: (0.05, 0.5) for i in range(12)})
    without = plan_memory(m, "flash", budget, **kw)
    # a 200-row cache (a fifth of the layer) reads 15% of the layer: better per byte than 900 rows or none
    plan = plan_memory(m, "flash", budget, cache_read_fraction={i: [(200, 0.15), (1000, 0.0)] for i in range(12)},
                       **kw)
    assert plan.expected_read_s < without.expected_read_s
    assert plan.weights <= budget
    assert all(rows < 1000 for rows in plan.capacity.values())  # a cache as large as the layer is not an option
    assert sum(rows == 200 for rows in plan.capacity.values()) >= 6


def test_sparse_only_plan_holds_the_largest_overflow_not_a_whole_layer():
    from mlx_flash.sparse.budget import overflow_bytes

    m = fake_manifest(layers=12, count=2000, row=1000)
    lb = layer_bytes(m["bundles"][0])
    budget = m["resident"]["length"] + stream_bytes(m) + lb
    args = (m, budget, {i: 20_000 for i in range(12)}, {i: 0.05 for i in range(12)}, bytes_cost(m, lambda f: f))
    whole = plan_flash_layers(*args, requested_capacity={i: 400 for i in range(12)})
    small = plan_flash_layers(*args, requested_capacity={i: 400 for i in range(12)}, overflow_rows=150)
    assert whole.overflow_rows is None and whole.stream == stream_bytes(m)
    assert small.overflow_rows == 150 and small.stream == overflow_bytes(m, 150) < stream_bytes(m)
    assert small.overflow_stage == max(150 * 1000, (1 << 20) + 2 * 4096)
    # the knapsack spends the freed bytes itself: here two layers held whole, which read nothing
    # (spread over every layer's cache they would save nothing: a token reads 5% of a layer anyway)
    assert whole.resident_layers == [] and small.resident_layers == [0, 1] and not small.streamed_layers
    assert small.expected_read_s == pytest.approx(10 / 12 * whole.expected_read_s)
    # each layer's priced option: nothing for a resident layer, the plan's total over the layers
    assert small.layer_read_s[0] == small.layer_read_s[1] == 0.0 and small.layer_read_s[2] > 0
    assert sum(small.layer_read_s.values()) == pytest.approx(small.expected_read_s)
    assert small.weights <= budget and whole.weights <= budget


def test_a_plan_that_streams_whole_layers_keeps_a_whole_layer_buffer():
    m = fake_manifest()
    lb = layer_bytes(m["bundles"][0])
    budget = m["resident"]["length"] + prefetch_bytes(m) + 2 * lb + lb // 2
    for prefetch in (True, False):
        plan = plan_flash_layers(m, budget, {i: 50_000 for i in range(6)}, {i: 0.98 for i in range(6)},
                                 bytes_cost(m, lambda f: 1.0 if f > 0.5 else f), prefetch=prefetch,
                                 overflow_rows=10)
        assert plan.streamed_layers and plan.overflow_rows is None and plan.weights <= budget
        assert plan.stream == (prefetch_bytes(m) if prefetch else stream_bytes(m))
    # sparse and streamed layers sharing the buffer (no prefetch): a whole layer for both
    # (layers 0-2 predict every neuron: sparse saves nothing, so they stream or stay resident)
    density = {i: 1.0 if i < 3 else 0.05 for i in range(6)}
    budget = m["resident"]["length"] + stream_bytes(m) + lb + 100_000
    plan = plan_flash_layers(m, budget, {i: 20_000 for i in range(6)}, density, bytes_cost(m, lambda f: f),
                             prefetch=False, overflow_rows=10)
    assert plan.streamed_layers and plan.capacity and plan.overflow_rows is None
    assert plan.stream == stream_bytes(m) and plan.weights <= budget


def curve(depth_cost: dict, sizes=(4096, 1 << 20)):
    """A ReadCostCurve with seconds per read {depth: (at 4 KiB, at 1 MiB)}, priced at depth 32."""
    from mlx_flash.io.read_cost import ReadCostCurve

    depths = sorted(depth_cost)
    return ReadCostCurve(list(sizes), depths, [list(depth_cost[d]) for d in depths], 32)


def test_a_call_is_priced_at_the_reads_it_has_in_flight():
    from mlx_flash.sparse.budget import call_seconds

    cost = curve({1: (80e-6, 800e-6), 4: (40e-6, 760e-6), 32: (15e-6, 590e-6)})
    # a whole 4 MiB layer is 4 reads of 1 MiB: depth 4, not the loader's 32
    assert call_seconds(cost, 4, 4 << 20) == pytest.approx(4 * 760e-6)
    assert call_seconds(cost, 64, 64 * 4096) == pytest.approx(64 * 15e-6)  # more reads than the depth
    assert call_seconds(cost, 1, 4096) == pytest.approx(80e-6)
    assert call_seconds(None, 3, 3e6) == pytest.approx(3e-3) and call_seconds(cost, 0, 0) == 0.0


def test_measured_reads_are_priced_again_with_the_current_cost_model():
    """Calibration keeps the planner's real reads (count, bytes); the plan prices them with the
    machine's cost model at plan time, so a curve measured again changes the plan's prices."""
    from types import SimpleNamespace

    from mlx_flash.sparse.budget import call_seconds, measured_read_seconds, priced_read_fractions

    entry = SimpleNamespace(offset=0, stride=4096, count=1024)  # one 4 KiB block per neuron, 4 MiB
    loader = SimpleNamespace(entry=lambda layer: entry, cost=None, plan=True, alignment=4096, max_read=1 << 20)
    masks = np.zeros((3, 1024), bool)
    masks[:, ::64] = True  # 16 scattered neurons per token: 16 reads of one block
    got = measured_read_seconds(loader, 0, masks, max_window=2)
    # window 2: only the first token reads (the others repeat it)
    assert got["window_reads"] == [[16.0, 16 * 4096.0], pytest.approx([16 / 3, 16 * 4096 / 3], abs=0.05)]
    calls = {0: {"window": [0.0, 0.0], "uncached": got["window_reads"][0], "cache": [(8, 8.0, 8 * 4096.0)]}}
    loader.cost = curve({1: (80e-6, 800e-6), 4: (40e-6, 760e-6), 16: (20e-6, 640e-6), 32: (15e-6, 590e-6)})
    by_window, by_rows = priced_read_fractions(loader, calls)
    whole = 4 * 760e-6  # 4 reads of 1 MiB in flight
    assert by_window[0] == pytest.approx((0.0, 16 * 20e-6 / whole))
    assert by_rows[0] == [(8, pytest.approx(call_seconds(loader.cost, 8, 8 * 4096) / whole))]
    # the same reads on a curve where small reads cost 4x: dearer against the whole layer
    loader.cost = curve({1: (320e-6, 800e-6), 4: (160e-6, 760e-6), 16: (80e-6, 640e-6), 32: (60e-6, 590e-6)})
    assert priced_read_fractions(loader, calls)[0][0][1] == pytest.approx(16 * 80e-6 / whole)


def test_staging_for_a_whole_layer_counts_the_huge_pages_its_buffer_takes():
    """A layer of 1536 x 2304-byte bundles (3.5 MB) is staged in aligned_buffer's whole huge pages
    (4 MiB on Linux): the naive / hybrid streaming and the prefetch ring count that, not 3.5 MB."""
    from mlx_flash.io.files import huge_page_bytes

    m = fake_manifest(layers=2, count=1536, row=2304)
    lb, staged = layer_bytes(m["bundles"][0]), 1536 * 2304
    assert stream_bytes(m) == lb + huge_page_bytes(staged)
    assert prefetch_bytes(m) == 2 * lb + huge_page_bytes(staged)
    if sys.platform.startswith("linux"):
        assert huge_page_bytes(staged) == 4 << 20


@pytest.mark.parametrize("density,sparse", [(0.97, False), (0.9, True)])
def test_a_sparse_layer_must_save_a_share_of_its_reads(density, sparse):
    """Predictions priced 3% below streaming the layer whole do not make it sparse (a tie saves no
    reads and costs the predictor); 10% below do."""
    m = fake_manifest()
    lb = layer_bytes(m["bundles"][0])
    budget = m["resident"]["length"] + stream_bytes(m) + 2 * lb + lb // 2
    plan = plan_memory(m, "flash", budget, predictor_bytes={i: 1_000 for i in range(6)},
                       density={i: density for i in range(6)}, read_cost=bytes_cost(m, lambda f: f), prefetch=False)
    assert bool(plan.capacity) == sparse and plan.resident_layers == [0, 1]
