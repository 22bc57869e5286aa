"""calibration/resident_quant.py: the resident linears' input moments and their quantizers."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_flash.calibration.resident_quant import input_moments, resident_quantizer
from mlx_flash.errors import FlashError
from mlx_flash.models import load_model


def _model(tiny_llama):
    model, _ = load_model(tiny_llama("src", layers=2, intermediate=96), lazy=False)
    return model


def _tokens(n, seed=0):
    return np.random.default_rng(seed).integers(0, 128, n).astype(np.int32)


def test_input_moments_are_each_resident_linears_input_second_moment(tiny_llama):
    """q/k/v see the layer's normed input, o the attention output, the tied embedding's lm_head
    use the final norm's output: each moment is X^T X over every chunk; the FFN is not recorded
    and the model is restored unchanged."""
    model = _model(tiny_llama)
    tokens = _tokens(300)  # chunks of 256 + 44 tokens
    before = model(mx.array(tokens[:20])[None])
    got = input_moments(model, tokens, seq_len=256)
    assert sorted(got) == sorted(["model.embed_tokens"] + [f"model.layers.{i}.self_attn.{p}_proj"
                                                          for i in range(2) for p in "qkvo"])
    want_q, want_head = 0.0, 0.0
    for chunk in (tokens[:256], tokens[256:]):
        ids = mx.array(chunk)[None]
        x = np.array(model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))[0], np.float64)
        h = np.array(model.model(ids)[0], np.float64)  # mlx-lm's llama returns the final norm's output
        want_q, want_head = want_q + x.T @ x, want_head + h.T @ h
    for path in ("q_proj", "k_proj", "v_proj"):
        np.testing.assert_allclose(got[f"model.layers.0.self_attn.{path}"], want_q, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got["model.embed_tokens"], want_head, rtol=1e-4, atol=1e-3)
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear
    assert type(model.model.embed_tokens) is nn.Embedding
    assert mx.array_equal(model(mx.array(tokens[:20])[None]), before).item()


def test_gptq_rounds_with_less_error_on_the_recorded_inputs_than_nearest_rounding(tiny_llama):
    """The point of the calibration: with the recorded H, GPTQ's 4-bit weights have a smaller
    output error (W - W^) H (W - W^)^T than any rounding to the nearest grid point (mx.quantize,
    minmax, clip), in MLX's affine format."""
    model = _model(tiny_llama)
    moments = input_moments(model, _tokens(512, seed=1))
    for part in ("q_proj", "o_proj"):
        path = f"model.layers.1.self_attn.{part}"
        w = getattr(model.model.layers[1].self_attn, part).weight

        def err(method):
            q, s, b = resident_quantizer(method, moments)(path, w, 4, 32)
            d = np.array(mx.dequantize(q, s, b, group_size=32, bits=4) - w, np.float64)
            return np.trace(d @ moments[path] @ d.T)

        assert err("gptq") < 0.8 * min(err("mlx"), err("minmax"), err("clip")), part


def test_minmax_keeps_weights_that_sit_on_a_q4_1_grid(tiny_llama):
    """A weight on a Q4_1 grid (d * q + m per 32 inputs, as GGUF sources' attention was) is kept
    exactly by minmax, while mx.quantize (0.0 snapped onto the grid) moves it."""
    rng = np.random.default_rng(0)
    q = rng.integers(0, 16, (8, 64))
    q[:, ::32], q[:, 1::32] = 0, 15  # each group spans its whole range
    d, m = rng.uniform(0.01, 0.02, (8, 2, 1)), rng.uniform(-0.2, -0.1, (8, 2, 1))
    w = mx.array((q.reshape(8, 2, 32) * d + m).reshape(8, 64).astype(np.float32))

    def max_err(method):
        packed, s, b = resident_quantizer(method)("x", w, 4, 32)
        return mx.abs(mx.dequantize(packed, s, b, group_size=32, bits=4) - w).max().item()

    assert max_err("minmax") < 1e-6 < 1e-3 < max_err("mlx")


def test_resident_quantizer_refuses_an_unknown_method():
    with pytest.raises(FlashError, match="--resident-quantizer best: not one of"):
        resident_quantizer("best")
