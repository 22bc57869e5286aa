"""python -m mlx_flash.calibrate: activation predictors for a flash pack, from calibration text.

    python -m mlx_flash.calibrate --model PACK --text FILE [FILE ...] [--kind low-rank]
        [--target-sparsity 0.4] [--rank 128] [--rank-per-layer 26-29:256] [--threshold 0.5]

Runs the pack's model dense over the text, records every layer's FFN input x (the normalised
attention output) and activations, then per layer:
  * threshold t: for gated (SwiGLU) models the |act(gate x)| value below which --target-sparsity
    of the calibration activations lie (CATS); ReLU models use t = 0 (their natural sparsity);
  * predictor (--kind): "gate-threshold" (resident gate, exact), "exact-relu" (resident up, exact),
    "low-rank" (the paper's sigmoid(B A x) classifier, balanced loss, trained on 90% of the tokens)
    or "all" (sparsity off);
  * stats on the held-out 10% like the paper's appendix B: fraction of neurons active in the
    thresholded model, predicted, both; recall = both / active; over-prediction = predicted / active;
  * capacity Req_i for windows 1..--max-window tokens (99th percentile of the predicted union).
and writes predictors.json + predictors.safetensors into the pack (sparse/predictor.py).
"""

import argparse
import math
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .errors import FlashError
from .sparse.predictor import ACTIVATIONS, KINDS, save_predictors

SEQ_LEN = 512           # tokens per forward chunk
MIN_TOKENS = 64         # a calibration text shorter than this cannot train or measure anything
HOLDOUT = 0.1           # fraction of calibration tokens kept out of training for the stats
MAX_WINDOW = 8          # capacity measured for windows 1..MAX_WINDOW tokens
CAPACITY_PERCENTILE = 99
DEFAULTS = {"kind": None, "target_sparsity": 0.4, "rank": 128, "threshold": 0.5, "epochs": 10}


# ---- the dense model of a pack, with swappable FFNs ------------------------------------------

def load_dense_model(pack_dir):
    """(model, tokenizer, config, manifest): the pack's model rebuilt dense, every weight resident."""
    from .models import get_model_classes, load_tokenizer
    from .pack import load_pack_weights, read_manifest

    pack = Path(pack_dir)
    manifest = read_manifest(pack)
    config, weights = load_pack_weights(pack)
    model_class, args_class = get_model_classes(config)
    model = model_class(args_class.from_dict(config))
    if q := config.get("quantization"):
        def quantizable(path, module):
            if path in q:  # per-module override, as mlx-lm writes them
                return q[path]
            return hasattr(module, "to_quantized") and f"{path}.scales" in weights

        nn.quantize(model, group_size=q["group_size"], bits=q["bits"], class_predicate=quantizable)
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    model.load_weights(list(weights.items()))
    mx.eval(model.parameters())
    model.eval()
    return model, load_tokenizer(pack), config, manifest


def ffn_activation(config, manifest) -> str:
    """Name (in predictor.ACTIVATIONS) of the FFN activation of the pack's model."""
    arch = manifest["bundles"][0]["arch"]
    if arch == "opt":
        return "relu"
    if str(config.get("model_type", "")).startswith("gemma"):
        return "gelu_approx"
    name = config.get("hidden_act") or config.get("hidden_activation") or "silu"
    names = {"silu": "silu", "swish": "silu", "relu": "relu", "gelu": "gelu",
             "gelu_new": "gelu_approx", "gelu_pytorch_tanh": "gelu_approx"}
    if name not in names:
        raise FlashError(f"config.json: FFN activation {name!r} is not supported for calibration")
    return names[name]


def _module_at(model, dotted: str):
    obj = model
    for part in dotted.split("."):
        obj = obj[int(part)] if isinstance(obj, list) else getattr(obj, part)
    return obj


class MaskedFFN(nn.Module):
    """A layer's dense FFN with the thresholded-model rule and an optional predictor mask.

    h = act(gate x) * up x (gated) or act(up x) (ReLU); neuron i is kept where
    |act_i| > threshold and, with a predictor, where the predictor says so; y = down h.
    `inputs` (a list) records every x it sees, for calibration.
    """

    def __init__(self, gate, up, down, activation: str, threshold=0.0, predictor=None):
        super().__init__()
        self.gate, self.up, self.down = gate, up, down
        self.activation, self.threshold, self.predictor = activation, float(threshold), predictor
        self.inputs = None

    def activations(self, x):
        """(act, h): act(gate x) (or act(up x)) and the FFN hidden vector before masking."""
        act = ACTIVATIONS[self.activation]
        u = self.up(x)
        if self.gate is None:
            a = act(u)
            return a, a
        a = act(self.gate(x))
        return a, a * u

    def __call__(self, x):
        if self.inputs is not None:
            self.inputs.append(x)
        a, h = self.activations(x)
        keep = mx.abs(a) > self.threshold if self.threshold > 0 else None
        if self.predictor is not None:
            p = self.predictor(x)
            keep = p if keep is None else keep & p
        if keep is not None:
            h = mx.where(keep, h, mx.zeros_like(h))
        return self.down(h)


def install_masked_ffns(model, manifest, activation, hidden) -> dict:
    """Swap every layer's `mlp` for a MaskedFFN on the same weights; returns {layer: MaskedFFN}.

    Each swap is checked against the original FFN on a probe input (catches a wrong activation).
    """
    ffns = {}
    for entry in manifest["bundles"]:
        if entry["kind"] != "neurons":
            raise FlashError(f"{entry['file']}: layer {entry['layer']} is a MoE layer; neuron "
                             "predictors need a dense FFN")
        src = {c["name"].split(".")[0]: c["source"].rsplit(".", 1)[0] for c in entry["components"]
               if c["name"].endswith(".weight")}
        i = entry["layer"]
        layer = model.layers[i]
        ffn = MaskedFFN(_module_at(model, src["gate"]) if "gate" in src else None,
                        _module_at(model, src["up"]), _module_at(model, src["down_t"]), activation)
        old = getattr(layer, "mlp", None)
        if old is not None:
            probe = mx.random.normal((1, 3, hidden), key=mx.random.key(i))
            want, got = old(probe), ffn(probe)
            if not mx.allclose(want.astype(mx.float32), got.astype(mx.float32), atol=1e-2, rtol=1e-2).item():
                raise FlashError(f"config.json: layer {i} FFN does not match {activation}-gated "
                                 "recomputation; unsupported architecture for calibration")
        layer.mlp = ffn
        ffns[i] = ffn
    return ffns


# ---- calibration text --------------------------------------------------------------------------

def text_tokens(files, tokenizer, max_tokens=None, *, flag="--text", min_tokens=MIN_TOKENS):
    """int32 token ids of the files' text (each file encoded separately, then joined)."""
    ids = []
    for f in files:
        path = Path(f)
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise FlashError(f"{flag} {path}: cannot read ({e.strerror})") from None
        if not text.strip():
            raise FlashError(f"{flag} {path}: empty text")
        ids.extend(tokenizer.encode(text, add_special_tokens=False) if hasattr(tokenizer, "encode")
                   else tokenizer(text))
        if max_tokens and len(ids) >= max_tokens:
            break
    tokens = np.asarray(ids[:max_tokens] if max_tokens else ids, dtype=np.int32)
    if len(tokens) < min_tokens:
        raise FlashError(f"{flag} {', '.join(map(str, files))}: {len(tokens)} tokens, need at "
                         f"least {min_tokens}")
    return tokens


def token_chunks(tokens: np.ndarray, seq_len=SEQ_LEN):
    """Consecutive chunks of at most seq_len tokens (the last may be shorter, never < 2)."""
    chunks = [tokens[s: s + seq_len] for s in range(0, len(tokens), seq_len)]
    return [c for c in chunks if len(c) >= 2]


def collect_ffn_inputs(model, ffns, chunks, progress=True):
    """({layer: float32 np.ndarray [tokens, hidden]} FFN inputs over all chunks, their mx dtype)."""
    from tqdm import tqdm

    xs = {i: [] for i in ffns}
    for ffn in ffns.values():
        ffn.inputs = []
    for chunk in tqdm(chunks, desc="dense pass", unit="chunk", disable=not progress):
        model(mx.array(chunk)[None])
        for i, ffn in ffns.items():
            x = ffn.inputs.pop()
            dtype = x.dtype
            xs[i].append(np.array(x.reshape(-1, x.shape[-1]).astype(mx.float32)))
    for ffn in ffns.values():
        ffn.inputs = None
    return {i: np.concatenate(v) for i, v in xs.items()}, dtype


# ---- per-layer calibration ---------------------------------------------------------------------

def layer_activations(ffn, x: np.ndarray, dtype, batch=2048) -> np.ndarray:
    """|act| [tokens, n_neurons] float32 of one layer's FFN for inputs x (computed in dtype)."""
    out = []
    for s in range(0, len(x), batch):
        a, _ = ffn.activations(mx.array(x[s: s + batch]).astype(dtype))
        out.append(np.array(mx.abs(a).astype(mx.float32)))
    return np.concatenate(out)


def sparsity_threshold(abs_act: np.ndarray, target_sparsity: float) -> float:
    """The |act| value below which `target_sparsity` of the activations lie (0 = keep all)."""
    if target_sparsity <= 0:
        return 0.0
    return float(np.quantile(abs_act, target_sparsity))


class LowRankClassifier(nn.Module):
    """logits = B (A x) + bias: the paper's low-rank predictor before its sigmoid."""

    def __init__(self, hidden, n, rank):
        super().__init__()
        self.A = mx.random.normal((rank, hidden)) / math.sqrt(hidden)
        self.B = mx.random.normal((n, rank)) / math.sqrt(rank)
        self.bias = mx.zeros((n,))

    def __call__(self, x):
        return (x @ self.A.T) @ self.B.T + self.bias


def train_low_rank(x, labels, rank, *, epochs=10, batch=256, lr=2e-3, seed=0):
    """Train a LowRankClassifier on x float32 [tokens, hidden] -> labels bool [tokens, n].

    Loss balanced over positives and negatives of the layer (weights 0.5/p and 0.5/(1-p), p = the
    positive rate), as in the paper; Adam with cosine decay. Returns {"A", "B", "bias"} float32.
    """
    import mlx.optimizers as optim
    from functools import partial

    n_tok, hidden = x.shape
    p = float(np.clip(labels.mean(), 1e-4, 1 - 1e-4))
    w_pos, w_neg = 0.5 / p, 0.5 / (1 - p)
    mx.random.seed(seed)
    clf = LowRankClassifier(hidden, labels.shape[1], rank)
    scale = float(np.sqrt((x ** 2).mean())) or 1.0  # train on unit-RMS inputs; folded into A after
    xs, ys = mx.array(x / scale), mx.array(labels)

    def loss_fn(model, xb, yb):
        z = model(xb)
        return mx.where(yb, w_pos * nn.softplus(-z), w_neg * nn.softplus(z)).mean()

    steps = max(1, n_tok // batch)
    opt = optim.Adam(learning_rate=optim.cosine_decay(lr, epochs * steps, lr * 0.05))
    loss_and_grad = nn.value_and_grad(clf, loss_fn)
    state = [clf.state, opt.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(xb, yb):
        loss, grads = loss_and_grad(clf, xb, yb)
        opt.update(clf, grads)
        return loss

    rng = np.random.default_rng(seed)
    for _ in range(epochs):
        order = rng.permutation(n_tok)
        for s in range(steps):
            idx = mx.array(order[s * batch: (s + 1) * batch])
            step(xs[idx], ys[idx])
            mx.eval(state)
    return {"A": clf.A / scale, "B": clf.B, "bias": clf.bias}
