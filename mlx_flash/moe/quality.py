"""Held-out perplexity of whole models (prompt-mode forward over fixed-length sequences)."""

import math

import mlx.core as mx
import numpy as np

from ..nll import token_nll



def sequence_nll(model, tokens: np.ndarray, seq_len=256) -> np.ndarray:
    """Negative log-likelihood (nats) of each next token, sequences of seq_len run independently."""
    out = []
    n = (len(tokens) - 1) // seq_len * seq_len
    for s in range(0, n, seq_len):
        x = mx.array(tokens[s: s + seq_len + 1])[None]
        logits = model(x[:, :-1]).astype(mx.float32)
        nll = token_nll(logits, x[:, 1:])
        out.append(np.array(nll[0]))
    return np.concatenate(out)


def held_out_perplexity(models, tokens: np.ndarray, seq_len=256) -> dict:
    """{"ppl": [perplexity of each model], "tokens": scored tokens} on `tokens` (int32 ids)."""
    ppl = [math.exp(float(np.mean(sequence_nll(m, tokens, seq_len)))) for m in models]
    return {"ppl": ppl, "tokens": int((len(tokens) - 1) // seq_len * seq_len)}


def set_moefied_top_k(model, k: int):
    """Route a MoEfied mixtral model (moe.moefy) to `k` experts per token instead of its own k.

    Each down matrix carries the factor k_built (mixtral's top-k softmax gives each chosen expert
    ~1/k), so it is rescaled by k / k_now; k = all experts gives back the dense FFN.
    """
    for layer in model.model.layers:
        block = layer.block_sparse_moe
        old = block.num_experts_per_tok
        block.num_experts_per_tok = k
        down = block.switch_mlp.down_proj
        down.weight = down.weight * (k / old)
