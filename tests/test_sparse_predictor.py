"""sparse/predictor: the predictors file format (save, load, checks) and each kind's mask rule."""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_flash.errors import FlashError
from mlx_flash.pack.schema import write_metadata
from mlx_flash.pack import write_pack
from mlx_flash.sparse.predictor import (PREDICTORS_FILE, PREDICTORS_JSON, LayerPredictor,
                                        calibrated_capacity, load_predictors, save_predictors)


@pytest.fixture
def pack(tiny_llama, tmp_path):
    return write_pack(tiny_llama("src"), tmp_path / "pack", progress=False)  # 2 layers, 96 neurons


def low_rank_factors(rank=4, hidden=64, n=96, seed=0):
    k = mx.random.split(mx.random.key(seed), 3)
    return {"A": mx.random.normal((rank, hidden), key=k[0]), "B": mx.random.normal((n, rank), key=k[1]),
            "bias": mx.random.normal((n,), key=k[2])}


def entry(kind, rank=0, capacity=(10, 20, 30), **kw):
    return {"kind": kind, "n_neurons": 96, "rank": rank, "threshold": kw.get("threshold", 0.0),
            "prob_threshold": kw.get("prob_threshold", 0.5), "cut": kw.get("cut", 0.0),
            "stats": {"recall": 1.0}, "capacity": list(capacity)}


def test_round_trip_low_rank_and_gate_threshold(pack):
    f = low_rank_factors()
    save_predictors(pack, {"activation": "silu"},
                    {0: entry("low-rank", 4, prob_threshold=0.7), 1: entry("gate-threshold", threshold=0.2)},
                    {0: f})
    preds = load_predictors(pack)
    x = mx.random.normal((3, 64), key=mx.random.key(9))
    p0, p1 = preds[0], preds[1]
    assert (p0.kind, p0.rank, p1.kind) == ("low-rank", 4, "gate-threshold")
    # low-rank: sigmoid(B A x + bias) > 0.7 with the float16 factors that were stored
    a, b, bias = (f[k].astype(mx.float16).astype(mx.float32) for k in ("A", "B", "bias"))
    z = (x.astype(mx.float16).astype(mx.float32) @ a.T) @ b.T + bias
    want = np.array(mx.sigmoid(z)) > 0.7
    got = np.array(p0(x))
    assert (got == want).mean() > 0.99  # float16 matmul rounding may flip a borderline neuron
    assert p0.nbytes == sum(v.astype(mx.float16).nbytes for v in f.values())
    # gate-threshold: the pack's own gate rows, exactly |silu(gate x)| > 0.2
    from mlx_flash.pack import load_pack_weights

    _, weights = load_pack_weights(pack)
    gate = weights["model.layers.1.mlp.gate_proj.weight"]
    want = np.array(mx.abs(nn.silu(x @ gate.T)) > 0.2)
    assert np.array_equal(np.array(p1(x)), want)
    assert p1.nbytes == gate.nbytes


def test_resident_gate_predictor_takes_the_models_gate_without_reading_the_resident_file(
        tiny_llama, tmp_path, monkeypatch):
    """convert --gate-bits: the gate-threshold predictor's rows are the model's resident gate, given
    by the model loader (share_gate); load_predictors does not open resident.safetensors again
    and reads manifest.json once."""
    from mlx_flash.pack import load_resident

    pack = write_pack(tiny_llama("src"), tmp_path / "pack", gate_bits=4, progress=False)
    save_predictors(pack, {"activation": "silu"}, {i: entry("gate-threshold", threshold=0.2) for i in range(2)}, {})
    import mlx_flash.sparse.predictor as P

    loaded, load, manifests, read_manifest = [], mx.load, [], P.read_manifest
    monkeypatch.setattr(mx, "load", lambda path, *a, **k: loaded.append(str(path)) or load(path, *a, **k))
    monkeypatch.setattr(P, "read_manifest", lambda path: manifests.append(path) or read_manifest(path))
    preds = load_predictors(pack)
    assert not [p for p in loaded if p.endswith("resident.safetensors")], loaded
    assert len(manifests) == 1  # checked against and read from one parse of manifest.json
    p1, x = preds[1], mx.random.normal((3, 64), key=mx.random.key(9))
    assert p1.resident_gate and p1.nbytes == 0
    with pytest.raises(FlashError, match="layer 1: .*share_gate"):
        p1(x)
    weights = load_resident(pack)[1]
    gate = {k: weights[f"model.layers.1.mlp.gate_proj.{k}"] for k in ("weight", "scales", "biases")}
    p1.share_gate(gate)
    assert p1._t["gate.weight"] is gate["weight"]  # the model's array, no copy
    dense_gate = mx.dequantize(gate["weight"], gate["scales"], gate["biases"], group_size=32, bits=4)
    got, want = np.array(p1(x)), np.array(mx.abs(nn.silu(x @ dense_gate.T)) > 0.2)
    assert (got == want).mean() > 0.99  # 4-bit kernel vs dequantized matmul: a borderline neuron may flip


def test_low_rank_gate_and_all_rules(pack):
    f = low_rank_factors(seed=1)
    save_predictors(pack, {"activation": "silu"},
                    {0: entry("low-rank-gate", 4, cut=0.3), 1: entry("all")}, {0: f})
    preds = load_predictors(pack)
    x = mx.random.normal((2, 5, 64), key=mx.random.key(3))
    est = np.array(preds[0].gate_estimate(x))
    assert np.array_equal(np.array(preds[0](x)), np.abs(est) > 0.3)
    assert np.array(preds[1](x)).all() and preds[1](x).shape == (2, 5, 96)


def test_capacity_window_lookup_and_extrapolation(pack):
    save_predictors(pack, {"activation": "silu"}, {0: entry("all", capacity=(10, 20, 25)),
                                                   1: entry("all", capacity=(90, 95, 96))}, {})
    assert calibrated_capacity(pack, 2) == {0: 20, 1: 95}
    assert calibrated_capacity(pack, 5) == {0: 35, 1: 96}  # last increment, capped at n
    with pytest.raises(FlashError, match="window 0"):
        calibrated_capacity(pack, 0)


def test_missing_and_corrupt_files(pack):
    assert load_predictors(pack) is None
    with pytest.raises(FlashError, match="predictors.json: missing; run python -m mlx_flash.calibrate"):
        calibrated_capacity(pack, 5)
    save_predictors(pack, {"activation": "silu"}, {0: entry("low-rank", 4), 1: entry("low-rank", 4)},
                    {0: low_rank_factors(), 1: low_rank_factors(seed=2)})
    st = pack / PREDICTORS_FILE
    raw = bytearray(st.read_bytes())
    raw[-3] ^= 0xFF
    st.write_bytes(bytes(raw))
    with pytest.raises(FlashError, match="checksum mismatch"):
        load_predictors(pack)
    js = pack / PREDICTORS_JSON
    doc = json.loads(js.read_text())
    doc["layers"]["0"]["threshold"] = 0.5  # an edit without a new checksum
    js.write_text(json.dumps(doc))
    with pytest.raises(FlashError, match="metadata_crc32 does not match"):
        load_predictors(pack)
    doc["layers"]["0"]["threshold"] = 0.0
    doc["pack_resident_crc32"] += 1
    write_metadata(js, doc)
    with pytest.raises(FlashError, match="calibrated for a different pack"):
        load_predictors(pack)
    doc["pack_resident_crc32"] -= 1
    doc["layers"]["0"]["kind"] = "magic"
    write_metadata(js, doc)
    with pytest.raises(FlashError, match=r"layers\['0'\].kind = 'magic' is not one of"):
        load_predictors(pack)
    del doc["layers"]["1"]
    doc["layers"]["0"]["kind"] = "all"
    write_metadata(js, doc)
    with pytest.raises(FlashError, match="do not match the pack's 2 FFN layers"):
        load_predictors(pack)
    js.write_text("{not json")
    with pytest.raises(FlashError, match=r"predictors\.json: not JSON \("):
        load_predictors(pack)


def test_factor_shapes_checked(pack):
    save_predictors(pack, {"activation": "silu"}, {0: entry("low-rank", 8), 1: entry("all")},
                    {0: low_rank_factors(rank=4)})
    with pytest.raises(FlashError, match="layer 0 factors do not match rank 8"):
        load_predictors(pack)


def test_flash_mode_without_predictors_points_at_calibrate(pack):
    import mlx_flash

    with pytest.raises(FlashError, match="python -m mlx_flash.calibrate --model"):
        mlx_flash.load(str(pack), mode="flash")


def test_unknown_kind_refused():
    with pytest.raises(FlashError, match="unknown kind"):
        LayerPredictor(0, "psychic", 8)


def test_gate_threshold_on_a_resident_gate_shares_the_models_arrays(tiny_llama, tmp_path):
    from mlx_flash.config import FlashConfig
    from mlx_flash.models.flash import build_flash_model

    pack = write_pack(tiny_llama("src"), tmp_path / "gated", gate_bits=4, progress=False)
    save_predictors(pack, {"activation": "silu"}, {i: entry("gate-threshold", threshold=0.05) for i in range(2)}, {})
    preds = load_predictors(pack)
    assert all(p.resident_gate and p.nbytes == 0 for p in preds.values())  # counted as resident
    model = build_flash_model(pack, FlashConfig("flash"))
    for i, layer in enumerate(model.model.layers):
        held = layer.mlp._current.resident_gate
        assert model.flash_runtime.predictors[i]._t["gate.weight"] is held["weight"]


def test_a_product_threshold_model_takes_no_gate_based_kind(pack):
    """relufy --activation product keeps neuron i by |silu(g_i) u_i|: a predictors.json that masks
    it by the gate (gate-threshold, low-rank-gate, quant-gate) is refused by field; low-rank loads."""
    # (calibrate writes each layer's activation: silu, thresholded on the product)
    save_predictors(pack, {"activation": "product"}, {i: {**entry("low-rank", 4), "activation": "silu"}
                                                      for i in range(2)},
                    {i: low_rank_factors(seed=i) for i in range(2)})
    assert {p.kind for p in load_predictors(pack).values()} == {"low-rank"}
    save_predictors(pack, {"activation": "product"},
                    {i: {**entry("gate-threshold", threshold=0.05), "activation": "silu"} for i in range(2)}, {})
    with pytest.raises(FlashError, match=r"kind = 'gate-threshold': a product-threshold model's mask"):
        load_predictors(pack)


def test_quant_glu_scores_the_product_of_its_quantized_gate_and_up(pack):
    """quant-glu: mask = |silu(g_q x) * u_q x| > cut with 4-bit copies of gate and up; a copy whose
    rows do not match the layer is refused by file, and so is quant-glu outside a product model."""
    from mlx_flash.calibration.fit import quantized_copy

    class Rows:
        def __init__(self, seed):
            k = mx.random.split(mx.random.key(seed), 2)
            self.gate = nn.Linear(64, 96, bias=False)
            self.up = nn.Linear(64, 96, bias=False)
            self.gate.weight = mx.random.normal((96, 64), key=k[0]) / 8
            self.up.weight = mx.random.normal((96, 64), key=k[1]) / 8

    rows = [Rows(i) for i in range(2)]
    glu = {"kind": "quant-glu", "bits": 4, "group_size": 32, "activation": "silu", "cut": 0.05}
    save_predictors(pack, {"activation": "product"}, {i: {**entry("quant-glu", cut=0.05), **glu} for i in range(2)},
                    {i: quantized_copy(r, 4, roles=("gate", "up")) for i, r in enumerate(rows)})
    preds = load_predictors(pack)
    x = mx.random.normal((2, 5, 64), key=mx.random.key(3))
    t = preds[0]._t
    g = mx.dequantize(t["gate.weight"], t["gate.scales"], t["gate.biases"], 32, 4)
    u = mx.dequantize(t["up.weight"], t["up.scales"], t["up.biases"], 32, 4)
    want = np.abs(np.array(nn.silu(x @ g.T) * (x @ u.T))) > 0.05
    got = np.array(preds[0](x))
    assert 0.05 < want.mean() < 0.95 and (got == want).mean() > 0.99  # the kernel's rounding aside
    save_predictors(pack, {"activation": "silu"}, {i: {**entry("quant-glu", cut=0.05), **glu} for i in range(2)},
                    {i: quantized_copy(r, 4, roles=("gate", "up")) for i, r in enumerate(rows)})
    with pytest.raises(FlashError, match="only for a product-threshold model"):
        load_predictors(pack)
    save_predictors(pack, {"activation": "product"}, {i: {**entry("quant-glu", cut=0.05), **glu} for i in range(2)},
                    {i: quantized_copy(r, 4) for i, r in enumerate(rows)})  # the up copy left out
    with pytest.raises(FlashError, match="missing tensor layers.0.up.weight"):
        load_predictors(pack)
