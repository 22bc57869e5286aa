"""Next-token negative log-likelihood from logits: the one computation behind every perplexity
and language-model loss here (calibration/quality's scorer, the fine-tunes' loss, moe/quality's
held-out perplexity and what builds on it). Low in the stack so moe/ and calibration/ share it.
"""

import mlx.nn as nn


def token_nll(logits, targets):
    """-log softmax(logits)[target] (nats) over the last axis: logits [..., vocab], targets int
    ids [...] (the token each row of logits predicts; the caller aligns them, e.g. logits[:, :-1]
    with tokens[:, 1:]). Returns targets' shape in logits' dtype: pass float32 logits for
    float32 accuracy, since the CPU reduces in the logits' dtype. mlx's cross_entropy, which
    subtracts each row's max first and uses the fused mx.fast.cross_entropy on the GPU."""
    return nn.losses.cross_entropy(logits, targets, reduction="none")
