"""The pruning run over a real model: Wanda's calibration pass, mlx_flash.endor.prune's rule on
every selected linear, the pruned mlx-lm folder, and held-out perplexity against dense.

Norms come from one dense float32 pass over the calibration text (every layer dense; Wanda's paper
recomputes inputs layer by layer after pruning the layers before, which we do not). Quantized
sources are pruned on their dequantized values; the pruned model is saved in float16
(`convert --quantize 4|8` re-quantizes; `convert --encoding endor` keeps the zeros exact).
"""

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..endor.prune import DEFAULT_LAYERS, check_args, prune_weight, select_linears
from ..errors import FlashError
from ..model_folder import read_config
from ..paths import PYTHON_DOC_LIBRARY

# Calibration and held-out texts shipped on this machine (never the same files).
GIT_NOTES = "/usr/share/doc/git/RelNotes"


def default_texts() -> tuple:
    """(calibration files, held-out files): Debian's python3-doc when installed (its library pages
    split in two halves), else git's release notes (2.x for calibration, 1.x held out)."""
    import glob

    doc = sorted(glob.glob(PYTHON_DOC_LIBRARY))
    if len(doc) >= 4:
        return doc[::2], doc[1::2]
    notes = Path(GIT_NOTES)
    calib, held = sorted(notes.glob("2.*.txt")), sorted(notes.glob("1.*.txt"))
    if not calib or not held:
        raise FlashError("--text: no default calibration text on this machine (python3-doc or git's "
                         "release notes); pass --text FILES and --eval-text FILES")
    return calib, held


def load_float_model(folder: Path):
    """(model float32, config, weights {name: float32 mx.array}) of an mlx-lm folder;
    quantized weights are dequantized."""
    from ..models import get_model_classes
    from .dense_pass import dequantized

    config = read_config(folder)
    weights = {}
    for f in sorted(folder.glob("model*.safetensors")):
        weights.update(mx.load(str(f)))
    weights = dequantized(weights, config.get("quantization"))
    weights = {k: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v
               for k, v in weights.items()}
    clean = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    model_class, args_class = get_model_classes(clean)
    model = model_class(args_class.from_dict(clean))
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    model.load_weights(list(weights.items()))
    mx.eval(model.parameters())
    model.eval()
    return model, clean, weights


class _NormRecorder(nn.Module):
    """Wraps a linear: accumulates sum over tokens of x_j^2 (float32) for each input channel j."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.sq = mx.zeros((inner.weight.shape[1],), mx.float32)
        self.tokens = 0

    def __call__(self, x):
        flat = x.reshape(-1, x.shape[-1]).astype(mx.float32)
        self.sq = self.sq + mx.sum(flat * flat, axis=0)
        self.tokens += flat.shape[0]
        return self.inner(x)


def _set_module(model, path: str, module):
    parent_path, attr = path.rsplit(".", 1)
    parent = model
    for part in parent_path.split("."):
        parent = parent[int(part)] if isinstance(parent, list) else getattr(parent, part)
    setattr(parent, attr, module)


def input_norms(model, linears: dict, chunks, progress=True) -> dict:
    """{path: float32 np.ndarray [in_features]} ||x_j||_2 over all calibration tokens."""
    from tqdm import tqdm

    recorders = {p: _NormRecorder(m) for p, m in linears.items()}
    for p, r in recorders.items():
        _set_module(model, p, r)
    try:
        for chunk in tqdm(chunks, desc="calibration pass", unit="chunk", disable=not progress):
            logits = model(mx.array(chunk)[None])
            mx.eval(logits, *[r.sq for r in recorders.values()])
    finally:
        for p, m in linears.items():
            _set_module(model, p, m)
    return {p: np.sqrt(np.array(r.sq)) for p, r in recorders.items()}


def prune(folder: Path, *, method="wanda", sparsity=0.5, layers=DEFAULT_LAYERS, text_files=None,
          tokens=None, max_tokens=4096, seq_len=512, progress=True, say=print):
    """(config, {name: mx.array} pruned weights in float16, dense float32 model, pruned paths):
    prune the selected linears of the mlx-lm folder `folder`. Wanda calibrates on `tokens` (int
    token ids) or on the first `max_tokens` tokens of `text_files` (default: default_texts())."""
    from tqdm import tqdm

    from .dense_pass import text_tokens, token_chunks

    check_args(method, sparsity)
    model, config, weights = load_float_model(folder)
    linears = select_linears(model, layers)
    norms = {}
    if method == "wanda":
        if tokens is None:
            from ..models import load_tokenizer

            files = text_files or default_texts()[0]
            tokens = text_tokens(files, load_tokenizer(folder), max_tokens)
            say(f"calibration: {len(tokens)} tokens from {files[0]} and the files after it")
        norms = input_norms(model, linears, token_chunks(np.asarray(tokens), seq_len), progress)
    pruned = dict(weights)
    zeros = total = 0
    for path in tqdm(linears, desc=f"prune {method} {sparsity:.0%}", unit="linear", disable=not progress):
        name = f"{path}.weight"
        w = np.array(weights[name])
        p = prune_weight(w, sparsity, norms.get(path))
        pruned[name] = mx.array(p)
        zeros += int((p == 0).sum())
        total += p.size
    out = {k: v.astype(mx.float16) if mx.issubdtype(v.dtype, mx.floating) else v
           for k, v in pruned.items()}
    say(f"pruned {len(linears)} linear layers: {zeros / max(total, 1):.1%} of their weights are zero")
    return config, out, model, list(linears)


def sequence_nll(model, sequences) -> np.ndarray:
    """float64 [positions] next-token negative log-likelihoods (nats) of int32 `sequences` [n, L],
    one whole-sequence forward each (moe.quality.sequence_nll's windows of L - 1)."""
    from ..moe.quality import sequence_nll as window_nll

    return np.concatenate([window_nll(model, seq, len(seq) - 1) for seq in sequences]).astype(np.float64)


def held_out_perplexity(dense_model, pruned_weights, tokenizer, files, *, max_tokens=2048,
                        seq_len=256) -> dict:
    """{"dense_ppl", "pruned_ppl", "tokens", ...} of both models (float16 values computed in
    float32) on held-out text, same positions."""
    from .quality import eval_sequences, perplexity

    seqs = eval_sequences(files, tokenizer, max_tokens, seq_len)
    dense_model.update(_tree_cast(dense_model.parameters()))
    dense_ppl, dense_se = perplexity(sequence_nll(dense_model, seqs))
    dense_model.load_weights([(k, v.astype(mx.float32)) for k, v in pruned_weights.items()
                              if mx.issubdtype(v.dtype, mx.floating)], strict=False)
    pruned_ppl, pruned_se = perplexity(sequence_nll(dense_model, seqs))
    return {"tokens": int(seqs.size - len(seqs)), "dense_ppl": dense_ppl, "dense_ppl_se": dense_se,
            "pruned_ppl": pruned_ppl, "pruned_ppl_se": pruned_se, "ratio": pruned_ppl / dense_ppl}


def _tree_cast(params):
    """Parameters rounded to float16 and back (the dense reference holds what a float16 save holds)."""
    from mlx.utils import tree_map

    return tree_map(lambda a: a.astype(mx.float16).astype(mx.float32)
                    if isinstance(a, mx.array) and mx.issubdtype(a.dtype, mx.floating) else a, params)


def write_model_folder(src: Path, out: Path, config: dict, weights: dict, info: dict) -> Path:
    """An mlx-lm folder at `out` (config.json with a "pruning" entry, model.safetensors, the source's
    tokenizer and chat-template files), written whole (model_folder.write_model_folder)."""
    from ..model_folder import write_model_folder as write_folder

    return write_folder(out, weights, dict(config, pruning=info), src)
