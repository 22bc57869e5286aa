"""MoE calibration on text: expert-wise bit widths (EdgeMoE 3.2) and routing statistics.

Widths: run the float MoE model over the text, record each MoE layer's SwitchGLU input and
routing, measure every expert's quantization error at each width (moe/bitwidths.py) and assign
widths under an average-bits target. Routing statistics (`routing_statistics`): each MoE layer's
expert-cache hits at every slot count on the text, from which the runtime splits a memory budget's
slots over layers (models/moe.py layer_slots).

`validate_importance` checks the proxy against EdgeMoE's own measure (narrow one expert, measure
the loss change) on a sample of experts.
"""

import math
import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import FlashError
from ..moe.bitwidths import WIDTHS, assign_widths, quantization_errors, quantize_dequantize

SEQ_LEN = 256


def switch_glus(model) -> dict:
    """{layer index: (parent module, attribute name, mlx-lm SwitchGLU)} of an MoE model."""
    from mlx_lm.models.switch_layers import SwitchGLU

    found = {}
    for i, layer in enumerate(model.layers):
        for _, parent in layer.named_modules():
            for name, child in parent.children().items():
                if isinstance(child, SwitchGLU):
                    found[i] = (parent, name, child)
    return found


class _InputRecorder(nn.Module):
    """Wraps a SwitchGLU: records (x, expert ids) of each call, returns the SwitchGLU's output."""

    def __init__(self, switch):
        super().__init__()
        self.switch = switch
        self.seen = []

    def __call__(self, x, indices):
        self.seen.append((x, indices))
        return self.switch(x, indices)


def record_switch_inputs(model, tokens: np.ndarray, seq_len=SEQ_LEN) -> dict:
    """{layer: (x float32 [tokens, hidden], ids int [tokens, k])} of every SwitchGLU over `tokens`."""
    found = switch_glus(model)
    if not found:
        raise FlashError("--expert-bits: the model has no mlx-lm SwitchGLU experts")
    recorders = {}
    for i, (parent, name, switch) in found.items():
        recorders[i] = _InputRecorder(switch)
        setattr(parent, name, recorders[i])
    out = {i: ([], []) for i in found}
    try:
        for s in range(0, len(tokens) - 1, seq_len):
            model(mx.array(tokens[s: s + seq_len])[None])
            for i, r in recorders.items():
                x, ids = r.seen.pop()
                mx.eval(x, ids)
                out[i][0].append(np.array(x.reshape(-1, x.shape[-1]).astype(mx.float32)))
                out[i][1].append(np.array(ids).reshape(-1, ids.shape[-1]))
    finally:
        for i, (parent, name, switch) in found.items():
            setattr(parent, name, switch)
    return {i: (np.concatenate(xs), np.concatenate(ids)) for i, (xs, ids) in out.items()}


def expert_stacks(switch) -> dict:
    """{"gate", "up", "down": float mx.array [E, out, in]} of a float SwitchGLU."""
    out = {}
    for role in ("gate", "up", "down"):
        lin = getattr(switch, f"{role}_proj")
        if "scales" in lin:
            raise FlashError("--expert-bits: needs float experts (the source is quantized)")
        out[role] = lin.weight
    return out


def measure_errors(model, tokens, group_size, widths=WIDTHS, progress=True) -> dict:
    """{layer: err [experts, len(widths)]} (moe/bitwidths.py's proxy) on `tokens`."""
    from tqdm import tqdm

    found = switch_glus(model)
    stacks = {i: expert_stacks(switch) for i, (_, _, switch) in found.items()}
    widths_in = sorted({w.shape[-1] for s in stacks.values() for w in s.values()})
    if any(n % group_size for n in widths_in):
        raise FlashError(f"--group-size {group_size}: must divide every expert input width "
                         f"({', '.join(map(str, widths_in))})")
    recorded = record_switch_inputs(model, tokens)
    errors = {}
    for i in tqdm(sorted(recorded), desc="expert bits", unit="layer", disable=not progress):
        x, ids = recorded[i]
        errors[i] = quantization_errors(x, ids, np.ones(ids.shape, np.float32), stacks[i],
                                        found[i][2].activation, group_size, widths)
    return errors


def choose_expert_bits(model, tokens, target_bits, group_size, progress=True) -> tuple:
    """({layer: [bits per expert]}, {layer: err}) for a float MoE `model` on calibration `tokens`."""
    errors = measure_errors(model, tokens, group_size, progress=progress)
    return assign_widths(errors, target_bits), errors


def _mean_nll(model, tokens, seq_len=SEQ_LEN) -> float:
    from ..moe.quality import sequence_nll

    return float(np.mean(sequence_nll(model, tokens, seq_len), dtype=np.float64))


def validate_importance(model, tokens, errors, group_size, *, samples=24, bits=2, seed=0) -> dict:
    """EdgeMoE's importance (loss change when one expert alone is quantized at `bits`, the rest
    float) for `samples` random experts, next to the proxy's err at that width.

    Returns {"spearman": rank correlation, "pairs": [(layer, expert, proxy, loss change)],
    "base_loss": nats per token, "seconds"}.
    """
    t0 = time.perf_counter()
    found = switch_glus(model)
    j = WIDTHS.index(bits)
    rng = np.random.default_rng(seed)
    keys = [(layer, e) for layer, err in errors.items() for e in range(err.shape[0])]
    pick = [keys[i] for i in rng.choice(len(keys), min(samples, len(keys)), replace=False)]
    base = _mean_nll(model, tokens)
    pairs = []
    for layer, e in pick:
        switch = found[layer][2]
        saved = {}
        for role in ("gate", "up", "down"):
            lin = getattr(switch, f"{role}_proj")
            saved[role] = lin.weight
            w = mx.array(lin.weight)
            w[e] = quantize_dequantize(w[e], bits, group_size).astype(w.dtype)
            lin.weight = w
        pairs.append((layer, e, float(errors[layer][e, j]), _mean_nll(model, tokens) - base))
        for role, w in saved.items():
            getattr(switch, f"{role}_proj").weight = w
    proxy = np.array([p[2] for p in pairs])
    delta = np.array([p[3] for p in pairs])
    return {"spearman": spearman(proxy, delta), "pairs": pairs, "base_loss": base,
            "seconds": time.perf_counter() - t0}


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman rank correlation (no tie correction); 0 for fewer than 2 pairs."""
    if len(a) < 2:
        return 0.0
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    c = np.corrcoef(ra, rb)[0, 1]
    return float(c) if math.isfinite(c) else 0.0


ROUTING_POLICY = "lfu"  # the best per-layer policy at half the experts on the derived model


def routing_statistics(model, tokens, top_k, n_experts) -> dict:
    """The pack's `moe_routing`: {"policy", "sizes": top_k..n_experts, "hits": {layer: [hits of the
    layer's accesses at each size]}, "tokens"} of `model`'s routing over `tokens` in decode order."""
    from ..moe.cache import hit_curves
    from ..moe.predict import record_routing

    trace = record_routing(model, tokens, top_k)
    sizes = list(range(top_k, n_experts + 1))
    curves = hit_curves(trace.accesses(), trace.layers, ROUTING_POLICY, sizes)
    return {"policy": ROUTING_POLICY, "sizes": sizes, "tokens": int(trace.experts.shape[0]),
            "hits": {layer: curve for layer, curve in curves.items()}}
