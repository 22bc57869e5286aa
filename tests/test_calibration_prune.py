"""The pruning run (mlx_flash/calibration/prune.py): Wanda's input norms, the saved folder."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_flash.calibration import prune as pr
from mlx_flash.endor.prune import select_linears
from mlx_flash.models import load_model


def pruned_model(tiny_llama, tmp_path, name="pruned", *, dtype="float16", method="magnitude",
                 sparsity=0.5, quantize=None, **kwargs):
    """A tiny llama pruned by the library and saved as an mlx-lm folder (helper for other tests)."""
    src = tiny_llama(f"{name}-src", dtype=dtype, quantize=quantize, **kwargs)
    tokens = np.random.default_rng(0).integers(0, 128, 200) if method == "wanda" else None
    config, weights, _, paths = pr.prune(src, method=method, sparsity=sparsity, tokens=tokens,
                                         progress=False, say=lambda m: None)
    return pr.write_model_folder(src, tmp_path / name, config, weights, {"method": method}), paths


def test_pruned_folder_keeps_the_chat_template(tiny_llama, tmp_path):
    from calibration_packs import CHAT_TEMPLATE, write_byte_tokenizer, write_chat_template

    src = tiny_llama("src")
    write_byte_tokenizer(src)
    write_chat_template(src)
    config, weights, _, _ = pr.prune(src, method="magnitude", sparsity=0.5, progress=False, say=lambda m: None)
    out = pr.write_model_folder(src, tmp_path / "pruned", config, weights, {"method": "magnitude"})
    assert (out / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    assert json.loads((out / "config.json").read_text())["pruning"] == {"method": "magnitude"}


def test_sequence_nll_is_each_next_tokens_negative_log_likelihood(tiny_llama):
    model, _, _ = pr.load_float_model(tiny_llama("src"))
    seqs = np.random.default_rng(0).integers(0, 128, (3, 17)).astype(np.int32)
    nll = pr.sequence_nll(model, seqs)
    logits = np.array(model(mx.array(seqs[:, :-1])), np.float64)  # [3, 16, vocab]
    log_probs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    want = -np.take_along_axis(log_probs, seqs[:, 1:, None], -1)[..., 0].reshape(-1)
    assert nll.dtype == np.float64 and nll.shape == (3 * 16,)
    np.testing.assert_allclose(nll, want, rtol=1e-5, atol=1e-5)


def test_wanda_norms_are_input_channel_norms(tiny_llama):
    src = tiny_llama("src", layers=1)
    model, _, _ = pr.load_float_model(src)
    linears = select_linears(model, ["up_proj"])
    seen = []
    inner = linears["model.layers.0.mlp.up_proj"]
    original = type(inner).__call__
    try:
        def spy(self, x):
            if self is inner:
                seen.append(np.array(x.reshape(-1, x.shape[-1])))
            return original(self, x)

        type(inner).__call__ = spy
        tokens = np.arange(40) % 128
        norms = pr.input_norms(model, linears, [tokens[:20], tokens[20:]], progress=False)
    finally:
        type(inner).__call__ = original
    x = np.concatenate(seen)
    assert x.shape == (40, 64)
    np.testing.assert_allclose(norms["model.layers.0.mlp.up_proj"], np.sqrt((x * x).sum(0)), rtol=1e-5)


@pytest.mark.parametrize("method", ["wanda", "magnitude"])
def test_pruned_folder_loads_with_exact_zeros_only_in_selected_linears(tiny_llama, tmp_path, method):
    folder, paths = pruned_model(tiny_llama, tmp_path, method=method, quantize=(4, 32), dtype="float32")
    assert len(paths) == 2 * 7  # per layer: q, k, v, o, gate, up, down
    model, config = load_model(folder, lazy=False)
    assert "quantization" not in config and json.loads((folder / "config.json").read_text())["pruning"]
    _, _, source = pr.load_float_model(tmp_path / "pruned-src")  # dequantized source values
    params = dict(tree_flatten(model.parameters()))
    for name, w in params.items():
        assert w.dtype == mx.float16, name
        if name.removesuffix(".weight") in paths:
            assert (np.array(w == 0).sum(axis=1) == w.shape[1] // 2).all(), name
            kept = np.array(w != 0)
            assert (np.array(w)[kept] == np.array(source[name].astype(mx.float16))[kept]).all()
        else:  # embeddings and norms untouched
            assert mx.array_equal(w, source[name].astype(mx.float16)).item(), name


def test_wanda_and_magnitude_choose_differently(tiny_llama, tmp_path):
    a, _ = pruned_model(tiny_llama, tmp_path, "a", method="wanda")
    b, _ = pruned_model(tiny_llama, tmp_path, "b", method="magnitude")
    wa, wb = mx.load(str(a / "model.safetensors")), mx.load(str(b / "model.safetensors"))
    k = "model.layers.0.mlp.down_proj.weight"
    assert not mx.array_equal(wa[k] == 0, wb[k] == 0).item()
