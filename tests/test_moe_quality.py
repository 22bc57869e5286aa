"""Held-out perplexity of whole models (prompt-mode)."""

import math

import mlx.core as mx
import numpy as np
from conftest import write_tiny_llama

from mlx_flash.models import load_model
from mlx_flash.moe.quality import held_out_perplexity, sequence_nll


def test_sequence_nll_is_the_next_token_cross_entropy(tmp_path):
    model, _ = load_model(write_tiny_llama(tmp_path / "m"))
    tokens = np.arange(1, 42, dtype=np.int32) % 128
    nll = sequence_nll(model, tokens, seq_len=20)
    assert nll.shape == (40,)
    logits = np.array(model(mx.array(tokens[:20])[None])[0].astype(mx.float32))
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    want = -logp[np.arange(20), tokens[1:21]]
    np.testing.assert_allclose(nll[:20], want, rtol=1e-4, atol=1e-4)
    r = held_out_perplexity([model], tokens, seq_len=20)
    assert r["tokens"] == 40 and math.isclose(r["ppl"][0], math.exp(nll.mean()), rel_tol=1e-6)
