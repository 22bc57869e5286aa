"""The dense pass of calibration: a pack's model rebuilt dense (float32) with its FFNs swapped for
MaskedFFNs that record every layer's FFN input x (the normalised attention output) over the
calibration text, cut into chunks of at most SEQ_LEN tokens. fit.py fits predictors on the inputs.
"""

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from tqdm import tqdm

from ..errors import FlashError
from ..models import build_model, context_length, load_tokenizer
from ..pack import load_pack_weights, read_manifest
from ..sparse.predictor import activation_fn

SEQ_LEN = 512           # tokens per forward chunk
MIN_TOKENS = 64         # a calibration text shorter than this cannot train or measure anything
HOLDOUT = 0.1           # fraction of calibration tokens kept out of training for the stats
MAX_WINDOW = 8          # capacity measured for windows 1..MAX_WINDOW tokens


# ---- the dense model of a pack, with swappable FFNs ------------------------------------------

def load_dense_model(pack_dir):
    """(model, tokenizer, config, manifest): the pack's model rebuilt dense in float32.

    Quantized weights are dequantized (the values the quantized model computes with): MLX's CPU
    backend multiplies float32 matrices with BLAS (fast with OpenBLAS preloaded, see the README's
    Linux notes) and quantized or half ones slowly, and calibration runs whole chunks of tokens.
    """
    pack = Path(pack_dir)
    manifest = read_manifest(pack)
    config, weights = load_pack_weights(pack)
    weights = dequantized(weights, config.get("quantization"))
    model = build_model({k: v for k, v in config.items() if k != "quantization"})
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    model.load_weights(list(weights.items()))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    model.eval()
    return model, load_tokenizer(pack), config, manifest


def dequantized(weights: dict, quantization) -> dict:
    """weights with every affine-quantized `X.weight` (+ X.scales, X.biases) replaced by its float32
    values; quantization: the config's {"group_size", "bits", per-module overrides}."""
    if not quantization:
        return weights
    out = dict(weights)
    for key in [k for k in weights if k.endswith(".scales")]:
        module = key[: -len(".scales")]
        q = quantization.get(module)
        q = q if isinstance(q, dict) else quantization
        out[f"{module}.weight"] = mx.dequantize(weights[f"{module}.weight"], weights[key],
                                                weights[f"{module}.biases"], q["group_size"],
                                                q["bits"]).astype(mx.float32)
        del out[key], out[f"{module}.biases"]
    return out


def ffn_activation(config, manifest) -> str:
    """Name (predictor.activation_fn) of the FFN activation of the pack's model; "fatrelu" for a
    relu_llama with FATReLU, whose threshold is per layer; "cats" for a relu_llama with CATS
    (silu, each layer's |silu| threshold the model's own: install_masked_ffns); "product" for a
    relu_llama thresholding |silu(gate x) * up x| (the same, on the product)."""
    arch = manifest.bundles[0].arch
    if arch == "opt":
        return "relu"
    if str(config.get("model_type", "")).startswith("gemma"):
        return "gelu_approx"
    if config.get("model_type") == "relu_llama" and config.get("hidden_act") == "drelu":
        raise FlashError("config.json: hidden_act drelu (ReLU on gate and up) is not supported for "
                         "calibration; relufy with relu, fatrelu, cats or product")
    if config.get("model_type") == "relu_llama" and config.get("hidden_act") in ("fatrelu", "cats", "product"):
        return config["hidden_act"]  # per layer "fatrelu:T", or silu with threshold T (install_masked_ffns)
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
    |act_i| > threshold (with `product`, where |h_i| > threshold) and, with a predictor, where the
    predictor says so; y = down h. `inputs` (a list) records every x it sees, for calibration.
    """

    def __init__(self, gate, up, down, activation: str, threshold=0.0, predictor=None, product=False):
        super().__init__()
        self.gate, self.up, self.down = gate, up, down
        self.activation, self.threshold, self.predictor = activation, float(threshold), predictor
        self.product = bool(product)
        self.inputs = None

    def activations(self, x):
        """(a, h): the thresholded value (act(gate x), act(up x), or h itself with `product`) and
        the FFN hidden vector before masking."""
        act = activation_fn(self.activation)
        u = self.up(x)
        if self.gate is None:
            a = act(u)
            return a, a
        a = act(self.gate(x))
        return (a * u, a * u) if self.product else (a, a * u)

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
    activation "cats": each layer's MaskedFFN is silu with the model's threshold for that layer,
    which is CATS exactly (h_i = silu(g_i) up_i x where |silu(g_i)| > t, else 0); "product": the
    same on the product (h_i = silu(g_i) up_i x where |h_i| > t, else 0).
    """
    ffns = {}
    for entry in manifest.bundles:
        if entry.kind != "neurons":
            raise FlashError(f"{entry['file']}: layer {entry['layer']} is a MoE layer; neuron "
                             "predictors need a dense FFN")
        src = entry.modules()  # {role: module}, a resident gate's included
        i = entry.layer
        layer = model.layers[i]
        layer_act = f"fatrelu:{model.args.layer_threshold(i)}" if activation == "fatrelu" \
            else "silu" if activation in ("cats", "product") else activation
        threshold = model.args.layer_threshold(i) if activation in ("cats", "product") else 0.0
        ffn = MaskedFFN(_module_at(model, src["gate"]) if "gate" in src else None,
                        _module_at(model, src["up"]), _module_at(model, src["down_t"]), layer_act, threshold,
                        product=activation == "product")
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
    xs = {i: [] for i in ffns}
    for ffn in ffns.values():
        ffn.inputs = []
    for chunk in tqdm(chunks, desc="dense pass", unit="chunk", disable=not progress):
        model(mx.array(chunk)[None])  # lazy: only what the FFN inputs need is computed
        inputs = {i: ffn.inputs.pop() for i, ffn in ffns.items()}
        mx.eval(*inputs.values())
        for i, x in inputs.items():
            dtype = x.dtype
            xs[i].append(np.array(x.reshape(-1, x.shape[-1]).astype(mx.float32)))
    for ffn in ffns.values():
        ffn.inputs = None
    return {i: np.concatenate(v) for i, v in xs.items()}, dtype


@dataclass
class CalibrationData:
    """A pack's dense model and the FFN inputs it saw on the calibration text (collect_inputs)."""
    pack: Path
    model: object
    config: dict
    manifest: dict
    activation: str
    gated: bool
    ffns: dict  # {layer: MaskedFFN}
    xs: dict  # {layer: float32 np.ndarray [tokens, hidden]}
    dtype: object
    n_train: int  # the first n_train tokens train, the rest are held out for the statistics
    texts: list


def collect_inputs(pack_dir, text_files, *, max_tokens=None, max_window=MAX_WINDOW,
                   progress=True) -> CalibrationData:
    """Run the pack's model dense over the text and record every layer's FFN inputs."""
    pack = Path(pack_dir)
    if not pack.is_dir():
        raise FlashError(f"--model {pack}: no such pack directory")
    if not text_files:
        raise FlashError("--text: give at least one calibration text file")
    model, tokenizer, config, manifest = load_dense_model(pack)
    activation = ffn_activation(config, manifest)
    gated = manifest.bundles[0].gated
    tokens = text_tokens(text_files, tokenizer, max_tokens)
    ffns = install_masked_ffns(model, manifest, activation, config["hidden_size"])
    # never past the model's context: positions beyond it would index learned position tables
    # (OPT) out of bounds, which MLX does not check
    seq_len = min(SEQ_LEN, context_length(model) or SEQ_LEN)
    xs, dtype = collect_ffn_inputs(model, ffns, token_chunks(tokens, seq_len), progress=progress)
    n_tok = len(next(iter(xs.values())))
    n_train = int(round(n_tok * (1 - HOLDOUT)))
    if n_tok - n_train < max_window + 1:
        raise FlashError(f"--text: {n_tok} tokens leave too few held out for the statistics")
    return CalibrationData(pack, model, config, manifest, activation, gated, ffns, xs, dtype,
                           n_train, [str(f) for f in text_files])
