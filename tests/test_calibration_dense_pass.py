"""calibration/dense_pass.py: the pack's dense model with MaskedFFNs, checked against the original FFN."""

import pytest

from mlx_flash.calibration import dense_pass
from mlx_flash.errors import FlashError


def test_unsupported_mlp_shape_is_refused(llama_pack):
    from mlx_flash.pack import read_manifest

    model, _, config, manifest = dense_pass.load_dense_model(llama_pack)
    with pytest.raises(FlashError, match="unsupported architecture"):
        dense_pass.install_masked_ffns(model, manifest, "relu", config["hidden_size"])  # llama is silu
    with pytest.raises(FlashError, match="activation 'tanh' is not supported"):
        dense_pass.ffn_activation({"hidden_act": "tanh"}, read_manifest(llama_pack))

@pytest.mark.parametrize("product", [False, True])
def test_masked_ffn_thresholds_the_gate_or_the_product(product):
    """CATS keeps neuron i where |silu(g_i)| > t; the product threshold where |silu(g_i) u_i| > t;
    `activations` returns what is thresholded."""
    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np

    gate, up, down = (nn.Linear(4, 6, bias=False), nn.Linear(4, 6, bias=False), nn.Linear(6, 4, bias=False))
    for i, m in enumerate((gate, up, down)):
        m.weight = mx.random.normal(m.weight.shape, key=mx.random.key(i))
    x = mx.random.normal((3, 4), key=mx.random.key(9))
    g, u = np.array(gate(x)), np.array(up(x))
    a = g / (1 + np.exp(-g))
    t = float(np.median(np.abs(a * u if product else a)))
    ffn = dense_pass.MaskedFFN(gate, up, down, "silu", t, product=product)
    score, h = (np.array(v) for v in ffn.activations(x))
    np.testing.assert_allclose(score, a * u if product else a, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(h, a * u, rtol=1e-5, atol=1e-6)
    kept = np.abs(a * u if product else a) > t
    want = np.where(kept, a * u, 0) @ np.array(down.weight).T
    np.testing.assert_allclose(np.array(ffn(x)), want, rtol=1e-4, atol=1e-5)
