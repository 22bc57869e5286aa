"""MoEfication: the mixtral folder computes the dense FFN exactly when every expert is chosen."""

import json

import mlx.core as mx
import numpy as np
from calibration_packs import CHAT_TEMPLATE, write_byte_tokenizer, write_chat_template
from conftest import write_tiny_llama

from mlx_flash.models import load_model
from mlx_flash.moe.moefy import balanced_kmeans, moefy
from mlx_flash.moe.quality import set_moefied_top_k


def test_balanced_kmeans_makes_equal_clusters_of_similar_rows():
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(4, 16)) * 5
    rows = np.concatenate([c + rng.normal(size=(8, 16)) * 0.1 for c in centers])
    assign = balanced_kmeans(rows[rng.permutation(32)], 4)
    assert np.bincount(assign).tolist() == [8, 8, 8, 8]
    assign = balanced_kmeans(rows, 4)
    for c in range(4):  # each true group lands in one cluster
        assert len(set(assign[c * 8:(c + 1) * 8])) == 1


def test_moefied_model_equals_dense_ffn_with_every_expert_and_a_zero_router(tmp_path):
    src = write_tiny_llama(tmp_path / "dense", quantize=(4, 32), intermediate=128)
    write_byte_tokenizer(src)
    write_chat_template(src)
    tokens = np.frombuffer(b"the quick brown fox jumps over the lazy dog. " * 40, np.uint8)
    model, config = load_model(src, lazy=False)
    out = tmp_path / "moe"
    report = moefy(model, config, tokens.astype(np.int32) % 128, src, out, experts=4, top_k=2,
                   seq_len=128, progress=False)
    assert len(report["layers"]) == 2 and all(0 <= r["router_recall_train"] <= 1
                                              for r in report["layers"])
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "mixtral" and cfg["moefied"]["experts"] == 4 and "derived_from" in cfg
    assert "Derived model" in (out / "README.md").read_text()
    assert (out / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    moe, _ = load_model(out, lazy=False)
    tokens = mx.array([[1, 5, 9, 77, 3, 100, 42, 8]])
    # Route every token to every expert with equal scores: the MoE layer is the dense FFN.
    set_moefied_top_k(moe, 4)
    for layer in moe.model.layers:
        layer.block_sparse_moe.gate.weight = mx.zeros_like(layer.block_sparse_moe.gate.weight)
    want, got = model(tokens), moe(tokens)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)
    assert np.array_equal(np.argmax(np.array(got), -1), np.array(np.argmax(np.array(want), -1)))
