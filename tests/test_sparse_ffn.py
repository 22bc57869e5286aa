"""sparse/ffn.py: the prefetch ring of layers the flash plan streams whole (StreamPrefetcher), the
MLP shapes FlashFFN accepts, its GPU path on the fused Metal kernels, and the thresholded model
flash mode computes (|act(gate x)| > threshold), on the CPU kernels and on their MLX twins, against
an independent reference: mlx-lm's own model with each MLP's activation thresholded."""

import re

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from flash_runs import TOKENS, all_neurons, assert_identical, run_steps
from test_models_flash import opt_pack_with_exact_predictors

from mlx_flash.config import FlashConfig
from mlx_flash.cpu import ops
from mlx_flash.cpu.patch import patch_layers
from mlx_flash.errors import FlashError
from mlx_flash.models import load_model
from mlx_flash.models.flash import build_flash_model
from mlx_flash.pack import read_manifest, write_pack
from mlx_flash.sparse.budget import layer_bytes, prefetch_bytes
from mlx_flash.sparse.ffn import CurrentRows, RowDown, RowProjection, check_mlp_shape
from mlx_flash.sparse.predictor import LayerPredictor, load_predictors, predicted_density, save_predictors


def host_decode(monkeypatch):
    """Decode on the per-layer host path (MLX_FLASH_DECODE_KERNEL=0), for a test that counts its calls."""
    monkeypatch.setenv("MLX_FLASH_DECODE_KERNEL", "0")


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
    pf = model.flash_runtime.prefetcher
    assert pf is not None
    submit, started = pf._submit, []  # (layer, passes begun) of each read, as it is scheduled
    pf._submit = lambda layer: started.append((layer, len(model.flash_stats.steps))) or submit(layer)
    assert_identical(run_steps(model), dense)
    row = sum(c["length"] for c in m["bundles"][0]["components"])
    for s in model.flash_stats.steps:  # five whole layers read per forward pass, counted once
        assert s.neurons_loaded == 5 * 96 and s.neurons_needed == 6 * 96 and s.hits == 96
        assert s.bytes_read >= 5 * 96 * row and s.io_read_s > 0
    passes = len(model.flash_stats.steps)
    assert passes == len(TOKENS)
    # each pass's first two streamed layers were read during the pass before it (the ring's two
    # slots, freed by its layers 4 and 5); the last pass's are read for the next one, still held
    assert [layer for layer, _ in started] == [1, 2, 3, 4, 5] + [1, 2, 3, 4, 5] * (passes - 1) + [1, 2]
    assert all(started[5 * n: 5 * n + 2] == [(1, n), (2, n)] for n in range(1, passes + 1))
    assert not pf.pending and not pf.free and list(pf.carried) == [1, 2]
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


def gpu_path_through_the_emulator(monkeypatch):
    """Make sparse/ffn.py take its GPU path (the fused Metal kernels): on a Mac the real kernels on
    the GPU; on Linux metal_active() says yes and the kernel sources run in the Metal emulator.
    Returns the list of kernels run."""
    import sys

    from mlx_flash.metal import emulator
    from mlx_flash.metal import kernels as metal_kernels

    on_mac = sys.platform == "darwin"
    if on_mac and not (mx.metal.is_available() and mx.default_device() == mx.gpu):
        pytest.skip("needs the Metal GPU as the default device")
    if not on_mac and emulator.compiler() is None:
        pytest.skip("the Metal emulator needs g++")
    ran, build = [], metal_kernels.kernel

    def kernel(name, metal_kernel=None):
        run = build(name, None if on_mac else emulator.metal_kernel)
        return lambda **kw: ran.append(name) or run(**kw)

    if not on_mac:
        monkeypatch.setattr(metal_kernels, "metal_active", lambda: True)
    monkeypatch.setattr(metal_kernels, "kernel", kernel)
    return ran


@pytest.mark.parametrize("dtype, quant", [("float16", None), ("float16", (4, 32))])
def test_gpu_path_runs_the_fused_metal_kernels(tiny_llama, tmp_path, monkeypatch, dtype, quant):
    """Flash mode on the GPU path (fused up/gate + SiLU, then down, over the cache's rows and the
    overflow's): the logits of the MLP path, up to float16 rounding."""
    src = tiny_llama("src", dtype=dtype, quantize=quant, layers=2, intermediate=96)
    pack = write_pack(src, tmp_path / "pack", progress=False)
    predictors = {i: all_neurons(96) for i in range(2)}
    want = run_steps(build_flash_model(pack, FlashConfig("flash"), predictors=predictors, capacity={0: 30, 1: 96}))
    ran = gpu_path_through_the_emulator(monkeypatch)
    got = run_steps(build_flash_model(pack, FlashConfig("flash"), predictors=predictors,
                                      capacity={0: 30, 1: 96}))
    # every FFN call ran on the kernels (2 layers; layer 0 also computes its overflow rows)
    assert ran.count("sparse_up") >= 3 * len(TOKENS) and ran.count("sparse_down") == ran.count("sparse_up")
    for x, y in zip(got, want):
        x, y = x.astype(mx.float32), y.astype(mx.float32)
        assert mx.abs(x - y).max().item() <= 0.02 * mx.abs(y).max().item()


def test_gpu_path_runs_relu_ffns_on_the_kernels(tmp_path, monkeypatch):
    _, pack = opt_pack_with_exact_predictors(tmp_path)
    want = run_steps(build_flash_model(pack, FlashConfig("flash", window=2)))
    ran = gpu_path_through_the_emulator(monkeypatch)
    got = run_steps(build_flash_model(pack, FlashConfig("flash", window=2)))
    assert ran.count("sparse_up") >= 2 * len(TOKENS)
    for x, y in zip(got, want):
        assert mx.allclose(x, y, atol=1e-3, rtol=1e-3).item()


def relu_llama_pack(tiny_llama, tmp_path, **act):
    import json

    src = tiny_llama("src", layers=2, intermediate=96)
    config = json.loads((src / "config.json").read_text())
    config.update(model_type="relu_llama", **act)
    (src / "config.json").write_text(json.dumps(config))
    return write_pack(src, tmp_path / "pack", progress=False)


@pytest.mark.parametrize("hidden_act, kernel_act", [("fatrelu", "relu_gated"), ("cats", "silu")])
def test_gpu_path_runs_thresholded_relu_llamas_on_the_kernels(tiny_llama, tmp_path, monkeypatch, hidden_act,
                                                              kernel_act):
    """relu_llama with FATReLU or CATS (threshold 0.05, predictors without one): the gated-ReLU or
    SiLU kernel with the model's threshold as its mask."""
    pack = relu_llama_pack(tiny_llama, tmp_path, hidden_act=hidden_act, activation_threshold=0.05)
    predictors = {i: all_neurons(96) for i in range(2)}
    capacity = {0: 40, 1: 96}
    want = run_steps(build_flash_model(pack, FlashConfig("flash"), predictors=predictors, capacity=capacity))
    ran = gpu_path_through_the_emulator(monkeypatch)
    model = build_flash_model(pack, FlashConfig("flash"), predictors=predictors, capacity=capacity)
    got = run_steps(model)
    assert ran.count("sparse_up") >= 2 * len(TOKENS)
    assert {layer.mlp._fused_act for layer in model.layers} == {kernel_act}
    for x, y in zip(got, want):
        assert mx.allclose(x, y, atol=1e-3, rtol=1e-3).item()


def test_gpu_path_keeps_the_mlp_the_kernels_do_not_compute(tiny_llama, tmp_path, monkeypatch):
    """dReLU (relu(gate x) * relu(up x)) has no kernel: the first call sees the difference, warns,
    and every layer keeps the MLP path (the same logits)."""
    pack = relu_llama_pack(tiny_llama, tmp_path, hidden_act="drelu")
    predictors = {i: all_neurons(96) for i in range(2)}
    want = run_steps(build_flash_model(pack, FlashConfig("flash"), predictors=predictors, capacity={0: 96, 1: 96}))
    gpu_path_through_the_emulator(monkeypatch)
    model = build_flash_model(pack, FlashConfig("flash"), predictors=predictors, capacity={0: 96, 1: 96})
    with pytest.warns(RuntimeWarning, match="differ from the MLP .* keeps the MLP path"):
        got = run_steps(model)
    assert {layer.mlp._fused_act for layer in model.layers} == {False}
    assert_identical(got, want)


# ---- the thresholded model ----

N = 96  # neurons per layer of the tiny model


def run_f32(model):
    return [y.astype(mx.float32) for y in run_steps(model)]


class ThresholdedMLP(nn.Module):
    """mlx-lm's llama MLP with neuron i dropped where |silu(gate_i x)| <= threshold."""

    def __init__(self, mlp, threshold):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.threshold = threshold

    def __call__(self, x):
        a = nn.silu(self.gate_proj(x))
        a = mx.where(mx.abs(a) > self.threshold, a, mx.zeros_like(a))
        return self.down_proj(a * self.up_proj(x))


def reference(src, threshold, patch=True):
    model = load_model(src, lazy=False)[0]
    for layer in model.model.layers:
        layer.mlp = ThresholdedMLP(layer.mlp, threshold)
    if patch:
        patch_layers(model)  # the same attention / norm kernels as the pack's model
    return run_f32(model)


def every_neuron(threshold, layers=2):
    """Predictors that mark every neuron (so the cache holds rows in neuron order) and carry the
    threshold: what is computed is then exactly the thresholded dense model."""
    return {i: LayerPredictor(i, "all", N, threshold=threshold) for i in range(layers)}


@pytest.fixture
def threshold_pack(tiny_llama, tmp_path):
    src = tiny_llama("src", layers=2, intermediate=N)
    return src, write_pack(src, tmp_path / "pack", progress=False)


def test_threshold_changes_logits_exactly_as_the_thresholded_model(threshold_pack):
    src, pack = threshold_pack
    cfg = FlashConfig("flash", window=2)
    full = {i: N for i in range(2)}
    loose = run_f32(build_flash_model(pack, cfg, predictors=every_neuron(0.0), capacity=full))
    strict = run_f32(build_flash_model(pack, cfg, predictors=every_neuron(0.05), capacity=full))
    off = run_f32(build_flash_model(pack, cfg, predictors=every_neuron(1e9), capacity=full))
    for got, want in ((loose, reference(src, 0.0)), (strict, reference(src, 0.05)),
                      (off, reference(src, 1e9))):
        for i, (x, y) in enumerate(zip(got, want)):  # float32, same rows in the same order
            assert mx.array_equal(x, y).item(), f"step {i}: max diff {mx.abs(x - y).max()}"
    assert not mx.array_equal(strict[0], loose[0]).item()
    assert not mx.array_equal(off[0], strict[0]).item()


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "mlx-twin"])
def test_sparse_cache_with_overflow_applies_the_threshold(tiny_llama, tmp_path, kernels):
    """gate-threshold predictors (exact for the thresholded model) on a float16 4-bit pack with
    caches smaller than the active set: cache rows, overflow rows, kernels or MLX ops."""
    src = tiny_llama("src", layers=2, intermediate=N, dtype="float16", quantize=(4, 32))
    pack = write_pack(src, tmp_path / "pack", progress=False, down_bits=16)
    t = 0.1  # drops ~85% of this model's neurons
    layers = {i: {"kind": "gate-threshold", "n_neurons": N, "rank": 0, "threshold": t,
                  "prob_threshold": 0.5, "stats": {}, "capacity": [40] * 4} for i in range(2)}
    save_predictors(pack, {"activation": "silu"}, layers, {})
    assert load_predictors(pack)[0].threshold == t
    was = ops.kernels_active()
    ops.set_kernels_enabled(kernels)
    try:
        got = run_f32(build_flash_model(pack, FlashConfig("flash", window=2)))
        want = reference(src, t)
        unthresholded = reference(src, 0.0)
    finally:
        ops.set_kernels_enabled(was)
    err = max(mx.abs(x - y).max().item() for x, y in zip(got, want))
    effect = max(mx.abs(y - z).max().item() for y, z in zip(want, unthresholded))
    scale = max(mx.abs(y).max().item() for y in want)
    # float16 sums over other row subsets and orders round differently: observed err 0.004
    # (kernels) and 0.029 (MLX ops) on logits up to 4.7, where the threshold moves them by 0.21
    assert err <= 0.01 * scale and err <= 0.2 * effect


def test_dense_mode_ignores_predictor_thresholds(threshold_pack):
    """Dense is the source model: a pack's predictors never change it."""
    src, pack = threshold_pack
    layers = {i: {"kind": "all", "n_neurons": N, "rank": 0, "threshold": 1e9, "prob_threshold": 0.5,
                  "stats": {}, "capacity": [N] * 4} for i in range(2)}
    save_predictors(pack, {"activation": "silu"}, layers, {})
    dense = run_f32(build_flash_model(pack, FlashConfig("dense")))
    for x, y in zip(dense, reference(src, 0.0)):
        assert mx.array_equal(x, y).item()


def test_gpu_path_applies_the_threshold(tiny_llama, tmp_path, monkeypatch):
    """The fused Metal kernels (through the emulator) mask with the predictor's threshold too."""
    src = tiny_llama("src", dtype="float16", layers=2, intermediate=N)
    pack = write_pack(src, tmp_path / "pack", progress=False)
    full = {i: N for i in range(2)}
    ran = gpu_path_through_the_emulator(monkeypatch)
    got = run_f32(build_flash_model(pack, FlashConfig("flash"), predictors=every_neuron(0.1), capacity=full))
    assert ran.count("sparse_up") >= 2 * len(TOKENS)
    want, loose = reference(src, 0.1), reference(src, 0.0)
    err = max(mx.abs(x - y).max().item() for x, y in zip(got, want))
    effect = max(mx.abs(y - z).max().item() for y, z in zip(want, loose))
    assert err <= 0.2 * effect


@pytest.mark.parametrize("quantize", [None, 4])
def test_gpu_path_streams_endor_layers_through_the_decode_matvec_kernels(tiny_llama, tmp_path, monkeypatch,
                                                                           quantize):
    """Naive mode on an ENDOR pack on the GPU path: each layer's bundles read as stored and run by
    endor_up / endor_down (no decoded rows): the logits of the CPU path (rows decoded by the CPU
    kernel), up to float16 rounding; the bytes read are the encoded bytes."""
    from test_calibration_prune import pruned_model

    src, _ = pruned_model(tiny_llama, tmp_path, layers=2, intermediate=96)
    pack = write_pack(src, tmp_path / "endor", quantize=quantize, encoding="endor", progress=False)
    want = run_steps(build_flash_model(pack, FlashConfig("naive")))
    ran = gpu_path_through_the_emulator(monkeypatch)
    model = build_flash_model(pack, FlashConfig("naive"))
    got = run_steps(model)
    assert ran.count("endor_up") == ran.count("endor_down") == 2 * len(TOKENS)
    assert {layer.mlp._endor_gpu for layer in model.layers} == {True}
    encoded = sum(b["length"] for b in read_manifest(pack)["bundles"])
    assert model.flash_stats.steps[-1].bytes_read < 1.1 * encoded + 2 * 4096
    for x, y in zip(got, want):
        x, y = x.astype(mx.float32), y.astype(mx.float32)
        assert mx.abs(x - y).max().item() <= 0.02 * mx.abs(y).max().item()
    loader, encoded_reads = model.flash_runtime.loader, []
    read_encoded = loader.read_encoded
    monkeypatch.setattr(loader, "read_encoded", lambda *a: encoded_reads.append(a) or read_encoded(*a))
    mx.eval(model(mx.array([list(range(20))])))  # more tokens than the kernels take: decoded rows
    assert not encoded_reads
    mx.eval(model(mx.array([[3]])))
    assert len(encoded_reads) == 2


def test_gpu_path_runs_held_encoded_endor_layers_on_the_kernels(tiny_llama, tmp_path, monkeypatch):
    """Hybrid with ENDOR layers held encoded in memory: on the GPU the decode-matvec kernels read
    the held bundles (no per-token decode); the logits of the CPU path up to float16 rounding."""
    from test_calibration_prune import pruned_model

    from mlx_flash.sparse.budget import encoded_bytes, resident_bytes, stream_bytes

    src, _ = pruned_model(tiny_llama, tmp_path, layers=4, intermediate=96)
    pack = write_pack(src, tmp_path / "endor", encoding="endor", progress=False)
    m = read_manifest(pack)  # room for 3 layers held encoded, fewer than 3 decoded
    config = FlashConfig("hybrid", memory_budget=resident_bytes(m) + stream_bytes(m)
                         + sum(encoded_bytes(b, m.alignment) for b in m.bundles[:3]))
    want = run_steps(build_flash_model(pack, config))
    ran = gpu_path_through_the_emulator(monkeypatch)
    model = build_flash_model(pack, config)
    held = model.flash_stats.plan.encoded_layers
    assert held, model.flash_stats.plan.describe()
    got = run_steps(model)
    assert [layer.mlp.kind for layer in model.layers] == ["encoded"] * len(held) + ["streamed"] * (4 - len(held))
    assert ran.count("endor_up") == 4 * len(TOKENS)  # held and streamed layers; the 6-token prompt too
    assert model.flash_stats.steps[-1].decode_s == 0
    for x, y in zip(got, want):
        x, y = x.astype(mx.float32), y.astype(mx.float32)
        assert mx.abs(x - y).max().item() <= 0.02 * mx.abs(y).max().item()


def test_gpu_path_prefetches_endor_layers_as_stored(tiny_llama, tmp_path, monkeypatch):
    """Flash mode streaming whole ENDOR layers through the prefetch ring: on the GPU the ring holds
    the bundles as stored and the decode-matvec kernels run on them (no decode); the prompt (at
    most 16 tokens here) too; the logits of the CPU path up to float16 rounding."""
    from test_calibration_prune import pruned_model

    from mlx_flash.sparse.budget import resident_bytes

    src, _ = pruned_model(tiny_llama, tmp_path, layers=3, intermediate=96)
    pack = write_pack(src, tmp_path / "endor", encoding="endor", progress=False)
    entry = {"kind": "all", "n_neurons": 96, "rank": 0, "threshold": 0.0, "prob_threshold": 0.5,
             "stats": {"predicted": 1.0}, "capacity": [96] * 8}
    save_predictors(pack, {"activation": "silu"}, {i: dict(entry) for i in range(3)}, {})
    m = read_manifest(pack)
    config = FlashConfig("flash", memory_budget=resident_bytes(m) + prefetch_bytes(m))
    want = run_steps(build_flash_model(pack, config))
    ran = gpu_path_through_the_emulator(monkeypatch)
    model = build_flash_model(pack, config)
    assert model.flash_stats.plan.streamed_layers == [0, 1, 2], model.flash_stats.plan.describe()
    assert model.flash_runtime.prefetcher is not None, model.flash_stats.plan.describe()
    got = run_steps(model)
    pf = model.flash_runtime.prefetcher
    assert pf.encoded and ran.count("endor_up") == 3 * len(TOKENS)
    assert sum(s.decode_s for s in model.flash_stats.steps[1:]) == 0  # the first call also decodes, to compare
    for x, y in zip(got, want):
        x, y = x.astype(mx.float32), y.astype(mx.float32)
        assert mx.abs(x - y).max().item() <= 0.02 * mx.abs(y).max().item()
    mx.eval(model(mx.array([list(range(20))])))  # more than 16 tokens: decoded by the CPU from the ring
    assert ran.count("endor_up") == 3 * len(TOKENS)
    pf.close()


@pytest.mark.parametrize("kinds, prefetch, want", [
    ({0: "sparse", 1: "sparse", 2: "sparse"}, False, set()),  # the next pass's layer 0 syncs first
    ({0: "sparse", 1: "resident", 2: "sparse", 3: "resident"}, False, set()),
    ({0: "resident", 1: "sparse"}, False, set()),  # the only one: its own next call syncs first
    ({0: "sparse", 1: "streamed", 2: "sparse"}, False, {0}),  # the streamed read refills the buffer first
    ({0: "sparse", 1: "streamed", 2: "sparse"}, True, set()),
    ({0: "streamed", 1: "sparse", 2: "sparse"}, False, {2}),  # the next pass starts by refilling it
    ({0: "encoded", 1: "resident", 2: "sparse"}, False, {2}),
    ({0: "streamed", 1: "sparse"}, True, set()),
    ({0: "resident", 1: "streamed"}, False, set()),
])
def test_only_sparse_layers_no_later_sync_covers_evaluate_their_output(kinds, prefetch, want):
    from mlx_flash.sparse.ffn import sparse_layers_to_eval

    assert sparse_layers_to_eval(kinds, prefetch) == want


# ------------------------------------------------------------------------------------------------
# The CPU kernel of a layer's FFN on its current rows (ops.sparse_ffn)


def _ffn_flags(model):
    return [layer.mlp._cpu_ffn for layer in model.layers]


def _without_ffn_kernel(model):
    for layer in model.layers:
        layer.mlp._cpu_ffn = False  # the MLP's row projections, op by op
    return model


@pytest.mark.skipif(not ops.EXTENSION_AVAILABLE, reason="CPU kernels not built")
@pytest.mark.parametrize("lookahead", [False, True])
def test_cats_pack_runs_its_sparse_ffns_on_one_kernel_call_bit_for_bit(tiny_llama, tmp_path, monkeypatch, lookahead):
    """A float16 CATS pack with a resident 4-bit gate (what convert --dtype float16 --gate-bits 4
    makes), caches smaller than the active set: cache rows, lookahead rows and overflow rows of a
    layer go to ops.sparse_ffn in one call, with the same logits as the MLP's ops, bit for bit."""
    host_decode(monkeypatch)
    from calibration_packs import decode_logits, tiny_cats_pack, write_text
    from mlx_flash import calibrate as calibrate_cli
    from mlx_flash.sparse import ffn

    pack = tiny_cats_pack(tiny_llama, tmp_path, [0.03, 0.05, 0.04, 0.06], dtype="float16", gate_bits=4)
    text = write_text(tmp_path / "t.txt", n_words=300, seed=0)
    assert calibrate_cli.main(["--model", str(pack), "--text", str(text), "--kind", "gate-threshold", "--quiet"]) == 0
    ids = [5, 17, 99, 3, 42, 7, 61, 12]

    def build():
        return build_flash_model(pack, FlashConfig("flash"), capacity={i: 12 for i in range(4)}, lookahead=lookahead)

    calls, masks = [], []
    monkeypatch.setattr(ffn, "sparse_ffn", lambda x, sets, *a: calls.append(len(sets)) or ops.sparse_ffn(x, sets, *a))
    monkeypatch.setattr(ffn, "active_mask", lambda g, *a: masks.append(g.shape) or ops.active_mask(g, *a))
    model = build()
    got = decode_logits(model, ids)
    assert _ffn_flags(model) == [True] * 4
    assert len(calls) == 4 * len(ids) and max(calls) >= 2  # one call per layer and token, over all row sets
    # the predictors' masks from the resident gate's output, and the lookahead's of the next
    # layer (pairs 0-1, 1-2, 2-3) from its estimated input: one op each
    assert len(masks) == (4 + 3 * lookahead) * len(ids)
    if lookahead:
        assert model.flash_runtime.ahead_used > 0
    want = decode_logits(_without_ffn_kernel(build()), ids)
    assert np.array_equal(got, want)
    # every neuron in one set: the kernel applies the CATS threshold itself
    dense = build_flash_model(pack, FlashConfig("dense"))
    assert np.array_equal(decode_logits(dense, ids),
                          decode_logits(_without_ffn_kernel(build_flash_model(pack, FlashConfig("dense"))), ids))
    assert _ffn_flags(dense) == [True] * 4


@pytest.mark.skipif(not ops.EXTENSION_AVAILABLE, reason="CPU kernels not built")
def test_product_pack_runs_its_sparse_ffns_on_one_kernel_call_bit_for_bit(tiny_llama, tmp_path, monkeypatch):
    """A float16 product-threshold pack (relufy --activation product) with a resident 4-bit gate
    and quant-glu predictors: each layer's rows go to ops.sparse_ffn ("product": h = silu(g) u
    where |h| > t) in one call, with the logits of the MLP's own ops, bit for bit; in dense mode too."""
    host_decode(monkeypatch)
    from calibration_packs import decode_logits, tiny_cats_pack, write_text
    from mlx_flash import calibrate as calibrate_cli
    from mlx_flash.sparse import ffn

    pack = tiny_cats_pack(tiny_llama, tmp_path, [0.004, 0.008, 0.006, 0.005], act="product", dtype="float16",
                          gate_bits=4)
    text = write_text(tmp_path / "t.txt", n_words=300, seed=0)
    assert calibrate_cli.main(["--model", str(pack), "--text", str(text), "--gate-bits", "8", "--quiet"]) == 0
    ids = [5, 17, 99, 3, 42, 7, 61, 12]

    def build(mode="flash"):
        return build_flash_model(pack, FlashConfig(mode), capacity={i: 12 for i in range(4)})

    calls = []
    monkeypatch.setattr(ffn, "sparse_ffn", lambda x, sets, *a: calls.append(a[1]) or ops.sparse_ffn(x, sets, *a))
    model = build()
    got = decode_logits(model, ids)
    assert _ffn_flags(model) == [True] * 4 and calls == ["product"] * (4 * len(ids))
    assert np.array_equal(got, decode_logits(_without_ffn_kernel(build()), ids))
    dense = build("dense")
    assert np.array_equal(decode_logits(dense, ids), decode_logits(_without_ffn_kernel(build("dense")), ids))
    assert _ffn_flags(dense) == [True] * 4


@pytest.mark.skipif(not ops.EXTENSION_AVAILABLE, reason="CPU kernels not built")
def test_every_mode_takes_the_ffn_kernel_and_keeps_the_dense_logits(tiny_llama, tmp_path):
    src = tiny_llama("src", layers=2, intermediate=96, dtype="float16")
    pack = write_pack(src, tmp_path / "pack", progress=False)
    dense = build_flash_model(pack, FlashConfig("dense"))
    want = run_steps(dense)
    assert _ffn_flags(dense) == [True, True]
    assert_identical(run_steps(_without_ffn_kernel(build_flash_model(pack, FlashConfig("dense")))), want)
    for model in (build_flash_model(pack, FlashConfig("naive")),
                  build_flash_model(pack, FlashConfig("flash"), predictors={i: all_neurons(96) for i in range(2)},
                                    capacity={0: 30, 1: 50})):
        got = run_steps(model)
        assert _ffn_flags(model) == [True, True]
        for x, y in zip(got, want):  # flash: cache rows and overflow rows summed as two parts
            assert mx.allclose(x, y, atol=4 * 2.0 ** -10 * mx.abs(y).max().item(), rtol=0).item()


@pytest.mark.skipif(not ops.EXTENSION_AVAILABLE, reason="CPU kernels not built")
def test_first_call_check_scales_with_the_sizes_of_the_sums_terms(tiny_llama, tmp_path, monkeypatch):
    """A kernel whose outputs are off by 1e-3 where the layer's outputs are ~1e-4: an absolute
    2e-2 floor passed it; the tolerance scaled by the down sums' term sizes refuses it and the
    layer keeps the MLP's output."""
    from mlx_flash.sparse import ffn

    src = tiny_llama("src", layers=2, intermediate=96, dtype="float16")
    pack = write_pack(src, tmp_path / "pack", progress=False)

    def build():
        model = build_flash_model(pack, FlashConfig("dense"))
        for layer in model.layers:  # tiny down rows: FFN outputs of ~1e-4
            rows = model.flash_runtime.caches[layer.mlp.layer].rows
            rows["down_t.weight"] = (rows["down_t.weight"] * 1e-3).astype(mx.float16)
        return model

    model = build()
    ffn_out = {}
    real = ffn.sparse_ffn

    def off(x, sets, *a):
        y = real(x, sets, *a)
        ffn_out["max"] = mx.abs(y).max().item()
        return y + 1e-3

    monkeypatch.setattr(ffn, "sparse_ffn", off)
    with pytest.warns(RuntimeWarning, match="CPU sparse FFN kernel"):
        got = run_steps(model)
    assert ffn_out["max"] < 2e-3 and _ffn_flags(model) == [False, False]
    monkeypatch.setattr(ffn, "sparse_ffn", real)
    assert_identical(got, run_steps(_without_ffn_kernel(build())))


@pytest.mark.skipif(not ops.EXTENSION_AVAILABLE, reason="CPU kernels not built")
@pytest.mark.parametrize("mode", ["dense", "flash"])
def test_a_prompts_first_call_checks_the_kernel_on_a_few_tokens_up_to_the_last(tiny_llama, tmp_path, monkeypatch,
                                                                                 mode):
    """A 21-token prompt's first call checks the FFN kernel against the MLP on CHECK_TOKENS of
    its tokens, the first and the last among them (not on all 21: a real prompt's first call spent
    seconds there); a kernel wrong at the last token only is refused, and the layer returns the
    MLP's output for every token, bit for bit as the MLP path."""
    from calibration_packs import tiny_cats_pack, write_text
    from mlx_flash import calibrate as calibrate_cli
    from mlx_flash.sparse import ffn

    pack = tiny_cats_pack(tiny_llama, tmp_path, [0.03, 0.05, 0.04, 0.06], dtype="float16", gate_bits=4)
    text = write_text(tmp_path / "t.txt", n_words=300, seed=0)
    assert calibrate_cli.main(["--model", str(pack), "--text", str(text), "--kind", "gate-threshold", "--quiet"]) == 0
    prompt = mx.array([[(7 * i + 3) % 120 for i in range(21)]])

    def build():
        if mode == "dense":
            return build_flash_model(pack, FlashConfig("dense"))
        return build_flash_model(pack, FlashConfig("flash"), capacity={i: 12 for i in range(4)})

    checked, real_sets = [], ffn.FlashFFN._mlp_sets

    def recorded(self, x, sets, *a, **k):
        checked.append(x.shape[-2])
        return real_sets(self, x, sets, *a, **k)

    monkeypatch.setattr(ffn.FlashFFN, "_mlp_sets", recorded)
    model = build()
    got = model(prompt, cache=make_prompt_cache(model))
    mx.eval(got)
    assert _ffn_flags(model) == [True] * 4 and checked == [ffn.CHECK_TOKENS] * 4
    monkeypatch.setattr(ffn.FlashFFN, "_mlp_sets", real_sets)
    plain = _without_ffn_kernel(build())
    assert mx.array_equal(got, plain(prompt, cache=make_prompt_cache(plain))).item()
    real = ffn.sparse_ffn

    def wrong_at_the_last_token(x, sets, *a):
        y = real(x, sets, *a)
        return y + mx.concatenate([mx.zeros_like(y[..., :-1, :]), mx.ones_like(y[..., -1:, :])], axis=-2)

    monkeypatch.setattr(ffn, "sparse_ffn", wrong_at_the_last_token)
    model = build()
    with pytest.warns(RuntimeWarning, match="CPU sparse FFN kernel"):
        got = model(prompt, cache=make_prompt_cache(model))
        mx.eval(got)
    assert _ffn_flags(model) == [False] * 4
    plain = _without_ffn_kernel(build())
    assert mx.array_equal(got, plain(prompt, cache=make_prompt_cache(plain))).item()


def test_cache_fill_and_overflow_are_read_in_one_planned_call_bit_for_bit(tiny_llama, tmp_path, monkeypatch):
    """A layer whose cache fill and overflow are both there reads them in one loader call of one
    read plan (their bundles interleave; planned apart, each reads through the other's gaps): the
    logits are those of the fill and overflow read apart, bit for bit, and the fill lands in its
    cache rows."""
    host_decode(monkeypatch)
    from mlx_flash.io import host_bytes
    from mlx_flash.pack import read_layer_components
    from mlx_flash.sparse.ffn import FlashFFN

    src = tiny_llama("src", layers=2, intermediate=N, dtype="float16")
    pack = write_pack(src, tmp_path / "pack", progress=False)
    layers = {i: {"kind": "gate-threshold", "n_neurons": N, "rank": 0, "threshold": 0.02,
                  "prob_threshold": 0.5, "stats": {}, "capacity": [6] * 4} for i in range(2)}
    save_predictors(pack, {"activation": "silu"}, layers, {})
    real, joint = FlashFFN._read_fill_and_overflow, []

    def counted(self, cache, upd, step):
        pieces, first = real(self, cache, upd, step)
        joint.append(first is not None)
        return pieces, first

    monkeypatch.setattr(FlashFFN, "_read_fill_and_overflow", counted)
    model = build_flash_model(pack, FlashConfig("flash", window=1))
    calls = []
    real_read_many = model.flash_runtime.loader.read_many
    model.flash_runtime.loader.read_many = lambda requests: calls.append(len(requests)) or real_read_many(requests)
    got = run_steps(model)
    for layer, cache in model.flash_runtime.caches.items():  # every cached row holds its bundle
        rows = read_layer_components(pack, read_manifest(pack).bundles[layer])
        cache.check({name: host_bytes(a).reshape(N, -1) for name, a in rows.items() if name in cache.rows})
    # the prompt's layers (and a decode step's) had both; every layer read in one request
    assert joint[:2] == [True, True] and sum(joint) >= 3 and all(n == 1 for n in calls)

    def apart(self, cache, upd, step):  # no staging room for a joint plan: fill and overflow read apart
        saved, cache.max_read_bytes = cache.max_read_bytes, 0
        try:
            return real(self, cache, upd, step)
        finally:
            cache.max_read_bytes = saved

    monkeypatch.setattr(FlashFFN, "_read_fill_and_overflow", apart)
    assert_identical(got, run_steps(build_flash_model(pack, FlashConfig("flash", window=1))))


@pytest.mark.parametrize("rows,want", [(6, "streaming buffer"), (N, "fill")])
def test_decode_reads_go_to_their_rows_in_one_kernel_call_bit_for_bit(tiny_llama, tmp_path, monkeypatch, rows,
                                                                      want):
    """A layer's reads of a call (cache fill only, overflow only, or both: the fill read beside the
    overflow, then copied into its cache rows) are one FlashLoader.read_at_once call when it takes
    them: every cached row holds its bundle and the logits are those of the planned path
    (read_at_once not taken), bit for bit."""
    host_decode(monkeypatch)
    from mlx_flash.io import FlashLoader, host_bytes
    from mlx_flash.pack import read_layer_components

    src = tiny_llama("src", layers=2, intermediate=N, dtype="float16")
    pack = write_pack(src, tmp_path / "pack", progress=False)
    layers = {i: {"kind": "gate-threshold", "n_neurons": N, "rank": 0, "threshold": 0.02,
                  "prob_threshold": 0.5, "stats": {}, "capacity": [rows] * 4} for i in range(2)}
    save_predictors(pack, {"activation": "silu"}, layers, {})
    real, taken = FlashLoader.read_at_once, []

    def counted(self, layer, ids, dest, slots=None, max_bytes=None):
        stats = real(self, layer, ids, dest, slots, max_bytes)
        if stats is not None:
            taken.append("fill" if dest is model.flash_runtime.caches[layer].rows else "streaming buffer")
        return stats

    monkeypatch.setattr(FlashLoader, "read_at_once", counted)
    model = build_flash_model(pack, FlashConfig("flash", window=1))
    monkeypatch.setattr(model.flash_runtime.loader, "read_many", lambda *a: pytest.fail("read_many ran"))
    got = run_steps(model)
    if not taken:
        pytest.skip("filesystem refuses O_DIRECT (read_at_once takes direct reads only)")
    # small caches: fills read beside an overflow, then copied in; caches of every row: fills alone
    assert want in taken and (model.flash_runtime.fill_copied > 0) == (want == "streaming buffer")
    for layer, cache in model.flash_runtime.caches.items():  # every cached row holds its bundle
        rows = read_layer_components(pack, read_manifest(pack).bundles[layer])
        cache.check({name: host_bytes(a).reshape(N, -1) for name, a in rows.items() if name in cache.rows})
    monkeypatch.setattr(FlashLoader, "read_at_once", lambda *a, **k: None)
    assert_identical(got, run_steps(build_flash_model(pack, FlashConfig("flash", window=1))))


def test_a_joint_plan_over_the_staging_limit_by_its_gaps_is_still_one_call_bit_for_bit(tiny_llama, tmp_path,
                                                                                        monkeypatch):
    """When the joint fill + overflow plan stages more than the limit only through the gaps its
    merges read across, the layer still reads in one loader call (its merges cut back to the
    limit), within the limit, and the logits are those of unlimited reads, bit for bit."""
    host_decode(monkeypatch)
    from mlx_flash.io.planner import ReadCost
    from mlx_flash.sparse.ffn import FlashFFN

    src = tiny_llama("src", layers=2, intermediate=4 * N, dtype="float16")
    pack = write_pack(src, tmp_path / "pack", progress=False)
    layers = {i: {"kind": "gate-threshold", "n_neurons": 4 * N, "rank": 0, "threshold": 0.02,
                  "prob_threshold": 0.5, "stats": {}, "capacity": [24] * 4} for i in range(2)}
    save_predictors(pack, {"activation": "silu"}, layers, {})
    real, squeezed = FlashFFN._read_fill_and_overflow, []

    def limited(self, cache, upd, step):  # a limit between the bundles' own reads and the merged plan
        rt = self._rt
        ids = np.concatenate([upd.overflow, upd.fill if upd.fill is not None else upd.overflow[:0]])
        plan = rt.loader.plan(self.layer, ids)
        a0 = plan.starts // plan.align * plan.align
        a1 = -(-(plan.starts + plan.lengths) // plan.align) * plan.align
        own = int((a1 - a0).sum()) + int(np.minimum(a0[1:] - a1[:-1], 0).sum())
        if not (len(upd.overflow) and len(ids) > len(upd.overflow) and own < plan.read_bytes):
            return real(self, cache, upd, step)
        rt.max_read_bytes = cache.max_read_bytes = limit = (own + plan.read_bytes) // 2
        calls, read_many = [], rt.loader.read_many
        rt.loader.read_many = lambda requests: calls.append(
            sum(int((r[1].r1 - r[1].r0).sum()) for r in requests)) or read_many(requests)
        try:
            pieces, first = real(self, cache, upd, step)
        finally:
            rt.max_read_bytes = cache.max_read_bytes = None
            del rt.loader.read_many
        squeezed.append((first is not None, calls, limit))
        return pieces, first

    monkeypatch.setattr(FlashFFN, "_read_fill_and_overflow", limited)
    model = build_flash_model(pack, FlashConfig("flash", window=1))
    loader = model.flash_runtime.loader
    loader.cost = ReadCost(1e-3, 1e8)  # a merge gap of many bundles: merges read across gaps
    loader.direct, loader._open_files = False, {}  # byte-aligned reads: every gap shows
    got = run_steps(model)
    assert squeezed and all(one and len(calls) == 1 and calls[0] <= limit for one, calls, limit in squeezed)
    monkeypatch.setattr(FlashFFN, "_read_fill_and_overflow", real)
    model = build_flash_model(pack, FlashConfig("flash", window=1))
    assert_identical(got, run_steps(model))


DECODE_KERNEL = ops.decode_kernel_enabled({})
DECODE_IDS = [5, 17, 99, 3, 42, 7, 61, 12, 200, 31]


def decode_pack(tiny_llama, tmp_path, act):
    """A float16 CATS (gate-threshold predictors) or product (quant-glu) pack with a resident 4-bit gate."""
    from calibration_packs import tiny_cats_pack, write_text
    from mlx_flash import calibrate as calibrate_cli

    thresholds = [0.03, 0.05, 0.04, 0.06] if act == "cats" else [0.004, 0.008, 0.006, 0.005]
    pack = tiny_cats_pack(tiny_llama, tmp_path, thresholds, act=act, dtype="float16", gate_bits=4)
    text = write_text(tmp_path / "t.txt", n_words=300, seed=0)
    flags = ["--kind", "gate-threshold"] if act == "cats" else ["--gate-bits", "8"]
    assert calibrate_cli.main(["--model", str(pack), "--text", str(text), *flags, "--quiet"]) == 0
    return pack


def decode_run(pack, monkeypatch, kernel: bool, capacity: int, limits=None, lookahead=False):
    """(logits, {layer: (ids, rows, num_used)}, per-step counters, model, read log) of DECODE_IDS
    decoded one token per pass on the decode kernel or the per-layer path, its reads logged by
    bench run's LoggedReads; limits: (overflow rows, staged bytes) of an overflow piece.
    Per-step counters: needed, hits, loaded, bytes and window from the stats, then the bundles and
    bytes the read log holds for the step, and the layers."""
    from calibration_packs import decode_logits

    from mlx_flash.bench.measure import LoggedReads

    monkeypatch.setenv("MLX_FLASH_DECODE_KERNEL", "1" if kernel else "0")
    model = build_flash_model(pack, FlashConfig("flash", window=2), capacity={i: capacity for i in range(4)},
                              lookahead=lookahead)
    rt = model.flash_runtime
    if limits:
        rt.overflow_rows, rt.max_read_bytes = limits
    rt.loader = reads = LoggedReads(rt.loader, model.flash_stats, rt.caches)
    for cache in rt.caches.values():
        cache.loader = reads
    logits = decode_logits(model, DECODE_IDS)
    caches = {i: (c.ids.copy(), [h.copy() for h in c.host_rows], c.num_used) for i, c in rt.caches.items()}
    model.flash_stats.finish()
    logged = [(sum(r[2] for r in reads.log if r[0] == i), sum(r[3] for r in reads.log if r[0] == i))
              for i in range(len(model.flash_stats.steps))]
    counts = [(s.neurons_needed, s.hits, s.neurons_loaded, s.bytes_read, s.window, *log, sorted(s.layers))
              for s, log in zip(model.flash_stats.steps, logged)]
    return logits, caches, counts, model, reads.log


def warm_decode_model(pack):
    """A flash model of `pack` (3 cache rows a layer) and a prompt cache that decoded DECODE_IDS[:4]
    one token a pass: past each layer's first call (the kernel's check against the MLP)."""
    model = build_flash_model(pack, FlashConfig("flash", window=2), capacity={i: 3 for i in range(4)})
    cache = make_prompt_cache(model)
    for t in DECODE_IDS[:4]:
        mx.eval(model(mx.array([[t]]), cache=cache))
    return model, cache


@pytest.mark.skipif(not DECODE_KERNEL, reason="no sparse-decode kernel (CPU kernels not built, or not Linux AIO)")
def test_closing_the_runtime_first_runs_the_lazy_pass_left_on_another_stream(tiny_llama, tmp_path, monkeypatch):
    """A decode pass left unevaluated on a stream of its own (mlx-lm's generate leaves the token
    after the last one it yields so), then the runtime closed (the model dropped: its finalizer):
    the pass runs before the files and AIO contexts it reads from close, so its logits are those of
    the pass evaluated first."""
    monkeypatch.setenv("MLX_FLASH_DECODE_KERNEL", "1")
    pack = decode_pack(tiny_llama, tmp_path, "cats")

    def run(lazy):
        model, cache = warm_decode_model(pack)
        with mx.stream(mx.new_stream(mx.cpu)):
            a = model(mx.array([[DECODE_IDS[4]]]), cache=cache)
        if not lazy:
            mx.eval(a)
        model.flash_runtime.close()
        return np.array(a.astype(mx.float32))

    assert np.array_equal(run(True), run(False))


@pytest.mark.skipif(not DECODE_KERNEL, reason="no sparse-decode kernel (CPU kernels not built, or not Linux AIO)")
@pytest.mark.parametrize("act,capacity,limits", [("cats", 0, None), ("cats", 3, None), ("cats", 12, None),
                                                 ("cats", 96, None), ("cats", 3, (5, 8192)), ("cats", 3, (96, 4096)),
                                                 ("product", 12, None), ("product", 3, (7, 4096))])
def test_decode_kernel_runs_a_sparse_layers_token_in_one_primitive_bit_for_bit(tiny_llama, tmp_path, monkeypatch,
                                                                               act, capacity, limits):
    """After a layer's first call (the kernel's check), each decode token of a sparse layer is one
    ops.sparse_decode primitive: no loader call from Python, and the logits, every neuron cache's
    ids and rows, and each step's counters (needed, hits, loaded, window) equal the per-layer
    path's, bit for bit, and so do the bytes it reads: caches of no rows, a few, some and all, the
    window expiring rows, overflow read and computed in pieces (a few rows, a few KiB each), and a
    fill beside an overflow whose joint read would stage more than the limit."""
    from mlx_flash.io import FlashLoader, host_bytes
    from mlx_flash.pack import read_layer_components
    from mlx_flash.sparse import ffn

    pack = decode_pack(tiny_llama, tmp_path, act)
    want = decode_run(pack, monkeypatch, False, capacity, limits)
    calls = []  # "decode" per primitive, "read" per loader call from Python
    monkeypatch.setattr(ffn, "sparse_decode", lambda *a: calls.append("decode") or ops.sparse_decode(*a))
    for name in ("read", "read_many", "read_at_once"):
        real = getattr(FlashLoader, name)
        monkeypatch.setattr(FlashLoader, name, lambda self, *a, _real=real, **k: calls.append("read") or _real(self, *a, **k))
    got = decode_run(pack, monkeypatch, True, capacity, limits)
    decoded = calls[calls.index("decode"):]  # after the first token: primitives only
    assert decoded == ["decode"] * 4 * (len(DECODE_IDS) - 1)
    assert np.array_equal(got[0], want[0])
    for i, (ids, rows, used) in want[1].items():
        assert got[1][i][2] == used and np.array_equal(got[1][i][0], ids)
        assert all(np.array_equal(a, b) for a, b in zip(got[1][i][1], rows))
    assert got[2] == want[2]
    # what bench run's accounting adds up: the log's bundles and bytes per step (in counts), the
    # rows each cache filled, those logged into cache rows and those copied from beside an overflow
    filled = []
    for run in (want, got):
        rt = run[3].flash_runtime
        filled.append((sum(c.rows_loaded for c in rt.caches.values()), rt.fill_copied))
        assert filled[-1][0] == sum(r[2] for r in run[4] if r[7]) + rt.fill_copied
    assert filled[0] == filled[1]
    # the primitive's reads are counted as reads inside evaluations, the per-layer path's are not
    assert sum(s.io_eval_s for s in want[3].flash_stats.steps) == 0
    assert (sum(s.io_eval_s for s in got[3].flash_stats.steps) > 0) == any(c[3] for c in got[2][1:])
    for layer, cache in got[3].flash_runtime.caches.items():  # every cached row holds its bundle
        bundles = read_layer_components(pack, read_manifest(pack).bundles[layer])
        cache.check({name: host_bytes(a).reshape(96, -1) for name, a in bundles.items() if name in cache.rows})


@pytest.mark.skipif(not DECODE_KERNEL, reason="no sparse-decode kernel (CPU kernels not built, or not Linux AIO)")
def test_closing_the_runtime_closes_the_files_when_the_lazy_pass_fails(tiny_llama, tmp_path, monkeypatch):
    """The lazy pass that closing runs reads a corrupt pack: its error is raised (a BAD_PACK
    RuntimeError, as an evaluation raises it), after the AIO contexts and files are closed."""
    from mlx_flash.errors import BAD_PACK

    monkeypatch.setenv("MLX_FLASH_DECODE_KERNEL", "1")
    pack = decode_pack(tiny_llama, tmp_path, "cats")
    model, cache = warm_decode_model(pack)
    for f in sorted((pack / "bundles").iterdir()):  # every byte flipped: any read fails its crc32
        f.write_bytes(bytes(b ^ 0xFF for b in f.read_bytes()))
    with mx.stream(mx.new_stream(mx.cpu)):
        model(mx.array([[DECODE_IDS[4]]]), cache=cache)
    loader = model.flash_runtime.loader
    with pytest.raises(RuntimeError, match=BAD_PACK):
        model.flash_runtime.close()
    assert not loader._open_files and not loader._aio_contexts


@pytest.mark.skipif(not DECODE_KERNEL, reason="no sparse-decode kernel (CPU kernels not built, or not Linux AIO)")
def test_a_pass_on_another_stream_waits_for_the_lazy_pass_before_it(tiny_llama, tmp_path, monkeypatch):
    """A decode pass leaves its token unevaluated (its primitives not yet run); the next pass, on
    another stream and not built on it (mlx-lm's generate runs on a stream of its own, a new prompt
    then on the default one), must not update the neuron caches before it ran: the same logits as
    with the first pass evaluated first."""
    monkeypatch.setenv("MLX_FLASH_DECODE_KERNEL", "1")
    pack = decode_pack(tiny_llama, tmp_path, "cats")

    def run(lazy):
        model, first = warm_decode_model(pack)
        second = make_prompt_cache(model)
        mx.eval(model(mx.array([DECODE_IDS[4:8]]), cache=second))
        with mx.stream(mx.new_stream(mx.cpu)):
            a = model(mx.array([[DECODE_IDS[8]]]), cache=first)
        if not lazy:
            mx.eval(a)
        b = model(mx.array([DECODE_IDS[:6]]), cache=second)  # a prompt: the per-layer path's host updates
        mx.eval(a, b)
        return model, [np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))]

    model, got = run(True)
    assert model.model.layers[3].mlp.decoder_ready()
    want = run(False)[1]
    assert all(np.array_equal(g, w) for g, w in zip(got, want))


@pytest.mark.skipif(not DECODE_KERNEL, reason="no sparse-decode kernel (CPU kernels not built, or not Linux AIO)")
@pytest.mark.parametrize("act,capacity,limits", [("cats", 0, None), ("cats", 3, None), ("cats", 12, None),
                                                 ("cats", 3, (5, 8192)), ("product", 12, None)])
def test_decode_kernel_reads_the_next_layers_neurons_ahead_as_the_per_layer_path_does(tiny_llama, tmp_path,
                                                                                     monkeypatch, act, capacity,
                                                                                     limits):
    """With lookahead on, each decode primitive starts reading the next sparse layer's predicted
    neurons once its own reads are in, and the next layer's primitive takes those it needs (cache
    fills copied, overflow computed from the lookahead buffer): the logits and every cache's ids
    and rows equal the per-layer path's with lookahead, bit for bit, and so do each step's
    counters (needed, hits, loaded, bytes, window) and the lookahead's (read, used, copied); both
    paths' reads, lookahead included, are all in bench run's read log."""
    pack = decode_pack(tiny_llama, tmp_path, act)
    want = decode_run(pack, monkeypatch, False, capacity, limits, lookahead=True)
    got = decode_run(pack, monkeypatch, True, capacity, limits, lookahead=True)
    assert np.array_equal(got[0], want[0])
    for i, (ids, rows, used) in want[1].items():
        assert got[1][i][2] == used and np.array_equal(got[1][i][0], ids)
        assert all(np.array_equal(a, b) for a, b in zip(got[1][i][1], rows))
    assert [c[:5] for c in got[2]] == [c[:5] for c in want[2]]
    rts = [run[3].flash_runtime for run in (want, got)]
    assert [(rt.ahead_read, rt.ahead_used, rt.ahead_copied) for rt in rts][0] == \
        (rts[1].ahead_read, rts[1].ahead_used, rts[1].ahead_copied)
    if act == "cats":  # (the product pack's plan holds no lookahead buffers: the primitives read nothing ahead)
        assert rts[1].ahead_read > 0 and 0 < rts[1].ahead_used <= rts[1].ahead_read
        assert rts[1]._decode_ahead is not None and not rts[1].ahead  # the primitives read ahead, not Python
    assert rts[1].ahead_read > 0 or not rts[1].lookahead
    # the decode tokens' reads (after the first, per-layer, token) are logged as the stats count
    # them, and each cache row filled was read into it, or copied from beside an overflow or from
    # the lookahead's buffer
    first = len(got[2]) - len(DECODE_IDS) + 1
    assert [c[2:4] for c in got[2][first:]] == [c[5:7] for c in got[2][first:]]
    assert [c[2:4] for c in want[2]] == [c[5:7] for c in want[2]]  # the per-layer path's lookahead reads too
    filled = sum(c.rows_loaded for c in rts[1].caches.values())
    cache_logged = sum(r[2] for r in got[4] if r[7] and r[0] >= first)
    assert filled - sum(c.rows_loaded for c in rts[0].caches.values()) == 0
    assert cache_logged + rts[1].fill_copied + rts[1].ahead_copied <= filled


@pytest.mark.skipif(not DECODE_KERNEL, reason="no sparse-decode kernel (CPU kernels not built, or not Linux AIO)")
def test_decode_kernel_names_the_file_of_a_bundle_that_fails_its_checksum(tiny_llama, tmp_path, monkeypatch):
    """Bundles whose bytes no longer match their crc32 stop the decode kernel's token where it is
    evaluated, with MLX's RuntimeError naming the pack file and the bundle: the FlashError a CLI
    prints as its one-line error (exit 2)."""
    from mlx_flash.errors import from_kernel
    from test_io_loader import corrupt_bundle

    pack = decode_pack(tiny_llama, tmp_path, "cats")
    monkeypatch.setenv("MLX_FLASH_DECODE_KERNEL", "1")
    model = build_flash_model(pack, FlashConfig("flash", window=2), capacity={i: 3 for i in range(4)})
    cache = make_prompt_cache(model)
    for t in DECODE_IDS[:2]:
        mx.eval(model(mx.array([[t]]), cache=cache))
    entry = read_manifest(pack)["bundles"][1]
    for bundle in range(96):
        corrupt_bundle(pack, bundle, layer=1)
    with pytest.raises(RuntimeError) as raised:
        mx.eval(model(mx.array([[DECODE_IDS[2]]]), cache=cache))
    error = from_kernel(raised.value)
    assert isinstance(error, FlashError)
    assert re.fullmatch(rf"\S+/{entry['file']}: checksum mismatch in bundle \d+ \(offset \d+\)", str(error))
