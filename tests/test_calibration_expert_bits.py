"""calibration/expert_bits.py: expert widths measured on text; the loss-change check of the proxy."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import write_tiny_moe

from mlx_flash.calibration.expert_bits import (choose_expert_bits, record_switch_inputs,
                                               validate_importance)
from mlx_flash.errors import FlashError
from mlx_flash.models import load_model
from mlx_flash.moe.bitwidths import mean_bits


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    src = write_tiny_moe(tmp_path_factory.mktemp("eb") / "src", "mixtral", experts=6, layers=2)
    model, _ = load_model(src, lazy=False)
    for layer in model.layers:  # experts that move the logits (the random ones barely do)
        up = layer.block_sparse_moe.switch_mlp.up_proj
        up.weight = up.weight * 20
    return model


def test_widths_under_the_target_from_recorded_routing(moe_model):
    tokens = np.random.default_rng(0).integers(0, 128, 300).astype(np.int32)
    rec = record_switch_inputs(moe_model, tokens, seq_len=128)
    assert sorted(rec) == [0, 1] and rec[0][0].shape == (300, 64) and rec[0][1].shape == (300, 2)
    up = moe_model.layers[0].block_sparse_moe.switch_mlp.up_proj
    w = up.weight
    up.weight = mx.concatenate([w[:1] * 10, w[1:]])  # expert 0 of layer 0: 10x the output error
    try:
        bits, errors = choose_expert_bits(moe_model, tokens, 3.0, 32, progress=False)
    finally:
        up.weight = w
    assert mean_bits(bits) <= 3.0 and {len(b) for b in bits.values()} == {6}
    # within the same budget, less summed error than every expert at 3 bits
    chosen = sum(errors[layer][e, [2, 3, 4, 8].index(b)] for layer, ws in bits.items()
                 for e, b in enumerate(ws))
    assert bits[0][0] > 3 and chosen < sum(err[:, 1].sum() for err in errors.values())
    with pytest.raises(FlashError, match="--group-size 128"):
        choose_expert_bits(moe_model, tokens, 3.0, 128, progress=False)


def test_loss_change_of_an_unrouted_expert_is_zero_and_the_model_is_restored(moe_model):
    tokens = np.random.default_rng(1).integers(0, 128, 257).astype(np.int32)
    rec = record_switch_inputs(moe_model, tokens)
    errors = {layer: np.zeros((6, 4)) for layer in rec}
    before = moe_model.layers[0].block_sparse_moe.switch_mlp.up_proj.weight
    out = validate_importance(moe_model, tokens, errors, 32, samples=12, seed=0)
    for layer, e, _, delta in out["pairs"]:
        if not (rec[layer][1] == e).any():
            assert delta == 0.0
        else:
            assert delta != 0.0
    assert moe_model.layers[0].block_sparse_moe.switch_mlp.up_proj.weight is before
    assert validate_importance(moe_model, tokens, errors, 32, samples=1)["base_loss"] == out["base_loss"]
