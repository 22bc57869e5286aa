"""models/relu_llama: config checks, per-layer FATReLU thresholds, active-fraction recording."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_flash.models import get_model_classes
from mlx_flash.models import relu_llama as rl

CONFIG = {"model_type": "relu_llama", "hidden_size": 16, "num_hidden_layers": 2, "intermediate_size": 32,
          "num_attention_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 40}


def test_found_by_model_type_and_thresholds_per_layer():
    model_class, args_class = get_model_classes(CONFIG)
    assert model_class is rl.Model
    model = model_class(args_class.from_dict({**CONFIG, "hidden_act": "fatrelu",
                                              "activation_threshold": [0.5, 2.0]}))
    assert [layer.mlp.threshold for layer in model.layers] == [0.5, 2.0]
    g = mx.array([[-1.0, 0.5, 1.0, 3.0]])
    u = mx.array([[2.0, 2.0, 2.0, 2.0]])
    assert rl.gated_hidden(g, u, "fatrelu", 0.5).tolist() == [[0.0, 0.0, 2.0, 6.0]]
    assert rl.gated_hidden(g, -u, "drelu").tolist() == [[0.0, 0.0, 0.0, 0.0]]
    # cats keeps silu(g) where |silu(g)| > t: silu(-1) = -0.269, silu(0.5) = 0.311
    np.testing.assert_allclose(rl.gated_hidden(g, u, "cats", 0.3).tolist(),
                               [[0.0, 2 * 0.5 / (1 + np.exp(-0.5)), 2 * 1 / (1 + np.exp(-1.0)), 6 / (1 + np.exp(-3.0))]],
                               rtol=1e-5)
    assert rl.gated_hidden(g, u, "cats", 0.2).tolist()[0][0] != 0.0  # |silu(-1)| > 0.2: kept
    # product keeps silu(g) * u where |silu(g) * u| > t: 2 silu(-1) = -0.538, 2 silu(0.5) = 0.622
    np.testing.assert_allclose(rl.gated_hidden(g, u, "product", 0.6).tolist(),
                               [[0.0, 2 * 0.5 / (1 + np.exp(-0.5)), 2 * 1 / (1 + np.exp(-1.0)), 6 / (1 + np.exp(-3.0))]],
                               rtol=1e-5)
    assert rl.gated_hidden(g, u / 2, "product", 0.6).tolist()[0][1] == 0.0  # |silu(0.5)| = 0.311 < 0.6


@pytest.mark.parametrize("extra, message", [
    ({"hidden_act": "silu"}, "hidden_act 'silu'"),
    ({"hidden_act": "relu", "activation_threshold": 0.1}, "needs hidden_act fatrelu, cats or product"),
    ({"hidden_act": "fatrelu", "activation_threshold": [0.1]}, "1 values for 2 layers"),
])
def test_bad_configs_are_refused(extra, message):
    with pytest.raises(ValueError, match=message):
        rl.ModelArgs.from_dict({**CONFIG, **extra})


def test_record_collects_each_calls_active_fraction():
    model = rl.Model(rl.ModelArgs.from_dict({**CONFIG, "hidden_act": "fatrelu", "activation_threshold": 1e9}))
    record = rl.ActiveFractions()
    for layer in model.layers:
        layer.mlp.record = record
    model(mx.array([[1, 2, 3]]))
    assert [f.item() for f in record.fractions] == [0.0, 0.0]  # nothing passes the threshold
