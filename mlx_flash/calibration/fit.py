"""Predictor and threshold fits on the dense pass's FFN inputs (dense_pass.py), per layer:
  * threshold t: for gated (SwiGLU) models the |act(gate x)| value below which --target-sparsity
    of the calibration activations lie (CATS); ReLU models use t = 0 (their natural sparsity);
  * predictor (kind), fitted on the first 90% of the tokens:
      "low-rank-gate" (gated default): B (A x) + bias, the best rank-r estimate of gate x on the
        calibration inputs (PCA of the gate pre-activations); mask = |act(estimate)| > cut, the
        cut set per layer so `recall` of the thresholded model's active neurons are kept;
      "low-rank" (ReLU default, the paper's): sigmoid(B A x + bias) > threshold, trained with
        the balanced loss (positives and negatives weighted equally);
      "quant-gate": mask = |act(g)| > cut as low-rank-gate's, g = a `gate_bits`-bit quantized
        copy of the gate (group size 32) times x: far closer to gate x than a low-rank estimate
        at a quarter (4-bit) of a float16 gate's memory;
      "quant-glu" (product-threshold default): mask = |act(g) * u| > cut, g and u quantized
        copies of the gate and up (as quant-gate's) times x, the cut set for `recall` likewise;
      "gate-threshold" (resident gate, exact), "exact-relu" (resident up, exact), "all" (off);
  * stats on the held-out 10% like the paper's appendix B: fraction of neurons active in the
    thresholded model, predicted, both; recall = both / active; over-prediction = predicted / active;
  * capacity Req_i for windows 1..max_window tokens (99th percentile of the predicted union).
The results go into the pack as predictors.json + predictors.safetensors (sparse/predictor.py),
each atomically. The low-rank classifier cannot express |act(g)| > t for silu/gelu (true on both
lobes of the activation), which is why gated models default to the gate estimate.
"""

import math
import os
import time
import weakref
import zlib
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from tqdm import tqdm

from ..config import FlashConfig
from ..errors import FlashError
from ..io import FlashLoader
from ..pack import layer_bundles
from ..sparse.budget import measured_cache_read_seconds, measured_read_seconds
from ..sparse.predictor import (COPIES, GATE_MASKS, KINDS, LOW_RANK, SCORED, LayerPredictor, copied_roles,
                                read_predictors_json, save_predictors, shares_resident_gate)
from .dense_pass import MAX_WINDOW, CalibrationData, collect_inputs

CAPACITY_PERCENTILE = 99
CACHE_WINDOW = FlashConfig.window  # the window calibration prices smaller neuron caches at
DEFAULTS = {"kind": None, "target_sparsity": 0.2, "rank": 64, "threshold": 0.5, "epochs": 10,
            "recall": 0.99, "gate_bits": 4}
GATE_BITS = (2, 3, 4, 8)
GATE_GROUP_SIZE = 32


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


def layer_threshold(ffn, abs_act_train: np.ndarray, target_sparsity: float) -> float:
    """The layer's activation threshold (|act| units): the model's own when it has one (a CATS
    relu_llama: the trained threshold, so every mode computes the same model), else the
    `target_sparsity` quantile of the training tokens' |act| (abs_act_train)."""
    if ffn.threshold > 0:
        return float(ffn.threshold)
    return sparsity_threshold(abs_act_train, target_sparsity)


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


def _resident_rows(module, role: str):
    """(tensors, quantization) of a gate/up projection for a resident LayerPredictor."""
    tensors = {f"{role}.weight": module.weight}
    quant = None
    if hasattr(module, "scales"):
        tensors[f"{role}.scales"] = module.scales
        tensors[f"{role}.biases"] = module.biases
        quant = {"group_size": module.group_size, "bits": module.bits}
    if "bias" in module:
        tensors[f"{role}.bias"] = module.bias
    return tensors, quant


_GATE_PCA = {}  # (id(ffn), x's shape and crc32) -> (weak ref to ffn, mean, principal directions)


def fit_low_rank_gate(ffn, x: np.ndarray, rank: int) -> dict:
    """{"A", "B", "bias"} float32 with B (A x) + bias the best rank-`rank` approximation of the
    gate pre-activations gate x over the inputs x [tokens, hidden] (reduced-rank regression: the
    pre-activations projected on their top principal directions V, A = V^T W_gate, B = V)."""
    mean, vecs = _gate_pca(ffn, x)
    v = vecs[:, : min(rank, vecs.shape[0], x.shape[1])]  # top principal directions
    w = np.array(dequantized_weight(ffn.gate).astype(mx.float32)).astype(np.float64)
    b = np.array(ffn.gate.bias).astype(np.float64) if "bias" in ffn.gate else np.zeros(len(mean))
    proj = v @ v.T
    bias = proj @ b + (np.eye(len(mean)) - proj) @ mean
    return {"A": mx.array((v.T @ w).astype(np.float32)), "B": mx.array(v.astype(np.float32)),
            "bias": mx.array(bias.astype(np.float32))}


def _gate_pca(ffn, x: np.ndarray):
    """(mean, principal directions, descending) of ffn's gate pre-activations over x, float64;
    independent of the threshold and rank, so a sweep computes it once per layer and inputs. The
    cache holds the layer by a weak reference and x by its checksum: a new layer that reuses a
    freed one's id(), or other inputs of the same length, are computed afresh."""
    x = np.ascontiguousarray(x)
    key = (id(ffn), x.shape, zlib.crc32(x.view(np.uint8)))
    hit = _GATE_PCA.get(key)
    if hit is not None and hit[0]() is ffn:
        return hit[1], hit[2]
    g = ffn.gate(mx.array(x)).astype(mx.float32)
    mean = g.mean(axis=0)
    g = g - mean
    cov = np.array(g.T @ g).astype(np.float64)
    mean, vecs = np.array(mean).astype(np.float64), np.linalg.eigh(cov)[1][:, ::-1]
    if len(_GATE_PCA) > 64:
        _GATE_PCA.clear()
    _GATE_PCA[key] = (weakref.ref(ffn), mean, vecs)
    return mean, vecs


def quantized_copy(ffn, bits: int, group_size=GATE_GROUP_SIZE, roles=("gate",)) -> dict:
    """{"ROLE.weight", "ROLE.scales", "ROLE.biases"(, "ROLE.bias")} for each of `roles` ("gate",
    "up"): the layer's projection (its float values, dequantized if the pack's are quantized)
    MLX-quantized at `bits`, scales and biases in float16 as predictors.safetensors stores them."""
    out = {}
    for role in roles:
        module = getattr(ffn, role)
        q, scales, biases = mx.quantize(dequantized_weight(module).astype(mx.float32), group_size=group_size,
                                        bits=bits)
        out.update({f"{role}.weight": q, f"{role}.scales": scales.astype(mx.float16),
                    f"{role}.biases": biases.astype(mx.float16)})
        if "bias" in module:
            out[f"{role}.bias"] = module.bias.astype(mx.float16)
    return out


def dequantized_weight(module):
    """The float weight matrix of a Linear or QuantizedLinear [out, in]."""
    if hasattr(module, "scales"):
        return mx.dequantize(module.weight, module.scales, module.biases, module.group_size, module.bits)
    return module.weight


def recall_cut(score: np.ndarray, active: np.ndarray, recall: float) -> float:
    """The largest cutoff c with at least `recall` of the active entries having score > c."""
    s = score[active]
    if not len(s):
        return float(score.max()) if score.size else 0.0
    q = float(np.quantile(s, 1 - recall))
    return q - 1e-6 * abs(q)  # just below: the quantile's own entries count as kept


def layer_predictor(layer, kind, ffn, n_neurons, *, threshold=0.0, factors=None, prob_threshold=0.5,
                    cut=0.0, quantization=None, resident_gate=False):
    """The LayerPredictor the runtime will build for this layer, on the in-memory weights.

    Low-rank factors are rounded to float16, as predictors.safetensors stores them, so calibration
    measures exactly the predictor that is saved. resident_gate: the pack holds the gate resident
    (convert --gate-bits): quant-glu takes it (ffn.gate) beside its up copy, as the runtime does.
    """
    tensors, quant, gate_quant = {}, None, None
    shares = kind in COPIES and shares_resident_gate(kind, resident_gate)  # gate-threshold: its own rows here
    if kind == "exact-relu":
        tensors, quant = _resident_rows(ffn.up, "up")
    elif kind == "gate-threshold":
        tensors, quant = _resident_rows(ffn.gate, "gate")
    elif kind in LOW_RANK:
        tensors = {k: v.astype(mx.float16) for k, v in factors.items()}
    elif kind in COPIES:
        tensors, quant = dict(factors), quantization
        if shares:
            gate, gate_quant = _resident_rows(ffn.gate, "gate")
            tensors.update(gate)
    return LayerPredictor(layer, kind, n_neurons, threshold=threshold, prob_threshold=prob_threshold,
                          cut=cut,
                          rank=int(factors["A"].shape[0]) if kind in LOW_RANK else 0,
                          activation=ffn.activation, tensors=tensors, quantization=quant,
                          resident_gate=shares, gate_quantization=gate_quant)


def predict_masks(predictor, x: np.ndarray, dtype, batch=2048) -> np.ndarray:
    """bool [tokens, n_neurons]: the neurons `predictor` marks active for inputs x (in dtype)."""
    out = []
    for s in range(0, len(x), batch):
        out.append(np.array(predictor(mx.array(x[s: s + batch]).astype(dtype))))
    return np.concatenate(out)


def window_capacity(predicted: np.ndarray, max_window=MAX_WINDOW, percentile=CAPACITY_PERCENTILE):
    """[Req_1 .. Req_max_window]: the `percentile` of the number of distinct neurons predicted
    over the last w consecutive tokens (rows of `predicted`, bool [tokens, n_neurons])."""
    union = predicted.copy()
    caps = []
    for w in range(1, max_window + 1):
        if w > 1:
            union = union[1:] | predicted[: len(union) - 1]  # union[t] covers tokens t..t+w-1
        sizes = union.sum(axis=1) if len(union) else np.zeros(1)
        caps.append(int(math.ceil(np.percentile(sizes, percentile))))
    return caps


def prediction_stats(active: np.ndarray, predicted: np.ndarray) -> dict:
    """Appendix-B numbers over held-out tokens (fractions of neurons per token, averaged):
    active (thresholded model), predicted, both; recall = both / active (1 - false negatives);
    over_prediction = predicted / active."""
    a, p = active.mean(), predicted.mean()
    both = (active & predicted).mean()
    return {"active": float(a), "predicted": float(p), "both": float(both),
            "recall": float(both / a) if a else 1.0,
            "over_prediction": float(p / a) if a else float("inf") if p else 1.0}


def parse_rank_per_layer(spec, n_layers: int) -> dict:
    """--rank-per-layer "26-29:256,3:64" -> {26: 256, 27: 256, 28: 256, 29: 256, 3: 64}."""
    out = {}
    if not spec:
        return out
    for part in str(spec).split(","):
        try:
            layers, rank = part.split(":")
            lo, _, hi = layers.partition("-")
            lo, hi, rank = int(lo), int(hi or lo), int(rank)
        except ValueError:
            raise FlashError(f"--rank-per-layer {spec}: expected LAYERS:RANK[,...] such as 26-29:256") from None
        if not 0 <= lo <= hi < n_layers or rank < 1:
            raise FlashError(f"--rank-per-layer {spec}: layers must lie in 0..{n_layers - 1} and "
                             "ranks be >= 1")
        out.update({i: rank for i in range(lo, hi + 1)})
    return out


def default_kind(gated: bool, activation: str) -> str:
    """Gated models: low-rank-gate (a logistic low-rank classifier cannot express |act(g)| > t,
    which holds on both lobes of silu/gelu); product-threshold models (whose rule needs up x as
    well as the gate): quant-glu; others: the paper's low-rank predictor."""
    if activation == "product":
        return "quant-glu"
    return "low-rank-gate" if gated else "low-rank"


def check_kind(kind: str, gated: bool, activation: str):
    if kind not in KINDS:
        raise FlashError(f"--kind {kind}: unknown (choose from {', '.join(KINDS)})")
    if kind in GATE_MASKS and not gated:
        raise FlashError(f"--kind {kind}: the model's FFN has no gate projection "
                         "(use exact-relu or low-rank)")
    if kind in GATE_MASKS and activation == "product":
        raise FlashError(f"--kind {kind}: a product-threshold model keeps a neuron by |silu(gate x) * "
                         "up x|, which the gate alone does not tell (use quant-glu or low-rank)")
    if kind == "quant-glu" and activation != "product":
        raise FlashError(f"--kind {kind}: scores |act(gate x) * up x|, the rule of a product-threshold "
                         f"model only (relufy --activation product); this model's is {activation}")
    if kind == "exact-relu" and (gated or activation != "relu"):
        raise FlashError(f"--kind exact-relu: needs an ungated ReLU FFN, the model's is "
                         f"{'gated ' if gated else ''}{activation} (use gate-threshold or low-rank)")


def calibrate_layer(layer, ffn, x: np.ndarray, dtype, n_train: int, *, kind, target_sparsity,
                    rank, prob_threshold, epochs, max_window, seed, recall=DEFAULTS["recall"],
                    loader=None, gate_bits=DEFAULTS["gate_bits"], resident_gate=False):
    """(predictors.json entry, low-rank factors or None) for one layer; x = its FFN inputs.
    loader: the pack's FlashLoader; with it stats.read_s holds what the held-out predictions
    read per token (sparse.budget.measured_read_seconds), for the memory plan. resident_gate:
    the pack holds this layer's gate resident (quant-glu then copies up alone)."""
    abs_act = layer_activations(ffn, x, dtype)
    n = abs_act.shape[1]
    threshold = layer_threshold(ffn, abs_act[:n_train], target_sparsity)
    active = abs_act > threshold
    del abs_act
    factors, cut, quant = None, 0.0, None
    if kind == "low-rank":
        factors = train_low_rank(x[:n_train], active[:n_train], rank, epochs=epochs, seed=seed + layer)
    elif kind in SCORED:
        if kind in COPIES:
            factors = quantized_copy(ffn, gate_bits, roles=copied_roles(kind, resident_gate))
            quant = {"bits": gate_bits, "group_size": GATE_GROUP_SIZE}
        else:
            factors = fit_low_rank_gate(ffn, x[:n_train], rank)
        approx = layer_predictor(layer, kind, ffn, n, factors=factors, quantization=quant,
                                 resident_gate=resident_gate)
        score = np.concatenate([np.array(approx.gate_score(mx.array(x[s: min(s + 2048, n_train)])))
                                for s in range(0, n_train, 2048)])
        cut = recall_cut(score, active[:n_train], recall)
        del score
    pred = layer_predictor(layer, kind, ffn, n, threshold=threshold, factors=factors,
                           prob_threshold=prob_threshold, cut=cut, quantization=quant,
                           resident_gate=resident_gate)
    predicted = predict_masks(pred, x[n_train:], dtype)
    stats = prediction_stats(active[n_train:], predicted)
    stats["train_active"] = float(active[:n_train].mean())
    if loader is not None:
        stats["read_s"] = measured_read_seconds(loader, layer, predicted, max_window)
        stats["read_s"]["cache"] = measured_cache_read_seconds(loader, layer, predicted, CACHE_WINDOW)
    entry = {"kind": kind, "n_neurons": n, "rank": pred.rank, "threshold": threshold,
             "prob_threshold": prob_threshold, "cut": cut, "activation": ffn.activation, "stats": stats,
             "capacity": window_capacity(predicted, max_window)}
    if quant:
        entry.update(quant)
    return entry, factors


def format_report(layers: dict, window=5) -> str:
    """Per-layer table like the paper's appendix B (percent of the layer's neurons per token)."""
    lines = [f"{'layer':>5} {'kind':>14} {'rank':>5} {'t':>8} {'active%':>8} {'pred%':>7} "
             f"{'both%':>7} {'recall%':>8} {'over-pred':>9} {'Req_1':>6} {'Req_' + str(window):>6}"]
    for i in sorted(layers):
        e, s = layers[i], layers[i]["stats"]
        caps = e["capacity"]
        lines.append(f"{i:>5} {e['kind']:>14} {e['rank']:>5} {e['threshold']:>8.4f} "
                     f"{100 * s['active']:>8.1f} {100 * s['predicted']:>7.1f} {100 * s['both']:>7.1f} "
                     f"{100 * s['recall']:>8.2f} {s['over_prediction']:>9.2f} {caps[0]:>6} "
                     f"{caps[min(window, len(caps)) - 1]:>6}")
    mean = {k: np.mean([layers[i]["stats"][k] for i in layers]) for k in
            ("active", "predicted", "both", "recall", "over_prediction")}
    lines.append(f"{'mean':>5} {'':>14} {'':>5} {'':>8} {100 * mean['active']:>8.1f} "
                 f"{100 * mean['predicted']:>7.1f} {100 * mean['both']:>7.1f} "
                 f"{100 * mean['recall']:>8.2f} {mean['over_prediction']:>9.2f}")
    return "\n".join(lines)


def resolve_settings(data: CalibrationData, *, kind=None, target_sparsity=None, rank=None,
                     rank_per_layer=None, threshold=None, epochs=None, recall=None,
                     max_window=MAX_WINDOW, gate_bits=None) -> dict:
    """Checked calibration settings with the defaults filled in (FlashError naming the flag)."""
    gated, activation = data.gated, data.activation
    kind = kind or default_kind(gated, activation)
    check_kind(kind, gated, activation)
    relu = activation == "relu" and not gated
    if target_sparsity is None:  # relufied models: their own sparsity (FATReLU zeros, CATS thresholds)
        target_sparsity = 0.0 if relu or activation in ("fatrelu", "cats", "product") else DEFAULTS["target_sparsity"]
    if not 0 <= target_sparsity < 1:
        raise FlashError(f"--target-sparsity {target_sparsity}: must be in [0, 1)")
    if relu and target_sparsity > 0:
        raise FlashError(f"--target-sparsity {target_sparsity}: ReLU models use their natural "
                         "sparsity (threshold 0); leave it out")
    if activation in ("cats", "product") and target_sparsity > 0:
        raise FlashError(f"--target-sparsity {target_sparsity}: a {'CATS' if activation == 'cats' else 'product-threshold'} "
                         "model's thresholds are its own (config.json activation_threshold); leave it out")
    if kind in ("all", "exact-relu"):
        target_sparsity = 0.0
    prob_threshold = DEFAULTS["threshold"] if threshold is None else float(threshold)
    if not 0 < prob_threshold < 1:
        raise FlashError(f"--threshold {prob_threshold}: the predictor's sigmoid cutoff must be in (0, 1)")
    recall = DEFAULTS["recall"] if recall is None else float(recall)
    if not 0 < recall <= 1:
        raise FlashError(f"--recall {recall}: must be in (0, 1]")
    rank = DEFAULTS["rank"] if rank is None else int(rank)
    if rank < 1:
        raise FlashError(f"--rank {rank}: must be >= 1")
    epochs = DEFAULTS["epochs"] if epochs is None else int(epochs)
    if epochs < 1:
        raise FlashError(f"--epochs {epochs}: must be >= 1")
    if not 1 <= max_window <= 64:
        raise FlashError(f"--max-window {max_window}: must be in 1..64")
    n_layers = len(data.manifest.bundles)
    ranks = dict(rank_per_layer) if isinstance(rank_per_layer, dict) else \
        parse_rank_per_layer(rank_per_layer, n_layers)
    gate_bits = DEFAULTS["gate_bits"] if gate_bits is None else int(gate_bits)
    if gate_bits not in GATE_BITS:
        raise FlashError(f"--gate-bits {gate_bits}: choose one of {', '.join(map(str, GATE_BITS))}")
    return {"kind": kind, "target_sparsity": float(target_sparsity), "rank": rank,
            "rank_per_layer": ranks, "prob_threshold": prob_threshold, "recall": recall,
            "epochs": epochs, "max_window": max_window, "gate_bits": gate_bits}


def fit_predictors(data: CalibrationData, out_pack=None, *, seed=0, progress=True, say=None,
                   **settings) -> dict:
    """Fit every layer's predictor on `data` and write predictors.json/.safetensors into
    `out_pack` (default: the calibrated pack). settings: see resolve_settings. Returns the json."""
    say = say or (lambda *a: None)
    st = resolve_settings(data, **settings)
    kind = st["kind"]
    n_tok = len(next(iter(data.xs.values())))
    say(f"Calibrating {data.pack}: {n_tok} tokens ({data.n_train} train, {n_tok - data.n_train} "
        f"held out) from {len(data.texts)} file(s), {len(data.ffns)} layers, kind {kind}, "
        f"{data.activation}{' gated' if data.gated else ''}, target sparsity {st['target_sparsity']:g}"
        + (f", rank {st['rank']}" if kind in LOW_RANK else "")
        + (f", threshold {st['prob_threshold']:g}" if kind == "low-rank" else "")
        + (f", recall {st['recall']:g}" if kind in SCORED else "")
        + (f", {st['gate_bits']}-bit gate" if kind == "quant-gate" else "")
        + ((f", {st['gate_bits']}-bit up, the resident gate" if all(b.resident_gate for b in data.manifest.bundles)
            else f", {st['gate_bits']}-bit gate and up") if kind == "quant-glu" else ""))
    layers, factors = {}, {}
    t0 = time.perf_counter()
    loader = FlashLoader(out_pack or data.pack) if Path(out_pack or data.pack).is_dir() else None
    bundles = layer_bundles(data.manifest)
    try:
        for i in tqdm(sorted(data.ffns), desc=f"{kind} predictors", unit="layer", disable=not progress):
            entry, f = calibrate_layer(i, data.ffns[i], data.xs[i], data.dtype, data.n_train, kind=kind,
                                       target_sparsity=st["target_sparsity"],
                                       rank=st["rank_per_layer"].get(i, st["rank"]),
                                       prob_threshold=st["prob_threshold"], epochs=st["epochs"],
                                       max_window=st["max_window"], seed=seed, recall=st["recall"],
                                       loader=loader, gate_bits=st["gate_bits"],
                                       resident_gate=bool(bundles[i].resident_gate))
            layers[i] = entry
            if f is not None:
                factors[i] = f
    finally:
        if loader is not None:
            loader.close()
    calib = {k: v for k, v in st.items() if k != "rank_per_layer"}
    calib.update(rank_per_layer={str(k): v for k, v in sorted(st["rank_per_layer"].items())},
                 tokens=n_tok, train_tokens=data.n_train, holdout_tokens=n_tok - data.n_train,
                 texts=[Path(f).name for f in data.texts], capacity_percentile=CAPACITY_PERCENTILE,
                 seed=seed, seconds=round(time.perf_counter() - t0, 1))
    out = Path(out_pack or data.pack)
    path = save_predictors(out, {"activation": data.activation, "calibration": calib}, layers, factors)
    say(format_report(layers))
    say(f"Wrote {path}")
    return read_predictors_json(out)


def preflight(pack_dir, text_files, **settings) -> dict:
    """Every check that needs no dense pass, before it: the settings (resolve_settings on what the
    manifest and config say), the text files readable, the pack writable (predictors go into it).
    Returns the resolved settings."""
    from types import SimpleNamespace

    from ..pack import read_manifest
    from .dense_pass import ffn_activation

    pack = Path(pack_dir)
    if not pack.is_dir():
        raise FlashError(f"--model {pack}: no such pack directory")
    manifest = read_manifest(pack)
    gated = manifest.bundles[0].gated
    shape = SimpleNamespace(gated=gated, activation=ffn_activation(manifest["config"], manifest),
                            manifest=manifest)
    st = resolve_settings(shape, **settings)
    check_text_files(text_files)
    check_writable(pack, "--model")
    return st


def check_text_files(text_files) -> None:
    """FlashError naming --text unless every file is a readable regular file."""
    if not text_files:
        raise FlashError("--text: give at least one calibration text file")
    for f in text_files:
        p = Path(f)
        if not p.is_file():
            raise FlashError(f"--text {p}: no such file")
        if not os.access(p, os.R_OK):
            raise FlashError(f"--text {p}: not readable")


def check_writable(folder: Path, flag: str) -> None:
    """FlashError naming `flag` unless a file can be created in `folder` (tried, then removed)."""
    probe = Path(folder) / f".mlx-flash-write-check-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise FlashError(f"{flag} {folder}: cannot write into it ({e.strerror or e})") from None


def calibrate(pack_dir, text_files, *, max_tokens=None, seed=0, progress=True, **settings) -> dict:
    """Calibrate predictors for every FFN layer of a flash pack and write them into the pack.

    text_files: calibration text (UTF-8). settings (resolve_settings): kind; target_sparsity
    (fraction of gated activations thresholded away; ReLU models: 0, their natural sparsity);
    rank (low-rank rank), rank_per_layer ({layer: rank} or "26-29:256"); threshold (low-rank
    sigmoid cutoff); recall (low-rank-gate target recall); epochs; max_window (tokens).
    max_tokens: calibration tokens used at most. Returns the written predictors.json as a dict.
    """
    say = (lambda *a: print(*a, flush=True)) if progress else None
    preflight(pack_dir, text_files, **settings)  # minutes of dense pass follow: fail first
    data = collect_inputs(pack_dir, text_files, max_tokens=max_tokens,
                          max_window=settings.get("max_window", MAX_WINDOW), progress=progress)
    return fit_predictors(data, seed=seed, progress=progress, say=say, **settings)
