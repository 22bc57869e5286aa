"""sparse/ffn.py: the prefetch ring of layers the flash plan streams whole (StreamPrefetcher), and
the MLP shapes FlashFFN accepts."""

import mlx.core as mx
import mlx.nn as nn
import pytest

from flash_runs import TOKENS, assert_identical, run_steps

from mlx_flash.config import FlashConfig
from mlx_flash.errors import FlashError
from mlx_flash.models.flash import build_flash_model
from mlx_flash.pack import read_manifest, write_pack
from mlx_flash.sparse.budget import layer_bytes, prefetch_bytes
from mlx_flash.sparse.ffn import CurrentRows, RowDown, RowProjection, check_mlp_shape
from mlx_flash.sparse.predictor import predicted_density, save_predictors


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


def test_unsupported_mlp_shape_is_refused():
    class SoftmaxMLP(nn.Module):  # the activation mixes neurons: a subset's sum is not the FFN
        def __init__(self, current):
            super().__init__()
            self.up, self.down = RowProjection("up", current), RowDown(current)

        def __call__(self, x):
            return self.down(mx.softmax(self.up(x), axis=-1))

    current = CurrentRows({})
    with pytest.raises(FlashError, match="unsupported MLP shape"):
        check_mlp_shape(SoftmaxMLP(current), current, ["down_t", "up"], 16, "model.layers.0.mlp")
