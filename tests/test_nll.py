"""token_nll: the one next-token negative log-likelihood, against a float64 reference."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_flash.nll import token_nll


def reference_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log softmax(logits)[target] in float64 (max-shifted, so large logits do not overflow)."""
    x = logits.astype(np.float64)
    shifted = x - x.max(-1, keepdims=True)
    log_z = np.log(np.exp(shifted).sum(-1))
    return log_z - np.take_along_axis(shifted, targets[..., None].astype(np.int64), -1)[..., 0]


@pytest.mark.parametrize("shape", [(50,), (7, 50), (2, 5, 50)])
def test_token_nll_equals_the_float64_reference(shape):
    rng = np.random.default_rng(len(shape))
    # a spread of 40 nats and an offset of 1000: naive exp would overflow float32
    logits = (rng.normal(size=shape) * 10 + 1000).astype(np.float32)
    targets = rng.integers(0, shape[-1], size=shape[:-1]).astype(np.int32)
    got = token_nll(mx.array(logits), mx.array(targets))
    assert got.shape == targets.shape and got.dtype == mx.float32
    np.testing.assert_allclose(np.array(got), reference_nll(logits, targets), rtol=1e-6, atol=1e-4)


def test_token_nll_of_a_sure_token_is_zero_and_of_a_uniform_row_log_vocab():
    logits = mx.array([[0.0, 0.0, 0.0, 0.0], [0.0, 100.0, 0.0, 0.0]])
    got = np.array(token_nll(logits, mx.array([2, 1])))
    np.testing.assert_allclose(got, [np.log(4.0), 0.0], atol=1e-6)
