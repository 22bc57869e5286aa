"""Unstructured pruning of a model's linear layers: Wanda and magnitude, per output row.

Wanda (Sun et al. 2023): score W_ij by |W_ij| * ||x_j||_2, where ||x_j|| is the L2 norm of input
channel j of that linear over calibration tokens; in every output row the `sparsity` fraction of
weights with the lowest scores becomes exactly zero. Magnitude: the same with score |W_ij|.
This module holds the rule and which linears it may touch (never embeddings, norms or the output
head); the run over a real model (calibration pass, saving, perplexity) is
mlx_flash/calibration/prune.py, the CLI python -m mlx_flash.prune.
"""

import math
import re

import mlx.nn as nn
import numpy as np

from ..errors import FlashError

METHODS = ("wanda", "magnitude")
GROUPS = ("ffn", "attn")
DEFAULT_LAYERS = ("ffn", "attn")


def linear_modules(model) -> dict:
    """{dotted path: nn.Linear} of every linear layer pruning may touch, with its group
    ('ffn' for the MLP / fc1-fc2 projections, 'attn' for attention) — never embeddings or heads."""
    out = {}
    for path, module in model.named_modules():
        if not isinstance(module, (nn.Linear, nn.QuantizedLinear)) or "lm_head" in path:
            continue
        if re.search(r"(attn|attention)\.", path):
            out[path] = ("attn", module)
        elif re.search(r"(mlp|ffn|feed_forward)\.|\.fc[12]$", path):
            out[path] = ("ffn", module)
    return out


def select_linears(model, layers) -> dict:
    """{path: module} named by `layers` (groups 'ffn'/'attn' or projection names like 'q_proj');
    FlashError naming --layers when a name matches nothing in the model."""
    found = linear_modules(model)
    chosen = {}
    for name in layers:
        hits = {p: m for p, (g, m) in found.items() if g == name or p.rsplit(".", 1)[-1] == name}
        if not hits:
            names = sorted({p.rsplit(".", 1)[-1] for p in found})
            raise FlashError(f"--layers {name}: the model has no such linear layers "
                             f"(it has: {', '.join(list(GROUPS) + names)})")
        chosen.update(hits)
    return dict(sorted(chosen.items()))


def prune_weight(w: np.ndarray, sparsity: float, norms: np.ndarray | None = None) -> np.ndarray:
    """Copy of w [out, in] with floor(sparsity * in) weights of every row set to exactly 0:
    the lowest |w| (magnitude) or |w| * norms[j] (Wanda). Ties break by column order."""
    score = np.abs(w) if norms is None else np.abs(w) * norms[None, :]
    k = int(math.floor(sparsity * w.shape[1]))
    out = np.array(w, copy=True)
    if k == 0:
        return out
    drop = np.argpartition(score, k - 1, axis=1)[:, :k]
    np.put_along_axis(out, drop, 0, axis=1)
    return out


def check_args(method: str, sparsity: float):
    if method not in METHODS:
        raise FlashError(f"--method {method!r}: choose {' or '.join(METHODS)}")
    if not (isinstance(sparsity, (int, float)) and 0 < sparsity < 1):
        raise FlashError(f"--sparsity {sparsity}: must be strictly between 0 and 1")
