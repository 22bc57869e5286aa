"""Rounding the resident linears (`convert --resident-bits B --resident-quantizer M`) on calibration text.

A pack's resident linears (attention projections, the embedding / tied lm_head) are stored in MLX's
affine format. `mx.quantize` snaps each group's grid so that 0.0 is exact; the quantizers of
moe/quantize.py choose the grid by the group's min..max ("minmax": exact for weights that still sit
on a GGUF Q4_1 / Q8 grid, as the relufied SmolLM2's attention started), shrink its range to the
least error ("clip"), or round column by column spreading each rounding error over the columns
not yet rounded (GPTQ, "gptq"; "gptq-fit" then refits each row's scales and biases), weighted by
the second moment H = sum_t x_t x_t^T of the linear's inputs on calibration text. Here those
inputs are recorded: every resident nn.Linear's (the FFN's gate / up / down excluded: they are in
the bundles, or the resident gate's own `--gate-bits`), and for a tied embedding the input of its
lm_head use, the final norm's output (its lookup rows are rounded for the lm_head's sake).
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import FlashError
from ..moe.quantize import METHODS, quantize_experts
from .dense_pass import token_chunks

FFN_PARTS = ("gate_proj", "up_proj", "down_proj")


class _MomentRecorder(nn.Module):
    """Wraps a linear (or a tied embedding): adds x^T x of each matmul input to `moments[path]`."""

    def __init__(self, inner, path: str, moments: dict):
        super().__init__()
        self.inner, self.path, self.moments = inner, path, moments

    def _record(self, x):
        x = x.reshape(-1, x.shape[-1]).astype(mx.float32)
        h = np.array(x.T @ x, dtype=np.float64)
        self.moments[self.path] = self.moments.get(self.path, 0.0) + h

    def __call__(self, x):
        if isinstance(self.inner, nn.Embedding):  # the lookup: nothing to record
            return self.inner(x)
        self._record(x)
        return self.inner(x)

    def as_linear(self, x):
        self._record(x)
        return self.inner.as_linear(x)


def _resident_linears(model) -> list:
    """(parent module, attribute, path) of every resident nn.Linear and the tied embedding."""
    found = []
    for path, m in model.named_modules():
        for attr, child in m.children().items():
            full = f"{path}.{attr}" if path else attr
            if isinstance(child, nn.Linear) and attr not in FFN_PARTS:
                found.append((m, attr, full))
            elif isinstance(child, nn.Embedding) and attr == "embed_tokens":
                found.append((m, attr, full))
    return found


def input_moments(model, tokens: np.ndarray, seq_len: int = 256) -> dict:
    """{module path: float64 [in, in]} the second moment of each resident linear's inputs over
    `tokens` (int32 ids, run in chunks of `seq_len` with a fresh context each); `model` is a
    float mlx-lm model, restored unchanged."""
    moments = {}
    swapped = _resident_linears(model)
    for parent, attr, path in swapped:
        setattr(parent, attr, _MomentRecorder(getattr(parent, attr), path, moments))
    try:
        for chunk in token_chunks(tokens, seq_len):
            mx.eval(model(mx.array(chunk)[None]))
    finally:
        for parent, attr, _ in swapped:
            setattr(parent, attr, getattr(parent, attr).inner)
    return moments


def resident_quantizer(method: str, moments: dict | None = None):
    """The pack writer's `resident_quantizer` for `method` (moe/quantize.py METHODS): a function
    (module path, weight [out, in], bits, group_size) -> (packed, scales, biases). moments:
    input_moments' {path: H} ("gptq", "gptq-fit" and "gptq-cd" need the module's; "clip" weights its
    errors by H's diagonal when it has it); a module with no recorded inputs (an untied
    embedding: a lookup, no matmul) is rounded by "clip" instead of "gptq" / "gptq-fit" / "gptq-cd"."""
    if method not in METHODS:
        raise FlashError(f"--resident-quantizer {method}: not one of {', '.join(METHODS)}")

    def quantize(path, w, bits, group_size):
        h = (moments or {}).get(path)
        own = "clip" if h is None and method.startswith("gptq") else method
        q, s, b = quantize_experts(w[None], bits, group_size, own, hessian=None if h is None else h[None])
        return q[0], s[0], b[0]
    return quantize
