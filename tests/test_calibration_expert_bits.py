"""calibration/expert_bits.py: expert widths measured on text; the loss-change check of the proxy."""

import mlx.core as mx
import mlx.nn as nn
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


def test_gptq_widths_are_what_the_pack_holds_and_the_runtime_reads(tmp_path):
    from mlx_flash.calibration.expert_bits import stored_quantizer, switch_glus
    from mlx_flash.config import FlashConfig
    from mlx_flash.models.moe import build_moe_model
    from mlx_flash.moe.quantize import dequantize_experts
    from mlx_flash.pack import write_pack

    src = write_tiny_moe(tmp_path / "src", "mixtral", experts=6, layers=2)
    model, _ = load_model(src, lazy=False)
    tokens = np.random.default_rng(2).integers(0, 128, 300).astype(np.int32)
    quantized = {}
    bits, _ = choose_expert_bits(model, tokens, 3.0, 32, progress=False, method="gptq",
                                 quantized=quantized)
    assert sorted(quantized) == [(layer, b) for layer in (0, 1) for b in (2, 3, 4, 8)]
    write_pack(src, tmp_path / "pack", progress=False, expert_bits=bits, group_size=32,
               expert_quantizer=stored_quantizer(quantized))
    # the float model with each expert replaced by its GPTQ stack at its width
    for layer, (_, _, switch) in switch_glus(model).items():
        for role in ("gate", "up", "down"):
            lin = getattr(switch, f"{role}_proj")
            lin.weight = mx.stack([dequantize_experts(*quantized[(layer, b)][role], b, 32)[e]
                                   for e, b in enumerate(bits[layer])])
    x = mx.array(tokens[:64])[None]
    want = np.array(model(x))
    got = np.array(build_moe_model(tmp_path / "pack", FlashConfig(mode="dense"))(x))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_fewest_bits_within_a_perplexity_tolerance(moe_model):
    from mlx_flash.calibration.expert_bits import fewest_bits_within, measure_errors

    tokens = np.random.default_rng(3).integers(0, 128, 257).astype(np.int32)
    errors = measure_errors(moe_model, tokens, 32, progress=False)
    loose = fewest_bits_within(moe_model, tokens, errors, 1e9, 32)
    assert loose["mean_bits"] == 2.0 and {b for bs in loose["bits"].values() for b in bs} == {2}
    all2 = next(p for t, p in loose["probes"] if t == 2.0)
    tol = all2 / 4  # somewhere between the narrowest and the widest widths
    r = fewest_bits_within(moe_model, tokens, errors, tol, 32)
    assert 2.0 < r["mean_bits"] <= r["target"] < 8.0 and r["ppl_increase_pct"] <= tol
    assert all(p > tol for t, p in r["probes"] if t < r["target"])  # nothing narrower passed
    assert any(t == r["target"] - 0.125 for t, _ in r["probes"])  # the step below was probed
    before = moe_model.layers[0].block_sparse_moe.switch_mlp.up_proj.weight
    assert fewest_bits_within(moe_model, tokens, errors, tol, 32)["bits"] == r["bits"]
    assert moe_model.layers[0].block_sparse_moe.switch_mlp.up_proj.weight is before  # restored


def test_layer_losses_are_the_kl_of_one_narrowed_layer(moe_model):
    tokens = np.random.default_rng(4).integers(0, 128, 129).astype(np.int32)
    downs = [layer.block_sparse_moe.switch_mlp.down_proj for layer in moe_model.layers]
    for d in downs:  # experts whose rounding moves the logits well above float noise
        d.weight = d.weight * 50
    try:
        _check_layer_losses(moe_model, tokens)
    finally:
        for d in downs:
            d.weight = d.weight / 50


def _check_layer_losses(moe_model, tokens):
    from mlx_flash.calibration.expert_bits import layer_losses, scale_by_layer_loss
    from mlx_flash.moe.bitwidths import quantize_dequantize

    before = moe_model.layers[1].block_sparse_moe.switch_mlp.up_proj.weight
    losses = layer_losses(moe_model, tokens, None, (2, 8), 32)
    assert sorted(losses) == [0, 1] and all(row[0] > row[1] >= -1e-6 for row in losses.values())
    assert moe_model.layers[1].block_sparse_moe.switch_mlp.up_proj.weight is before  # restored
    # layer 1 at 2 bits written out: KL(float || narrowed) per token, on mlx-lm's own SwitchGLU
    x = mx.array(tokens)[None]
    ref = nn.log_softmax(moe_model(x).astype(mx.float32), axis=-1)
    switch = moe_model.layers[1].block_sparse_moe.switch_mlp
    saved = {r: getattr(switch, f"{r}_proj").weight for r in ("gate", "up", "down")}
    for r, w in saved.items():
        getattr(switch, f"{r}_proj").weight = quantize_dequantize(w, 2, 32)
    try:
        got = nn.log_softmax(moe_model(x).astype(mx.float32), axis=-1)
    finally:
        for r, w in saved.items():
            getattr(switch, f"{r}_proj").weight = w
    want = float(mx.sum(mx.exp(ref) * (ref - got))) / len(tokens)
    assert losses[1][0] == pytest.approx(want, rel=1e-3)
    # the proxy rescaled: each layer's column sums to its measured loss, shares kept
    errors = {0: np.array([[1.0, 0.1], [3.0, 0.3]]), 1: np.array([[2.0, 0.0], [2.0, 0.5]])}
    scaled = scale_by_layer_loss(errors, losses)
    for layer in (0, 1):
        assert np.allclose(scaled[layer].sum(0), np.maximum(losses[layer], 0))  # noise < 0: 0
    assert scaled[0][1, 0] == pytest.approx(3 * scaled[0][0, 0])
    # the loss at the narrowest width only: every width of a layer by that width's factor
    narrow = scale_by_layer_loss(errors, {layer: row[:1] for layer, row in losses.items()})
    assert np.allclose(narrow[0], errors[0] * max(losses[0][0], 0) / 4.0)


def test_assignment_perplexities_are_the_packs_held_out_perplexities(tmp_path):
    from mlx_flash.calibration.expert_bits import (assignment_perplexities, layer_losses,
                                                   measure_errors, scale_by_layer_loss,
                                                   stored_quantizer)
    from mlx_flash.moe.bitwidths import WIDTHS, assign_widths
    from mlx_flash.calibration.expert_tune import quantize_resident
    from mlx_flash.config import FlashConfig
    from mlx_flash.models.moe import build_moe_model
    from mlx_flash.moe.quality import held_out_perplexity
    from mlx_flash.pack import write_pack

    src = write_tiny_moe(tmp_path / "src", "mixtral", experts=6, layers=2)
    model, _ = load_model(src, lazy=False)
    student, _ = load_model(src, lazy=False)
    quantize_resident(student, 4, 32)
    rng = np.random.default_rng(5)
    calib, text = (rng.integers(0, 128, n).astype(np.int32) for n in (300, 257))
    rows = assignment_perplexities(model, student, calib, text, 3.0, 32, loss_tokens=128)
    assert [r["name"] for r in rows][0] == "all 4-bit" and len(rows) == 6
    assert rows[0]["mean_bits"] == 4.0 and all(r["mean_bits"] <= 3.0 for r in rows[1:])
    # the layer-loss row's pack, written and run by the runtime (dense mode), scores the same
    quantized = {}
    errors = measure_errors(model, calib, 32, progress=False, method="gptq-fit",
                            quantized=quantized)
    row = rows[3]
    assert row["name"] == "knapsack, layer loss"
    # the last row prices each layer's measured loss at every width
    losses = layer_losses(model, calib[:129], quantized, WIDTHS, 32)
    assert rows[5]["bits"] == assign_widths(scale_by_layer_loss(errors, losses), 3.0)
    frozen = layer_losses(model, calib[:129], quantized, WIDTHS[:1], 32, frozen_routing=True)
    assert rows[4]["name"] == "knapsack, layer loss, routing frozen"
    assert rows[4]["bits"] == assign_widths(scale_by_layer_loss(errors, frozen), 3.0)
    write_pack(src, tmp_path / "pack", progress=False, quantize=4, group_size=32,
               expert_bits=row["bits"], expert_quantizer=stored_quantizer(quantized))
    pack_ppl = held_out_perplexity([build_moe_model(tmp_path / "pack", FlashConfig(mode="dense"))],
                                   text)["ppl"][0]
    assert row["ppl"] == pytest.approx(pack_ppl, rel=1e-4)


def test_frozen_routing_replays_the_float_models_experts(moe_model):
    from mlx_flash.calibration.expert_bits import layer_losses, routing_replay
    from mlx_flash.moe.bitwidths import quantize_dequantize

    tokens = np.random.default_rng(6).integers(0, 128, 129).astype(np.int32)
    block = moe_model.layers[0].block_sparse_moe
    router = moe_model.layers[1].block_sparse_moe.gate
    ref = record_switch_inputs(moe_model, tokens, seq_len=128)
    up = block.switch_mlp.up_proj
    w = up.weight
    with routing_replay(moe_model) as replays:
        assert record_switch_inputs(moe_model, tokens, seq_len=128)[1][1].shape == (128, 2)
        for r in replays:
            r.mode = "replay"
        up.weight = quantize_dequantize(w, 2, 32)  # layer 0 narrowed: layer 1 would route anew
        try:
            frozen = record_switch_inputs(moe_model, tokens, seq_len=128)
        finally:
            up.weight = w
    assert moe_model.layers[1].block_sparse_moe.gate is router  # restored
    up.weight = quantize_dequantize(w, 2, 32)
    try:
        free = record_switch_inputs(moe_model, tokens, seq_len=128)
    finally:
        up.weight = w
    chosen = lambda ids: np.sort(ids[:128], axis=-1)
    assert (chosen(free[1][1]) != chosen(ref[1][1])).any()  # the narrowing does flip choices
    assert (chosen(frozen[1][1]) == chosen(ref[1][1])).all()  # replayed: the float model's
    losses = layer_losses(moe_model, tokens, None, (2,), 32, seq_len=128)
    fixed = layer_losses(moe_model, tokens, None, (2,), 32, seq_len=128, frozen_routing=True)
    assert fixed[1][0] == pytest.approx(losses[1][0], rel=1e-5)  # no router after the last layer
    assert fixed[0][0] != pytest.approx(losses[0][0], rel=1e-3)
