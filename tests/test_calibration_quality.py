"""calibration/quality.py: perplexity and greedy agreement against dense, on tiny random packs with a
byte tokenizer."""

import re

import numpy as np
import pytest

from calibration_packs import tiny_llama_pack, write_text

from mlx_flash.calibration import fit, quality
from mlx_flash.errors import FlashError


@pytest.fixture
def pack(tiny_llama, tmp_path):
    return tiny_llama_pack(tiny_llama, tmp_path)


@pytest.fixture
def text(tmp_path):
    return write_text(tmp_path / "eval.txt", n_words=60, seed=11)


def test_dense_vs_dense_is_identical(pack, text):
    r = quality.evaluate_ppl(pack, [text], mode="dense", max_tokens=96, seq_len=32, progress=False)
    assert r["tokens"] == 3 * 31 and r["sequences"] == 3
    assert r["ppl"] == r["dense_ppl"] and r["ppl_ratio"] == 1.0 and r["agreement"] == 1.0
    assert r["ppl"] > 1 and r["ppl_se"] > 0


def test_token_by_token_scoring_equals_one_forward_pass(pack, text):
    """score_sequences (one token per step through a KV cache, as generation runs) against an
    independent computation: each whole sequence in one forward pass, log-softmax, the next token's
    log-probability (the dense-vs-dense test above compares the scorer with itself)."""
    import mlx.core as mx

    model, tokenizer = quality.load_mode(pack, "dense")
    seqs = quality.eval_sequences([text], tokenizer, 96, 32)
    nll, _ = quality.score_sequences(model, seqs, progress=False)
    logits = model(mx.array(seqs)).astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    want = -np.take_along_axis(np.array(logp[:, :-1]), seqs[:, 1:, None].astype(np.int64), -1)[..., 0]
    np.testing.assert_allclose(nll, want.reshape(-1), rtol=1e-4, atol=1e-4)



def thresholded_dense_ppl(pack, sequences):
    """Perplexity of the thresholded model written out here: the dense model whose FFN keeps
    neuron i only where |silu(gate_i x)| > the layer's predictors.json threshold."""
    import mlx.core as mx
    import mlx.nn as nn

    from mlx_flash.calibration.dense_pass import load_dense_model
    from mlx_flash.sparse.predictor import load_predictors

    class ThresholdedMLP(nn.Module):
        def __init__(self, mlp, threshold):
            super().__init__()
            self.mlp, self.threshold = mlp, threshold

        def __call__(self, x):
            a = nn.silu(self.mlp.gate_proj(x))
            return self.mlp.down_proj(mx.where(mx.abs(a) > self.threshold, a * self.mlp.up_proj(x), 0))

    model, *_ = load_dense_model(pack)  # mlx-lm's model on the pack's weights, no flash layers
    for i, p in load_predictors(pack).items():
        model.layers[i].mlp = ThresholdedMLP(model.layers[i].mlp, p.threshold)
    nll, _ = quality.score_sequences(model, sequences, progress=False)
    return quality.perplexity(nll)[0]


def test_flash_with_sparsity_off_matches_dense_and_sparse_is_the_thresholded_model(pack, text, tmp_path):
    calib = write_text(tmp_path / "calib.txt", seed=12)
    ref = quality.dense_reference(pack, [text], 64, 32, progress=False)
    fit.calibrate(pack, [calib], kind="all", progress=False)
    r = quality.evaluate_ppl(pack, [text], mode="flash", window=3, reference=ref, progress=False)
    assert r["ppl"] == r["dense_ppl"] and r["agreement"] == 1.0
    assert r["flash_stats"]["hit_rate"] > 0.9  # every neuron stays cached after the first token
    fit.calibrate(pack, [calib], kind="gate-threshold", target_sparsity=0.6, progress=False)
    r = quality.evaluate_ppl(pack, [text], mode="flash", window=3, reference=ref, progress=False)
    # the thresholded model (60% of the activations dropped), not the dense one (0.28% apart)
    want = thresholded_dense_ppl(pack, ref[0])
    assert r["ppl"] == pytest.approx(want, rel=1e-5) and abs(want / r["dense_ppl"] - 1) > 1e-3



def test_perplexity_matches_mlx_lm_formula():
    nll = np.array([1.0, 2.0, 3.0])
    ppl, se = quality.perplexity(nll)
    assert ppl == pytest.approx(np.exp(2.0)) and se == pytest.approx(np.exp(2.0) * 1.0 / np.sqrt(3))



def test_sweep_leaves_the_pack_untouched(pack, text, tmp_path):
    calib = write_text(tmp_path / "calib.txt", seed=13)
    rows = quality.sweep(pack, [calib], [text], target_sparsities=[0.0, 0.5], memory_budget=None,
                    max_tokens=64, seq_len=32, calib_tokens=2000, progress=False,
                    kind="gate-threshold")
    assert [r["target_sparsity"] for r in rows] == [0.0, 0.5]
    assert rows[0]["agreement"] == 1.0 and rows[0]["ppl_ratio"] == 1.0  # threshold 0 drops nothing
    assert rows[1]["active"] == pytest.approx(0.5, abs=0.02)
    assert not (pack / "predictors.json").exists()
    assert "| 0.5 | gate-threshold |" in quality.format_sweep(rows)
    with pytest.raises(FlashError, match="must be disjoint"):
        quality.sweep(pack, [text], [text], target_sparsities=[0.1], progress=False)



def test_all_sparse_runs_every_layer_with_its_predictor_under_a_budget(tiny_llama, text, tmp_path):
    from mlx_flash.pack import read_manifest
    from mlx_flash.sparse.budget import layer_bytes, stream_bytes

    # six layers: one layer's streaming buffer is small next to all the FFNs
    pack = tiny_llama_pack(tiny_llama, tmp_path, layers=6)
    calib = write_text(tmp_path / "calib.txt", seed=12)
    ref = quality.dense_reference(pack, [text], 64, 32, progress=False)
    fit.calibrate(pack, [calib], kind="gate-threshold", target_sparsity=0.6, progress=False)
    m = read_manifest(pack)
    # the resident gates cost a third of the FFN: a budget that cannot hold every FFN
    budget = m["resident"]["length"] + stream_bytes(m) + sum(layer_bytes(b) for b in m["bundles"]) // 2
    planned = quality.evaluate_ppl(pack, [text], mode="flash", memory_budget=budget, window=3, reference=ref,
                              progress=False)
    forced = quality.evaluate_ppl(pack, [text], mode="flash", memory_budget=budget, window=3, reference=ref,
                             progress=False, all_sparse=True)
    assert forced["all_sparse"] and "0 sparse" not in forced["plan"] and "resident" in forced["plan"]
    # every flash layer (sparse, resident or streamed whole) computes the thresholded model
    want = thresholded_dense_ppl(pack, ref[0])
    assert forced["ppl"] == pytest.approx(want, rel=1e-5) and planned["ppl"] == pytest.approx(want, rel=1e-5)
    assert abs(want / forced["dense_ppl"] - 1) > 1e-3  # 0.12% measured: 120x the tolerance
    # the plan keeps some layers resident / streams them whole; all_sparse runs all 6 sparse
    assert int(re.search(r"(\d+) sparse \(predictor", planned["plan"]).group(1)) < 6
    assert "layer FFNs resident" not in forced["plan"] and "streamed whole" not in forced["plan"]
