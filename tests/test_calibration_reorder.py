"""calibration/reorder (calibrate --reorder): co-activation order applied to a relufied tiny pack
keeps dense and flash logits, and reads fewer bytes for the same neurons."""

import json

import numpy as np
import pytest

from calibration_packs import decode_logits, write_byte_tokenizer, write_text
from mlx_flash import calibrate as calibrate_cli
from mlx_flash.calibration import relufication as R
from mlx_flash.calibration.dense_pass import collect_inputs
from mlx_flash.calibration.quality import load_mode
from mlx_flash.calibration.reorder import compare_orders
from mlx_flash.pack import read_manifest, write_pack

IDS = [5, 17, 99, 3, 42, 7, 61]


@pytest.fixture
def relufied_pack(tiny_llama, tmp_path):
    src = tiny_llama("src", vocab=256, intermediate=192)
    write_byte_tokenizer(src)
    texts = [write_text(tmp_path / f"t{i}.txt", n_words=400, seed=i) for i in range(2)]
    out = tmp_path / "relufied"
    R.relufy(src, texts, out, activation="fatrelu", target_sparsity=0.8, steps=1, seq_len=32,
             checkpoint_every=0, progress=False, log=lambda *a: None)
    return write_pack(out, tmp_path / "pack", progress=False), texts


def test_calibrate_reorder_keeps_logits_and_fits_predictors_in_the_new_order(relufied_pack):
    pack, texts = relufied_pack
    dense_before = decode_logits(load_mode(pack, "dense")[0], IDS)
    assert calibrate_cli.main(["--model", str(pack), "--text", *map(str, texts), "--kind", "gate-threshold",
                               "--target-sparsity", "0", "--reorder", "--quiet"]) == 0
    manifest = read_manifest(pack)
    orders = [np.array(b["neuron_order"]) for b in manifest["bundles"]]
    assert all(sorted(o.tolist()) == list(range(192)) and (o != np.arange(192)).any() for o in orders)
    np.testing.assert_allclose(decode_logits(load_mode(pack, "dense")[0], IDS), dense_before, rtol=1e-4, atol=1e-4)
    flash = decode_logits(load_mode(pack, "flash", all_sparse=True)[0], IDS)
    np.testing.assert_allclose(flash, dense_before, rtol=1e-4, atol=1e-4)  # exact masks, new order
    assert json.loads((pack / "predictors.json").read_text())["layers"]["0"]["kind"] == "gate-threshold"


def test_the_calibration_model_follows_the_new_order(relufied_pack):
    """Predictors are fitted on the in-memory model after the reorder: its FFN weights must be the
    reordered pack's."""
    from mlx_flash.calibration.dense_pass import load_dense_model
    from mlx_flash.calibration.reorder import layer_orders, reorder_neurons

    pack, texts = relufied_pack
    data = collect_inputs(pack, texts, progress=False)
    reorder_neurons(data, layer_orders(data, 0.0))
    reloaded = load_dense_model(pack)[0]
    for i, ffn in data.ffns.items():
        mlp = reloaded.layers[i].mlp
        for ours, theirs in ((ffn.gate, mlp.gate_proj), (ffn.up, mlp.up_proj), (ffn.down, mlp.down_proj)):
            np.testing.assert_array_equal(np.array(ours.weight), np.array(theirs.weight))


def test_coactivation_order_reads_fewer_bytes_for_the_same_neurons(relufied_pack):
    pack, texts = relufied_pack
    data = collect_inputs(pack, texts, progress=False)
    rows = compare_orders(data, 0.0)
    for r in rows:
        assert r["pack"]["needed"] == r["coactivation"]["needed"] == r["frequency"]["needed"] == r["chain"]["needed"]
        assert r["coactivation"]["bytes"] < r["pack"]["bytes"]
    assert sum(r["pack"]["bytes"] for r in rows) > 1.02 * sum(r["coactivation"]["bytes"] for r in rows)


def test_bench_reorder_prints_the_comparison(relufied_pack, tmp_path, capsys):
    from mlx_flash.bench.__main__ import main

    pack, texts = relufied_pack
    assert main(["reorder", "--model", str(pack), "--text", *map(str, texts), "--quiet",
                 "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "pack / co-activation" in out and "pack / chain" in out and "Reproduce: python -m mlx_flash.bench reorder" in out
    assert len(json.loads((tmp_path / "r.json").read_text())["rows"]) == 2
