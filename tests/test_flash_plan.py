"""The per-layer flash plan (sparse/budget.py plan_flash_layers) and the prefetch ring of the
layers it streams whole (sparse/ffn.py StreamPrefetcher)."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_flash.errors import FlashError
from mlx_flash.flash_config import FlashConfig
from mlx_flash.models.flash import build_flash_model
from mlx_flash.pack import read_manifest, write_pack
from mlx_flash.sparse.budget import (layer_bytes, plan_flash_layers, plan_memory, prefetch_bytes,
                                     stream_bytes)
from mlx_flash.sparse.predictor import predicted_density, save_predictors
from test_flash import TOKENS, assert_identical, run_steps


def fake_manifest(layers=6, count=1000, row=1000):
    comps = [{"name": "up.weight", "length": row // 2}, {"name": "down_t.weight", "length": row - row // 2}]
    return {"resident": {"length": 10_000_000},
            "bundles": [{"layer": i, "count": count, "stride": row, "components": comps}
                        for i in range(layers)]}


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


def all_predictors_pack(tiny_llama, tmp_path, layers=4, n=96, predicted=1.0):
    src = tiny_llama("src", layers=layers, intermediate=n, hidden=128)
    pack = write_pack(src, tmp_path / "pack", progress=False)
    entry = {"kind": "all", "n_neurons": n, "rank": 0, "threshold": 0.0, "prob_threshold": 0.5,
             "stats": {"predicted": predicted}, "capacity": [n] * 8}
    save_predictors(pack, {"activation": "silu"}, {i: dict(entry) for i in range(layers)}, {})
    return pack


def test_streamed_flash_layers_are_prefetched_and_exact(tiny_llama, tmp_path):
    pack = all_predictors_pack(tiny_llama, tmp_path, layers=6)
    m = read_manifest(pack)
    assert predicted_density(pack) == {i: 1.0 for i in range(6)}
    budget = m["resident"]["length"] + prefetch_bytes(m) + layer_bytes(m["bundles"][0])
    dense = run_steps(build_flash_model(pack, FlashConfig("dense")))
    model = build_flash_model(pack, FlashConfig("flash", memory_budget=budget))
    plan = model.flash_stats.plan
    assert plan.resident_layers == [0] and plan.streamed_layers == [1, 2, 3, 4, 5] and plan.capacity == {}
    assert model.flash_runtime.prefetcher is not None
    assert_identical(run_steps(model), dense)
    row = sum(c["length"] for c in m["bundles"][0]["components"])
    for s in model.flash_stats.steps:  # three whole layers read per forward pass, counted once
        assert s.neurons_loaded == 5 * 96 and s.neurons_needed == 6 * 96 and s.hits == 96
        assert s.bytes_read >= 5 * 96 * row and s.io_read_s > 0
    assert len(model.flash_stats.steps) == len(TOKENS)
    pf = model.flash_runtime.prefetcher
    assert sorted(pf.free) == [0, 1] and not pf.pending  # every slot back in the ring
    pf.close()


def test_prefetch_survives_an_aborted_forward_pass(tiny_llama, tmp_path):
    pack = all_predictors_pack(tiny_llama, tmp_path, layers=6)
    m = read_manifest(pack)
    budget = m["resident"]["length"] + prefetch_bytes(m)
    dense = run_steps(build_flash_model(pack, FlashConfig("dense")))
    model = build_flash_model(pack, FlashConfig("flash", memory_budget=budget))
    assert model.flash_stats.plan.streamed_layers == [0, 1, 2, 3, 4, 5]
    ffn0 = model.model.layers[0].mlp
    pf = model.flash_runtime.prefetcher
    step = model.flash_stats.enter_layer(0, 1)
    pf.pump(step)  # reads scheduled, then the pass is abandoned
    model.flash_stats.reset()
    assert_identical(run_steps(model), dense)
    assert ffn0.kind == "streamed"
