"""MoEfication: turn a dense llama-family model into an mlx-lm `mixtral` MoE with real routing.

No real MoE checkpoint ships offline and random routers route uniformly, so the expert cache and
predictors are measured on a model derived from the embedded dense one:

1. Record each layer's FFN input x on training text (a dense forward pass).
2. Neuron activations a = silu(gate x) * up x [tokens, F]; each neuron's pattern is |a| over the
   tokens (unit-normalised). Balanced k-means (equal-size clusters, greedy capacity-constrained
   assignment each iteration) splits the F neurons into E experts of F/E neurons that fire together.
3. A linear router per layer [E, hidden] fitted on the recorded x (ridge least squares) to each
   token's share of activation mass per expert (sum over its neurons of |a_n| * ||down_n||); the
   top-k experts by mass are the target its top-k is scored against.
4. The mixtral model, in float (`dtype`; a quantized source is dequantized first): attention,
   norms and embeddings copied; the FFN split (expert e = its neurons' gate/up rows and down columns), the
   down matrices scaled by k and the router logits shrunk to a tiny spread so mixtral's softmax over
   the top-k gives each chosen expert ~1/k: the MoE layer computes ~ the sum of its chosen experts
   of the dense FFN (exactly the dense FFN when every expert is chosen with a zero router; tested).

The output folder's config carries `"derived_from"` and `"moefied"` and a README says how it was made.
"""

import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..errors import FlashError
from ..model_folder import write_model_folder

ROUTER_SPREAD = 0.01  # std of the shipped router logits: mixtral's top-k softmax ~ 1/k each


class _Recorder(nn.Module):
    """Wraps a layer's MLP: records its input, returns the MLP's output."""

    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp
        self.inputs = []

    def __call__(self, x):
        self.inputs.append(x)
        return self.mlp(x)


def record_ffn_inputs(model, tokens, seq_len=256):
    """{layer: float32 np.ndarray [tokens, hidden]} of each layer's FFN input over `tokens`."""
    layers = model.model.layers
    recorders = [_Recorder(layer.mlp) for layer in layers]
    for layer, r in zip(layers, recorders):
        layer.mlp = r
    xs = {i: [] for i in range(len(layers))}
    try:
        for s in range(0, len(tokens) - 1, seq_len):
            model(mx.array(tokens[s: s + seq_len])[None])
            got = [r.inputs.pop() for r in recorders]
            mx.eval(got)
            for i, x in enumerate(got):
                xs[i].append(np.array(x.reshape(-1, x.shape[-1]).astype(mx.float32)))
    finally:
        for layer, r in zip(layers, recorders):
            layer.mlp = r.mlp
    return {i: np.concatenate(v) for i, v in xs.items()}


def dense_ffn(mlp, dtype):
    """(gate [F, H], up [F, H], down [H, F]) of a llama MLP (float, after dequantize_model)."""
    return tuple(getattr(mlp, n).weight.astype(dtype) for n in ("gate_proj", "up_proj", "down_proj"))


def balanced_kmeans(features: np.ndarray, k: int, iters=15, seed=0) -> np.ndarray:
    """Cluster id [N] of each row of `features` [N, D]: k clusters of exactly N/k rows each."""
    n = features.shape[0]
    if n % k:
        raise FlashError(f"--experts {k}: must divide the FFN width {n}")
    size = n // k
    rng = np.random.default_rng(seed)
    centroids = features[rng.choice(n, k, replace=False)]
    assign = np.zeros(n, np.int64)
    for _ in range(iters):
        dist = ((features ** 2).sum(1)[:, None] - 2 * features @ centroids.T
                + (centroids ** 2).sum(1)[None, :])
        order = np.argsort(dist, axis=None, kind="stable")
        assign[:] = -1
        fill = np.zeros(k, np.int64)
        for flat in order:
            i, c = divmod(int(flat), k)
            if assign[i] < 0 and fill[c] < size:
                assign[i] = c
                fill[c] += 1
        new = np.stack([features[assign == c].mean(0) for c in range(k)])
        if np.allclose(new, centroids):
            break
        centroids = new
    return assign


def train_router(x: np.ndarray, target: np.ndarray, ridge=1e-2) -> np.ndarray:
    """Router weight [E, H]: ridge least squares of `target` [T, E] (each token's share of
    activation mass per expert) on x [T, H]; no bias (mixtral's router has none)."""
    gram = x.T.astype(np.float64) @ x
    gram += ridge * np.trace(gram) / gram.shape[0] * np.eye(gram.shape[0])
    return np.linalg.solve(gram, x.T.astype(np.float64) @ target).T.astype(np.float32)


def moefy(model, config, tokens, src, out, *, experts=16, top_k=4, seq_len=256, seed=0,
          dtype="float32", text_label=(), progress=True) -> dict:
    """Write the MoEfied mixtral folder `out` from the dense llama-family `model` (its `config`;
    `tokens` int32 training token ids; `src` its folder, for the tokenizer files and the label;
    `text_label` the training files, recorded in the config).

    Returns {"layers": [{"router_recall_train": fraction of the true top-k experts (by activation
    mass) the shipped router picks on the training tokens}], "tokens": training tokens,
    "seconds": wall time}.
    """
    from tqdm import tqdm

    t0 = time.perf_counter()
    src, out = Path(src), Path(out)
    if config.get("model_type") not in ("llama", "mistral"):
        raise FlashError(f"--model {src}: MoEfication needs a llama-family dense model "
                         f"(model_type {config.get('model_type')!r})")
    from mlx_lm.utils import dequantize_model

    # Float throughout: the experts are split per neuron (a quantization group spans neurons)
    # and float matmuls run on BLAS, far faster than MLX's CPU quantized matmuls for prompts.
    model = dequantize_model(model)
    model.set_dtype(getattr(mx, dtype))
    ffn_width = config["intermediate_size"]
    if experts < 2 or ffn_width % experts:
        raise FlashError(f"--experts {experts}: must be >= 2 and divide the FFN width {ffn_width}")
    if not 1 <= top_k <= experts:
        raise FlashError(f"--top-k {top_k}: must be in 1..{experts}")
    xs = record_ffn_inputs(model, tokens, seq_len)
    dtype = getattr(mx, dtype)
    weights = {k: v for k, v in tree_flatten(model.parameters()) if ".mlp." not in k}
    report = []
    for i, layer in enumerate(tqdm(model.model.layers, desc="moefy", unit="layer",
                                   disable=not progress)):
        gate, up, down = dense_ffn(layer.mlp, dtype)
        x = mx.array(xs[i]).astype(dtype)
        act = np.array((nn.silu(x @ gate.T) * (x @ up.T)).astype(mx.float32))  # [T, F]
        pattern = np.abs(act).T
        pattern /= np.linalg.norm(pattern, axis=1, keepdims=True) + 1e-12
        assign = balanced_kmeans(pattern, experts, seed=seed)
        order = np.argsort(assign, kind="stable")  # neurons of expert 0, then 1, ...
        down_norm = np.linalg.norm(np.array(down.astype(mx.float32)), axis=0)
        mass = np.zeros((act.shape[0], experts), np.float32)
        for e in range(experts):
            mass[:, e] = (np.abs(act[:, assign == e]) * down_norm[assign == e]).sum(1)
        top = np.argpartition(-mass, top_k - 1, axis=1)[:, :top_k]
        w = train_router(xs[i], mass / (mass.sum(1, keepdims=True) + 1e-12))
        w = w * (ROUTER_SPREAD / max(float(np.std(xs[i] @ w.T)), 1e-12))
        picked = np.argpartition(-(xs[i] @ w.T), top_k - 1, axis=1)[:, :top_k]
        recall = float(np.mean((picked[:, :, None] == top[:, None, :]).any(-1)))
        idx = mx.array(order.reshape(experts, -1))
        p = f"model.layers.{i}.block_sparse_moe"
        weights[f"{p}.gate.weight"] = mx.array(w).astype(dtype)
        weights[f"{p}.switch_mlp.gate_proj.weight"] = gate[idx]
        weights[f"{p}.switch_mlp.up_proj.weight"] = up[idx]
        weights[f"{p}.switch_mlp.down_proj.weight"] = (down.T[idx] * top_k).swapaxes(1, 2)
        mx.eval([v for k, v in weights.items() if k.startswith(p)])
        report.append({"layer": i, "router_recall_train": recall})
        del act, pattern
    out_cfg = dict(config)
    for key in ("architectures", "gguf_metadata", "source"):
        out_cfg.pop(key, None)
    out_cfg.update({
        "model_type": "mixtral", "num_local_experts": experts, "num_experts_per_tok": top_k,
        "intermediate_size": ffn_width // experts, "rope_traditional": False,
        "derived_from": str(src), "moefied": {
            "method": "MoEfication: balanced k-means on neuron co-activation, linear routers",
            "experts": experts, "top_k": top_k, "train_tokens": int(len(tokens)),
            "train_files": [str(f) for f in text_label][:40], "seed": seed},
    })
    out_cfg.pop("quantization", None)
    out_cfg.pop("quantization_config", None)
    _write_folder(src, out, weights, out_cfg)
    return {"layers": report, "tokens": int(len(tokens)), "seconds": time.perf_counter() - t0}


def _write_folder(src, out, weights, config):
    """The mixtral folder `out` with a README saying how it was derived, replacing an existing one."""
    m = config["moefied"]
    readme = (
        f"# Derived model: MoEfied {Path(config['derived_from']).name}\n\n"
        f"Not a trained MoE. Built by `python -m mlx_flash.moefy` from the dense model's own weights: "
        f"each FFN's {config['intermediate_size'] * m['experts']} neurons split into {m['experts']} "
        f"experts by balanced k-means on their co-activation over {m['train_tokens']} tokens of "
        f"text, with a linear router per layer trained to pick the top-{m['top_k']} experts by "
        f"activation mass. It exists to measure expert caching and prediction on real routing.\n")
    write_model_folder(out, weights, config, src, texts={"README.md": readme}, replace=True)
