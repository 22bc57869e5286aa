"""Relufication: make a SwiGLU llama's FFN activations sparse by swapping its gate activation for a
ReLU-family one and fine-tuning (LLM in a flash, section 3.1 and appendix C.4; Mirzadeh et al.
2023; FATReLU: Song et al. 2024).

The swap: silu(gate x) * up x  ->  relu(gate x) * up x  (or FATReLU with a threshold t, dReLU
relu(gate x) * relu(up x), or CATS: silu kept where |silu(gate x)| > t, else 0); the model becomes mlx-flash's `relu_llama` type (models/relu_llama.py,
mlx-lm's llama with that MLP, same weight names). Fine-tuning runs with MLX on the CPU in float32
(quantized sources are dequantized): AdamW on every weight but the (tied) embeddings, loss =
next-token cross-entropy + `distill` x KL(teacher || student) where the teacher is the frozen
original model. Sparsity is measured as the fraction of FFN hidden values that are exactly 0 (a
neuron whose weights a flash runtime need not read for that token).

A run's folder (`out`): checkpoints/ as training.py lays them out (the newest `keep_checkpoints`
kept, 0: all), and the final model beside them: config.json, model.safetensors, tokenizer files,
relufication.json.
"""

import math
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import FlashError
from ..model_folder import read_config
from ..paths import write_json_atomic
from ..models.relu_llama import ACTIVATIONS, THRESHOLDED, ActiveFractions, gated_hidden
from .relufication_choices import ALLOCATIONS, DECAYS, KEEP_CHECKPOINTS  # noqa: F401
from .training import (CHECKPOINTS, FINAL_LR_FRACTION, OPTIMIZER_FILE, SEQ_LEN,  # noqa: F401
                       TRAINER_JSON, WEIGHTS_FILE, batch_indices, ce_and_kl, check_disjoint,
                       checkpoint_dirs, compiled_update, distill_kl, kernels_off, make_optimizer,
                       next_token_nll, prune_checkpoints, restore_trainer, save_checkpoint, start_run,
                       text_sequences, train_loop, trainer_state, write_model_folder)

REPORT_JSON = "relufication.json"
SOURCE_TYPES = ("llama", "mistral", "relu_llama")  # llama-family MLPs: gate_proj / up_proj / down_proj
FROZEN = ("model.embed_tokens",)                   # tied input/output embeddings stay as they are


# ---- activation and model ------------------------------------------------------------------------

def parse_activation(spec: str) -> tuple:
    """(hidden_act, threshold) from "relu", "fatrelu:T" / "cats:T" / "product:T" (T >= 0: gate units
    for fatrelu, |silu| units for cats, |silu(gate) * up| units for product), "fatrelu" / "cats" /
    "product" (threshold None: per-layer thresholds from a target sparsity, see gate_thresholds) or
    "drelu"."""
    name, sep, arg = str(spec).partition(":")
    if name not in ACTIVATIONS:
        raise FlashError(f"--activation {spec}: expected relu, fatrelu[:T], cats[:T], product[:T] or drelu")
    if name not in THRESHOLDED:
        if sep:
            raise FlashError(f"--activation {spec}: {name} takes no threshold")
        return name, 0.0
    if not sep:
        return name, None
    try:
        threshold = float(arg)
    except ValueError:
        raise FlashError(f"--activation {spec}: {name} needs a number after the colon, e.g. {name}:0.1") from None
    if not math.isfinite(threshold) or threshold < 0:
        raise FlashError(f"--activation {spec}: the threshold must be a finite number >= 0")
    return name, threshold


def load_float32(path: Path):
    """(model, config) of an mlx-lm folder, every weight float32 (quantized ones dequantized)."""
    from mlx.utils import tree_flatten

    from ..models import build_model as build_any_model
    from ..models import load_model
    from .dense_pass import dequantized

    config = read_config(path)
    if config.get("model_type") not in SOURCE_TYPES:
        raise FlashError(f"--model {path}: model_type {config.get('model_type')!r}; relufication "
                         f"needs a llama-family gated FFN ({', '.join(SOURCE_TYPES)})")
    quantized, _ = load_model(Path(path), lazy=True)
    weights = dequantized(dict(tree_flatten(quantized.parameters())), config.get("quantization"))
    model = build_any_model({k: v for k, v in config.items() if k != "quantization"})
    model.load_weights([(k, v.astype(mx.float32)) for k, v in weights.items()])
    mx.eval(model.parameters())
    model.eval()
    return model, config


def relufied_config(config: dict, hidden_act: str, threshold) -> dict:
    """The relu_llama config.json of a llama config (float weights: no quantization);
    threshold: one number or a list with one per layer."""
    out = {k: v for k, v in config.items() if k not in ("quantization", "architectures")}
    out.update(model_type="relu_llama", hidden_act=hidden_act,
               activation_threshold=[float(t) for t in threshold] if isinstance(threshold, (list, tuple))
               else float(threshold))
    return out


class _GateRecorder(nn.Module):
    def __init__(self, linear, store: list):
        super().__init__()
        self.linear, self._store = linear, store

    def __call__(self, x):
        y = self.linear(x)
        self._store.append(y)
        return y


def gate_thresholds(model, sequences: np.ndarray, target_sparsity, hidden_act: str = "fatrelu") -> list:
    """Per layer, the threshold that silences `target_sparsity` (one fraction, or one per layer) of
    the hidden values of `model` (the original SiLU model) over `sequences`: for "fatrelu" the
    quantile of gate x, floored at 0; for "cats" the quantile of |silu(gate x)|; for "product" the
    quantile of |silu(gate x) * up x|."""
    gates, ups = [], []
    layers = mlps(model)
    for mlp in layers:
        mlp.gate_proj = _GateRecorder(mlp.gate_proj, gates)
        if hidden_act == "product":
            mlp.up_proj = _GateRecorder(mlp.up_proj, ups)
    try:
        model(mx.array(sequences))
        mx.eval(gates, ups)
    finally:
        for mlp in layers:
            mlp.gate_proj = mlp.gate_proj.linear
            if hidden_act == "product":
                mlp.up_proj = mlp.up_proj.linear
    if hidden_act == "cats":
        gates = [mx.abs(nn.silu(g)) for g in gates]
    if hidden_act == "product":
        gates = [mx.abs(nn.silu(g) * u) for g, u in zip(gates, ups)]
    targets = list(target_sparsity) if isinstance(target_sparsity, (list, tuple, np.ndarray)) \
        else [target_sparsity] * len(gates)
    return [max(0.0, float(np.quantile(np.array(g).ravel(), t))) for g, t in zip(gates, targets)]


SENSITIVITY_LEVELS = (0.70, 0.78, 0.86, 0.94)  # per-layer sparsities whose cost is measured


def layer_sensitivity(teacher, sequences: np.ndarray, levels=SENSITIVITY_LEVELS,
                      threshold_sequences=None) -> np.ndarray:
    """float64 [layers, levels]: KL(original || original with only layer l's FFN CATS-thresholded
    to silence `levels[j]` of its values), nats per token over `sequences` (int32 [n, L]); the
    thresholds are gate_thresholds' on `threshold_sequences` (default: `sequences`). Cost: one
    forward pass, then per layer and level the layers from l to the last."""
    thresholds = [gate_thresholds(teacher, sequences if threshold_sequences is None else threshold_sequences,
                                  level, "cats") for level in levels]
    tokens = mx.array(sequences)
    logits, streams = forward_hidden(teacher, tokens)
    inner = teacher.model
    inputs = [inner.embed_tokens(tokens)] + streams[:-1]
    kl = np.zeros((len(inner.layers), len(levels)))
    for layer, block in enumerate(inner.layers):
        mid, x = attention_half(block, inputs[layer])
        mlp = block.mlp
        for j in range(len(levels)):
            out = mid + mlp.down_proj(gated_hidden(mlp.gate_proj(x), mlp.up_proj(x), "cats", thresholds[j][layer]))
            for later in inner.layers[layer + 1:]:
                out = later(out, "causal")
            kl[layer, j] = float(distill_kl(output_logits(teacher, out), logits).item())
    return kl


def allocate_sparsity(kl: np.ndarray, levels, mean_sparsity: float, step: float = 0.005) -> list:
    """Per-layer target sparsities whose mean is `mean_sparsity` (within `step`), chosen to
    minimise the sum of the layers' KL costs (layer_sensitivity's, interpolated linearly in log KL
    between the measured levels, so between levels[0] and levels[-1]): greedily, from every layer
    at levels[0], raise by `step` the layer whose cost grows least."""
    levels = np.asarray(levels, dtype=np.float64)
    if not levels[0] <= mean_sparsity <= levels[-1]:
        raise FlashError(f"--target-sparsity {mean_sparsity}: a sensitivity allocation needs it between "
                         f"{levels[0]} and {levels[-1]}")
    grid = np.arange(levels[0], levels[-1] + step / 2, step)
    cost = np.exp(np.stack([np.interp(grid, levels, np.log(np.maximum(row, 1e-12))) for row in kl]))
    at = np.zeros(len(kl), dtype=int)
    while grid[at].mean() < mean_sparsity - 1e-9:
        growth = np.where(at + 1 < len(grid), cost[np.arange(len(kl)), np.minimum(at + 1, len(grid) - 1)]
                          - cost[np.arange(len(kl)), at], np.inf)
        at[int(np.argmin(growth))] += 1
    return [float(v) for v in grid[at]]


def build_model(config: dict, weights: dict):
    """A relu_llama model from its config and float32 weights {name: mx.array}."""
    from ..models import build_model as build_any_model

    model = build_any_model(config)
    model.load_weights(list(weights.items()))
    mx.eval(model.parameters())
    return model


def freeze_embeddings(model):
    """Train everything but the tied embeddings (their weight gradient is the lm_head's: a
    [tokens, vocab] x [vocab, hidden] product per step, for rows most text never touches)."""
    model.unfreeze()
    for name in FROZEN:
        module = model
        for part in name.split("."):
            module = getattr(module, part)
        module.freeze()


def mlps(model):
    return [layer.mlp for layer in model.layers]


def attention_half(block, h):
    """(mid, x) of a llama decoder layer on its input residual stream h [B, L, hidden] (causal
    mask, no cache): mid = h + attention(input norm h), the stream after the attention, and
    x = post-attention norm of mid, the FFN's input; the layer's output is mid + block.mlp(x)."""
    mid = h + block.self_attn(block.input_layernorm(h), "causal")
    return mid, block.post_attention_layernorm(mid)


# ---- text ------------------------------------------------------------------------------------------

def split_by_file(files, every: int = 10) -> tuple:
    """(train, heldout): the files sorted by path, every `every`-th (from the first) held out."""
    files = sorted({str(Path(f)) for f in files})
    heldout = files[::every]
    return [f for f in files if f not in heldout], heldout


# ---- losses and measurements -------------------------------------------------------------------------

def measure(model, sequences: np.ndarray, batch_size: int = 4) -> dict:
    """Held-out quality and sparsity of a model over int32 `sequences` [n, L] (each predicts its
    tokens 1..L-1; batch_size sequences per forward pass): {"ppl", "tokens", "sparsity" (fraction
    of FFN hidden values == 0, all layers), "sparsity_per_layer" [layers]} (sparsity None for a
    model without ReLU-family MLPs, e.g. a dense SiLU or a mixtral model)."""
    record = ActiveFractions()
    relu = all(hasattr(getattr(layer, "mlp", None), "record") for layer in model.layers)
    layers = mlps(model) if relu else []
    if relu:
        for m in layers:
            m.record = record
    nll_sum, count, active = 0.0, 0, np.zeros(len(layers))
    try:
        for s in range(0, len(sequences), batch_size):
            tokens = mx.array(sequences[s: s + batch_size])
            record.fractions.clear()
            nll = next_token_nll(model(tokens), tokens)
            mx.eval(nll, *record.fractions)
            nll_sum += float(mx.sum(nll).item())
            count += int(nll.size)
            if relu:
                active += np.array([f.item() for f in record.fractions]) * tokens.shape[0]
    finally:
        for m in layers:
            m.record = None
    per_layer = (1 - active / len(sequences)).tolist() if relu else None
    return {"ppl": math.exp(nll_sum / count), "tokens": count,
            "sparsity": float(np.mean(per_layer)) if relu else None, "sparsity_per_layer": per_layer}


# ---- layer-wise fit ----------------------------------------------------------------------------------

def fit_layerwise(teacher, student, sequences: np.ndarray, *, ridge: float = 1e-3, batch_size: int = 16,
                  progress: bool = True) -> dict:
    """Layer-wise distillation of the swapped model before end-to-end training (in place, float32).

    Layers in order, both models run on `sequences` (int32 [n, L], n x L tokens). At layer l the
    student's FFN input x comes from the student's own residual stream (the layers before l
    already fitted) and its down projection is refit in closed form, by ridge least squares
        down = argmin_W  sum over tokens |W h(x) - (r_teacher - m_student)|^2 + lambda |W|^2
    where h(x) is the student's ReLU-family hidden vector (gate / up / threshold unchanged, so the
    sparsity is the swap's), m_student the student's residual stream after layer l's attention and
    r_teacher the teacher's residual stream after layer l: the refit FFN also corrects the
    drift the earlier layers left. lambda = ridge x the mean diagonal of sum h h^T.
    Cost: one forward pass of both models plus a [hidden x hidden] solve per layer.
    Returns {"tokens", "seconds", "relative_error" [per layer: mean |r_s - r_t|^2 / mean |r_t|^2
    after the fit]}."""
    from tqdm import tqdm

    t0 = time.perf_counter()
    tokens = mx.array(sequences)
    t_layers, s_layers = teacher.model.layers, student.model.layers
    h_t = h_s = teacher.model.embed_tokens(tokens)
    mx.eval(h_t)
    errors = []
    for layer in tqdm(range(len(s_layers)), desc="layer-wise fit", unit="layer", disable=not progress):
        t_block, s_block = t_layers[layer], s_layers[layer]
        mlp = s_block.mlp
        n_hidden = mlp.down_proj.weight.shape[1]
        bias = "bias" in mlp.down_proj
        gram = mx.zeros((n_hidden + bias, n_hidden + bias))
        cross = mx.zeros((n_hidden + bias, mlp.down_proj.weight.shape[0]))
        next_t, mid_s, x_s = [], [], []
        for s in range(0, len(sequences), batch_size):
            r_t = t_block(h_t[s: s + batch_size], "causal")
            m_s, x = attention_half(s_block, h_s[s: s + batch_size])
            h = gated_hidden(mlp.gate_proj(x), mlp.up_proj(x), mlp.hidden_act, mlp.threshold)
            h = h.reshape(-1, n_hidden)
            if bias:
                h = mx.concatenate([h, mx.ones((h.shape[0], 1), h.dtype)], axis=1)
            gram = gram + h.T @ h
            cross = cross + h.T @ (r_t - m_s).reshape(h.shape[0], -1)
            mx.eval(gram, cross, r_t, m_s, x)
            next_t.append(r_t)
            mid_s.append(m_s)
            x_s.append(x)
        lam = ridge * mx.mean(mx.diagonal(gram))
        w = mx.linalg.solve(gram + lam * mx.eye(gram.shape[0]), cross, stream=mx.cpu)
        mlp.down_proj.weight = w[:n_hidden].T
        if bias:
            mlp.down_proj.bias = w[n_hidden]
        mx.eval(mlp.parameters())
        h_t = mx.concatenate(next_t)
        h_s = mx.concatenate([m + mlp(x) for m, x in zip(mid_s, x_s)])  # the refit FFN on the same inputs
        mx.eval(h_s, h_t)
        errors.append(float(mx.mean(mx.square(h_s - h_t)).item() / mx.mean(mx.square(h_t)).item()))
    return {"tokens": int(np.asarray(sequences).size), "seconds": time.perf_counter() - t0,
            "relative_error": errors}


# ---- files -------------------------------------------------------------------------------------------

# ---- training ------------------------------------------------------------------------------------


def forward_hidden(model, tokens):
    """(logits [B, L, vocab], [residual stream after each layer, [B, L, hidden]]) of a llama-family
    model, computed as its own __call__ computes them (causal mask, no cache)."""
    inner = model.model
    h = inner.embed_tokens(tokens)
    streams = []
    for layer in inner.layers:
        h = layer(h, "causal")
        streams.append(h)
    return output_logits(model, h), streams


def output_logits(model, h):
    """Logits of a llama-family model from its last layer's residual stream h."""
    out = model.model.norm(h)
    return model.model.embed_tokens.as_linear(out) if model.args.tie_word_embeddings else model.lm_head(out)


def hidden_mse(student_streams, teacher_streams):
    """Mean over layers of mean |s - t|^2 / mean |t|^2: each layer's residual stream's relative
    squared error against the teacher's (the layer-wise fit's objective, per token)."""
    return mx.mean(mx.stack([mx.mean(mx.square(s - t)) / mx.mean(mx.square(t))
                             for s, t in zip(student_streams, teacher_streams)]))


def train_step_fn(model, optimizer, teacher=None, distill: float = 0.0, clip: float = 1.0,
                  hidden: float = 0.0, compiled: bool = True, fused_loss: bool = True):
    """step(tokens mx.array [B, L]) -> (loss, ce, kl, hidden_mse, sparsity) as floats, after one
    AdamW update. Loss = cross-entropy + distill x KL(teacher || model) + hidden x hidden_mse
    (the teacher runs only when a weight is > 0). compiled: the whole step (teacher forward,
    forward, backward, clipping, update) is one mx.compile'd function of the model's and the
    optimizer's state; a new token shape retraces it. fused_loss: ce_and_kl (False: next_token_nll
    and distill_kl, the reference formulation, same values, twice the exp passes)."""
    record = ActiveFractions()
    use_teacher = teacher is not None and (distill > 0 or hidden > 0)

    def loss_fn(tokens):
        record.fractions.clear()
        if hidden > 0:
            logits, streams = forward_hidden(model, tokens)
        else:
            logits, streams = model(tokens), None
        kl = hid = mx.array(0.0)
        t_logits = t_streams = None
        if use_teacher:
            t_logits, t_streams = forward_hidden(teacher, tokens) if hidden > 0 else (teacher(tokens), None)
            t_logits = mx.stop_gradient(t_logits) if distill > 0 else None
        if fused_loss:
            ce, kl = ce_and_kl(logits, tokens, t_logits)
        else:
            ce = mx.mean(next_token_nll(logits, tokens))
            if t_logits is not None:
                kl = distill_kl(logits, t_logits)
        if use_teacher and hidden > 0:
            hid = hidden_mse(streams, [mx.stop_gradient(t) for t in t_streams])
        active = mx.mean(mx.stack(record.fractions))
        return ce + distill * kl + hidden * hid, ce, kl, hid, active

    update = compiled_update(model, optimizer, loss_fn, clip=clip, compiled=compiled,
                             inputs=[teacher.state] if use_teacher else [])

    def step(tokens):
        for m in mlps(model):
            m.record = record
        try:
            with kernels_off():
                loss, ce, kl, hid, active = update(tokens)
                mx.eval(loss, ce, kl, hid, active, model.parameters(), optimizer.state)
        finally:
            for m in mlps(model):
                m.record = None
        return (float(loss.item()), float(ce.item()), float(kl.item()), float(hid.item()),
                1.0 - float(active.item()))

    return step


def restore_checkpoint(ckpt: Path, optimizer, config: dict):
    """(model, trainer state) from a checkpoint folder; the optimizer's state is restored in place."""
    state = restore_trainer(ckpt, optimizer)
    saved_config = read_config(ckpt)
    keys = ("hidden_act", "activation_threshold") if config.get("activation_threshold") is not None \
        else ("hidden_act",)  # per-layer thresholds: the run's own, from its checkpoint
    for key in keys:
        if saved_config.get(key) != config.get(key):
            raise FlashError(f"--resume: {ckpt} was trained with {key} {saved_config.get(key)!r}, "
                             f"this run asks for {config.get(key)!r}")
    model = build_model(saved_config, dict(mx.load(str(ckpt / WEIGHTS_FILE))))
    return model, state


def relufy(src: Path, train_files, out: Path, *, activation="relu", steps=200, batch_size=1,
           seq_len=SEQ_LEN, lr=5e-5, warmup=10, decay="constant", distill=0.0, hidden_distill=0.0, compiled=True,
           checkpoint_every=50, keep_checkpoints=KEEP_CHECKPOINTS, resume=False,
           seed=0, max_minutes=None, max_train_tokens=None, eval_files=(), eval_tokens=4096,
           target_sparsity=None, threshold_sequences=4, allocation="uniform", allocation_tokens=512,
           layerwise_tokens=0, layerwise_ridge=1e-3, progress=True, log=print) -> dict:
    """Swap src's gate activation for `activation` and fine-tune it for `steps` AdamW steps of
    batch_size x seq_len tokens on train_files; write checkpoints and the final model to `out`.

    target_sparsity: with activation "fatrelu", "cats" or "product" (no threshold), per-layer thresholds from
    gate_thresholds on the first `threshold_sequences` training sequences (fixed for the run).
    allocation: "uniform" (every layer at target_sparsity) or "sensitivity" (cats only: per-layer
    targets with mean target_sparsity from allocate_sparsity over layer_sensitivity measured on
    `allocation_tokens` training tokens; its minutes count in the run's time).
    hidden_distill: weight of hidden_mse (the residual streams' relative error against the
    original's, every layer) in the loss. compiled: mx.compile the training step.
    keep_checkpoints: after each checkpoint, delete all but the newest this many (0: keep all).
    max_minutes: stop early (after the step that crosses it), checkpoint, and write the model.
    layerwise_tokens: before the first step, fit_layerwise on this many training tokens (whole
    sequences, the last of the first epoch's seeded order; 0: off); its minutes count in the run's time and its tokens in
    tokens_trained, and the fitted model is checkpoint step 0.
    eval_files: held-out text measured (perplexity, sparsity; eval_tokens tokens) before training
    and on the final model, recorded in relufication.json.
    Returns the report dict written to out/relufication.json.
    """
    from ..models import load_tokenizer

    src, out = Path(src), Path(out)
    hidden_act, threshold = parse_activation(activation)
    if (threshold is None) != (target_sparsity is not None):
        raise FlashError(f"--activation {activation}: a per-layer threshold needs --target-sparsity and "
                         "--target-sparsity needs --activation fatrelu, cats or product (without :T)")
    if target_sparsity is not None and not 0 < target_sparsity < 1:
        raise FlashError(f"--target-sparsity {target_sparsity}: must be between 0 and 1")
    if keep_checkpoints < 0:
        raise FlashError(f"--keep-checkpoints {keep_checkpoints}: must be at least 0 (0: keep all)")
    if allocation not in ALLOCATIONS:
        raise FlashError(f"--sparsity-allocation {allocation}: expected one of {', '.join(ALLOCATIONS)}")
    if allocation != "uniform" and (hidden_act != "cats" or target_sparsity is None):
        raise FlashError(f"--sparsity-allocation {allocation}: needs --activation cats with --target-sparsity")
    if not resume and out.exists() and any(out.iterdir()):
        raise FlashError(f"--out {out}: already exists and is not empty (pass --resume to continue its run)")
    existing = start_run(out, resume, train_files, eval_files, log)
    tokenizer = load_tokenizer(src)
    teacher, src_config = load_float32(src)
    sequences = text_sequences(train_files, tokenizer, seq_len, max_train_tokens)
    prep_seconds, allocated = 0.0, None
    if threshold is None and not resume:
        targets = target_sparsity
        if allocation == "sensitivity":
            t0 = time.perf_counter()
            count = max(1, allocation_tokens // seq_len)
            kl = layer_sensitivity(teacher, sequences[threshold_sequences: threshold_sequences + count],
                                   threshold_sequences=sequences[:threshold_sequences])
            targets = allocate_sparsity(kl, SENSITIVITY_LEVELS, target_sparsity)
            prep_seconds = time.perf_counter() - t0
            allocated = {"levels": list(SENSITIVITY_LEVELS), "kl": kl.tolist(), "targets": targets,
                         "tokens": int(count * seq_len), "seconds": prep_seconds}
            log(f"sensitivity allocation ({prep_seconds / 60:.1f} min): per-layer targets "
                + " ".join(f"{t:.3f}" for t in targets))
        threshold = gate_thresholds(teacher, sequences[:threshold_sequences], targets, hidden_act)
    config = relufied_config(src_config, hidden_act, 0.0 if threshold is None else threshold)
    config["relufied_from"] = src_config.get("relufied_from") or str(src)
    eval_seqs = text_sequences(eval_files, tokenizer, seq_len, eval_tokens, flag="--eval-text") \
        if eval_files else None
    optimizer = make_optimizer(lr, warmup, steps=steps, decay=decay)
    if resume:
        if threshold is None:
            config["activation_threshold"] = None
        model, state = restore_checkpoint(existing[-1], optimizer, config)
        config["activation_threshold"] = model.args.activation_threshold
        log(f"resuming {existing[-1]} at step {state['step']} ({state['tokens_trained']} tokens trained)")
    else:
        from mlx.utils import tree_flatten

        model = build_model(config, dict(tree_flatten(teacher.parameters())))
        state = {"step": 0, "tokens_trained": 0, "seconds": prep_seconds, "losses": []}
        if allocated is not None:
            state["allocation"] = allocated
    state.update(activation=activation, target_sparsity=target_sparsity, batch_size=batch_size,
                 seq_len=seq_len, lr=lr, warmup=warmup, decay=decay, steps_planned=steps, distill=distill,
                 hidden_distill=hidden_distill, compiled=compiled, sparsity_allocation=allocation, seed=seed, train_sequences=int(len(sequences)),
                 train_files=[str(f) for f in train_files])
    freeze_embeddings(model)
    model.train()
    if distill <= 0 and hidden_distill <= 0:
        teacher = None
    step_fn = train_step_fn(model, optimizer, teacher, distill, hidden=hidden_distill, compiled=compiled)
    before = None
    if eval_seqs is not None and not resume:
        before = {"original": measure(load_float32(src)[0] if teacher is None else teacher, eval_seqs),
                  "swapped": measure(model, eval_seqs)}
        log(f"held-out before training: original ppl {before['original']['ppl']:.3f}, swapped ppl "
            f"{before['swapped']['ppl']:.3f}, sparsity {100 * before['swapped']['sparsity']:.1f}%")
    if layerwise_tokens and not resume:
        count = max(1, min(len(sequences), layerwise_tokens // seq_len))
        # the first epoch's last sequences: the first training steps then see text the fit did not
        chosen = np.sort(np.random.default_rng(seed).permutation(len(sequences))[-count:])
        fit = fit_layerwise(teacher if teacher is not None else load_float32(src)[0], model, sequences[chosen],
                            ridge=layerwise_ridge, progress=progress)
        state.update(tokens_trained=fit["tokens"], seconds=prep_seconds + fit["seconds"],
                     layerwise={**fit, "ridge": layerwise_ridge, "sequences": chosen.tolist()})
        save_checkpoint(out, model, optimizer, config, src, state, keep_checkpoints)
        if eval_seqs is not None:
            before["layerwise"] = measure(model, eval_seqs)
            log(f"held-out after the layer-wise fit ({fit['tokens']} tokens, {fit['seconds'] / 60:.1f} min): "
                f"ppl {before['layerwise']['ppl']:.3f}, sparsity {100 * before['layerwise']['sparsity']:.1f}%")
    train_loop(step_fn, state, sequences, steps=steps, batch_size=batch_size, seed=seed,
               names=("loss", "ce", "kl", "hidden", "sparsity"),
               checkpoint=lambda: save_checkpoint(out, model, optimizer, config, src, state, keep_checkpoints),
               checkpoint_every=checkpoint_every, max_minutes=max_minutes, desc="relufy", progress=progress,
               postfix=lambda v: {"loss": f"{v['loss']:.3f}", "ce": f"{v['ce']:.3f}",
                                  "sparsity": f"{100 * v['sparsity']:.1f}%"}, log=log)
    model.eval()
    write_model_folder(out, model, config, src)
    report = {"source": str(src), "activation": activation, "steps": state["step"],
              "tokens_trained": state["tokens_trained"], "seconds": state["seconds"],
              "final_train_loss": state["losses"][-1] if state["losses"] else None}
    if before is not None:
        report["before"] = before
    if eval_seqs is not None:
        report["after"] = measure(model, eval_seqs)
    write_json_atomic(out / REPORT_JSON, report)
    return report


# ---- the curve ---------------------------------------------------------------------------------

def curve(out: Path, eval_files, *, eval_tokens=4096, seq_len=SEQ_LEN, original=None, progress=True) -> list:
    """Rows {step, tokens_trained, seconds, ppl, ppl_ratio, sparsity, sparsity_per_layer} of every
    checkpoint of a run (step 0: the layer-wise fit) measured on the held-out eval_files, plus the
    original model (step "original", no ReLU) and the swapped model before training (step
    "swapped") when `original` (the source folder) is given."""
    from ..models import load_tokenizer

    out = Path(out)
    ckpts = checkpoint_dirs(out)
    if not ckpts:
        raise FlashError(f"--curve {out}: no checkpoints ({out / CHECKPOINTS} is empty or missing)")
    first = trainer_state(ckpts[0])
    check_disjoint(first.get("train_files", []), eval_files)
    src = Path(original or read_config(ckpts[0]).get("relufied_from", ""))
    tokenizer = load_tokenizer(ckpts[0])
    seqs = text_sequences(eval_files, tokenizer, seq_len, eval_tokens, flag="--eval-text")
    rows = []
    if src and (src / "config.json").is_file():
        teacher, src_config = load_float32(src)
        rows.append({"step": "original", "tokens_trained": 0, "seconds": 0.0, **measure(teacher, seqs)})
        cfg = read_config(ckpts[0])
        from mlx.utils import tree_flatten

        swapped = build_model(cfg, dict(tree_flatten(teacher.parameters())))
        rows.append({"step": "swapped", "tokens_trained": 0, "seconds": 0.0, **measure(swapped, seqs)})
        del teacher, swapped
    for ckpt in ckpts:
        state = trainer_state(ckpt)
        cfg = read_config(ckpt)
        model = build_model(cfg, dict(mx.load(str(ckpt / WEIGHTS_FILE))))
        model.eval()
        rows.append({"step": state["step"], "tokens_trained": state["tokens_trained"],
                     "seconds": state["seconds"], **measure(model, seqs)})
        if progress:
            r = rows[-1]
            print(f"{ckpt.name}: ppl {r['ppl']:.3f} sparsity {100 * r['sparsity']:.1f}%", flush=True)
    base = rows[0]["ppl"] if rows and rows[0]["step"] == "original" else None
    for r in rows:
        r["ppl_ratio"] = r["ppl"] / base if base else None
    return rows


def format_curve(rows) -> str:
    """Markdown table of curve rows."""
    lines = ["| checkpoint | tokens trained | minutes | held-out ppl | vs original | FFN sparsity | "
             "min / max layer sparsity |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = "" if r.get("ppl_ratio") is None else f"{100 * (r['ppl_ratio'] - 1):+.1f}%"
        sp = "-" if r["sparsity"] is None else f"{100 * r['sparsity']:.1f}%"
        mm = "-" if r["sparsity_per_layer"] is None else \
            f"{100 * min(r['sparsity_per_layer']):.0f}% / {100 * max(r['sparsity_per_layer']):.0f}%"
        name = {"original": "original (SiLU)", "swapped": "swapped, untrained",
                0: "layer-wise fit"}.get(r["step"], f"step {r['step']}")
        lines.append(f"| {name} | {r['tokens_trained']} | {r['seconds'] / 60:.1f} | {r['ppl']:.3f} | "
                     f"{ratio} | {sp} | {mm} |")
    return "\n".join(lines)
