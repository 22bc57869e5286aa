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
from ..moe.bitwidths import (WIDTHS, assign_widths, input_moments, mean_bits,
                             quantization_errors, quantize_dequantize)
from ..moe.quantize import dequantize_experts, gptq_factor, quantize_experts
from ..moe.switch import switch_glus
from .relufication import distill_kl

SEQ_LEN = 256
# convert --expert-bits' default --calib-tokens: GPTQ's per-expert input moments on 2048 tokens
# (~1000 routed to each expert at top-8 of 16, for 576 inputs) left the mean-3.0 pack of the
# derived model 3.5% worse on validation (docs/benchmarks.md, "Expert bits: calibration tokens ...")
EXPERT_BITS_CALIB_TOKENS = 8192


class _InputRecorder(nn.Module):
    """Wraps a SwitchGLU: records (x, expert ids) of each call, returns the SwitchGLU's output."""

    def __init__(self, switch):
        super().__init__()
        self.switch = switch
        self.seen = []

    def __call__(self, x, indices):
        self.seen.append((x, indices))
        return self.switch(x, indices)


class _DenseExperts(nn.Module):
    """Stands in for an mlx-lm SwitchGLU: the same call (x, indices) -> [..., k, hidden], each
    token through every expert (one matmul per projection), the routed outputs gathered."""

    def __init__(self, switch):
        super().__init__()
        self.switch = switch

    def __call__(self, x, indices):
        sw = self.switch
        wu, wg, wd = sw.up_proj.weight, sw.gate_proj.weight, sw.down_proj.weight
        n_exp, ffn, hid = wu.shape
        k = indices.shape[-1]
        xf = x.reshape(-1, hid)
        n = xf.shape[0]
        up = (xf @ wu.reshape(n_exp * ffn, hid).T).reshape(n, n_exp, ffn)
        gate = (xf @ wg.reshape(n_exp * ffn, hid).T).reshape(n, n_exp, ffn)
        out = mx.matmul(sw.activation(up, gate).transpose(1, 0, 2), wd.transpose(0, 2, 1))
        idx = mx.stop_gradient(indices).reshape(n, k)
        return out[idx, mx.arange(n)[:, None]].reshape(*x.shape[:-1], k, hid)


def dense_experts(model):
    """Context manager: `model`'s SwitchGLUs computed densely (`_DenseExperts`), restored on exit."""
    from contextlib import contextmanager

    @contextmanager
    def swap():
        found = switch_glus(model)
        try:
            for parent, name, switch in found.values():
                setattr(parent, name, _DenseExperts(switch))
            yield model
        finally:
            for parent, name, switch in found.values():
                setattr(parent, name, switch)
    return swap()


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


def measure_errors(model, tokens, group_size, widths=WIDTHS, progress=True, method="mlx",
                   quantized=None) -> dict:
    """{layer: err [experts, len(widths)]} (moe/bitwidths.py's proxy) on `tokens`, each expert
    quantized by `method` (moe/quantize.py). quantized: a dict that receives {(layer, bits):
    {"gate", "up", "down": (packed, scales, biases)}}, the stacks as measured (for the writer)."""
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
        activation = found[i][2].activation
        deq = None
        if method != "mlx":
            moments = input_moments(x, ids, stacks[i], activation)
            factors = {k: gptq_factor(h) for k, h in moments.items()} if method.startswith("gptq") else {}
            deq = {}
            for b in widths:
                layer_q = {}
                for r, w in stacks[i].items():
                    k = "h" if r == "down" else "x"  # down reads the hidden activations
                    layer_q[r] = quantize_experts(w, b, group_size, method, moments[k], factors.get(k))
                deq[b] = {r: dequantize_experts(*q, b, group_size) for r, q in layer_q.items()}
                if quantized is not None:
                    quantized[(i, b)] = layer_q
        errors[i] = quantization_errors(x, ids, np.ones(ids.shape, np.float32), stacks[i],
                                        activation, group_size, widths, deq)
    return errors


def stored_quantizer(quantized: dict):
    """pack.write_pack's expert_quantizer that hands out the stacks `measure_errors` quantized."""
    def quantize(layer, role, ids, w, bits, group_size):
        q, s, b = (a[mx.array(np.asarray(ids))] for a in quantized[(layer, bits)][role])
        return q, s.astype(w.dtype), b.astype(w.dtype)  # the writer's --dtype
    return quantize


def choose_expert_bits(model, tokens, target_bits, group_size, progress=True, method="mlx",
                       widths=WIDTHS, quantized=None) -> tuple:
    """({layer: [bits per expert]}, {layer: err}) for a float MoE `model` on calibration `tokens`
    (`measure_errors`' method and quantized)."""
    errors = measure_errors(model, tokens, group_size, widths, progress, method, quantized)
    return assign_widths(errors, target_bits, widths=widths), errors


def _log_probs(model, tokens, seq_len=SEQ_LEN) -> list:
    """[float32 [1, seq_len, vocab] log-probabilities] of `model` over `tokens` in windows."""
    out = []
    with dense_experts(model):
        for s in range(0, len(tokens) - seq_len + 1, seq_len):
            logits = model(mx.array(tokens[s: s + seq_len])[None]).astype(mx.float32)
            out.append(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
            mx.eval(out[-1])
    return out


class _RouterReplay(nn.Module):
    """Wraps an MoE block's linear router (`gate`): "record" keeps which experts its logits rank
    top k on each call; "replay" returns the logits with every other expert's lowered to just
    below the recorded experts' least, so the block picks the recorded experts again. Recorded
    experts' logits are untouched, so their weights are the perturbed model's own (exactly, for
    routers that softmax over the chosen logits: mixtral; a softmax over all experts changes
    only where a choice would have flipped)."""

    def __init__(self, router, top_k: int):
        super().__init__()
        self.router = router
        self.top_k = top_k
        self.mode = "record"
        self.chosen = []  # bool [..., experts] of each recorded call
        self.calls = 0

    def __call__(self, x):
        logits = self.router(x)
        if self.mode == "record":
            top = mx.argpartition(-logits, kth=self.top_k - 1, axis=-1)[..., : self.top_k]
            chosen = mx.put_along_axis(mx.zeros(logits.shape, mx.bool_), top, mx.array(True),
                                       axis=-1)
            mx.eval(chosen)
            self.chosen.append(chosen)
            return logits
        chosen = self.chosen[self.calls]
        self.calls += 1
        least = mx.min(mx.where(chosen, logits, mx.inf), axis=-1, keepdims=True)
        below = least - 1e-3 * mx.maximum(mx.abs(least), 1.0)
        return mx.where(chosen, logits, mx.minimum(logits, below))


def routing_replay(model):
    """Context manager: every MoE block's linear router wrapped in a `_RouterReplay` (yields the
    list of them, in "record" mode); the routers are restored on exit. FlashError for a block
    whose router is not a linear `gate` with a top-k attribute (deepseek_v2's grouped gate)."""
    from contextlib import contextmanager

    @contextmanager
    def swap():
        blocks = []
        for layer, (parent, _, _) in sorted(switch_glus(model).items()):
            k = getattr(parent, "num_experts_per_tok", None) or getattr(parent, "top_k", None)
            if not isinstance(getattr(parent, "gate", None), nn.Linear) or not k:
                raise FlashError(f"--expert-importance layer-loss-frozen: layer {layer}'s MoE "
                                 f"block has no linear router `gate` with a top-k")
            blocks.append(parent)
        replays = []
        try:
            for parent in blocks:
                k = getattr(parent, "num_experts_per_tok", None) or parent.top_k
                replays.append(_RouterReplay(parent.gate, int(k)))
                parent.gate = replays[-1]
            yield replays
        finally:
            for parent, replay in zip(blocks, replays):
                parent.gate = replay.router
    return swap()


def layer_losses(model, tokens, quantized: dict, widths, group_size, seq_len=SEQ_LEN,
                 frozen_routing: bool = False) -> dict:
    """{layer: [KL (nats per token) from the float model at each width]}: every expert of that one
    layer at the width (the `quantized` stacks: {(layer, bits): {role: (packed, scales, biases)}}),
    all other experts float, over `tokens` (windows of seq_len). One forward pass per layer and
    width; EdgeMoE's measured loss change, per layer.

    frozen_routing: every layer routes each token to the experts the float model chose
    (`routing_replay`), so the loss is the quantization's own and not the later routers'
    reaction to it. Why: on the derived model (moefy) 8-bit experts in layer 0 alone change
    ~0.5 of the 8 experts per token in the deep layers and cost 0.23 nats per token; with
    routing frozen they cost 0.0000 (4 bits: 0.52 -> 0.010)."""
    from contextlib import nullcontext

    seq_len = min(seq_len, len(tokens))
    with routing_replay(model) if frozen_routing else nullcontext([]) as replays:
        ref = _log_probs(model, tokens, seq_len)
        for r in replays:
            r.mode = "replay"
        out = {}
        for layer in sorted(switch_glus(model)):
            row = []
            for b in widths:
                for r in replays:
                    r.calls = 0
                with experts_at_widths(model, {layer: [b] * _n_experts(model, layer)},
                                       group_size, quantized):
                    lp = _log_probs(model, tokens, seq_len)
                # windows of equal length: the mean of their per-token means is the mean per token
                row.append(float(mx.mean(mx.stack([distill_kl(q, r) for r, q in zip(ref, lp)]))))
            out[layer] = row
    return out


def _n_experts(model, layer) -> int:
    return switch_glus(model)[layer][2].up_proj.weight.shape[0]


def scale_by_layer_loss(errors: dict, losses: dict) -> dict:
    """The proxy errors {layer: err [experts, widths]} rescaled so that each layer's column at a
    width sums to its measured loss there (`layer_losses` at every width), or, given the loss at
    the narrowest width only, every column by that width's factor: layers trade bits by the loss
    they cost, experts within a layer by their share of the proxy."""
    out = {}
    for layer, err in errors.items():
        loss = np.maximum(np.asarray(losses[layer], np.float64), 0.0)
        total = err.sum(0)[: len(loss)]
        factor = np.where(total > 0, loss / np.where(total > 0, total, 1.0), 0.0)
        out[layer] = err * (factor if len(loss) == err.shape[1] else factor[0])
    return out


def _mean_nll(model, tokens, seq_len=SEQ_LEN) -> float:
    from ..moe.quality import sequence_nll

    return float(np.mean(sequence_nll(model, tokens, seq_len), dtype=np.float64))


def experts_at_widths(model, bits: dict, group_size: int, quantized: dict = None):
    """Context manager: `model`'s float experts replaced by their quantized-dequantized values at
    `bits` {layer: [bits per expert]} (the `quantized` stacks, default `mx.quantize`; layers not
    in `bits` stay float), restored on exit. The resident model's experts as the pack holds them, in float."""
    from contextlib import contextmanager

    @contextmanager
    def swap():
        saved = []
        try:
            for layer, (_, _, switch) in switch_glus(model).items():
                if bits.get(layer) is None:
                    continue  # left float
                for role in ("gate", "up", "down"):
                    lin = getattr(switch, f"{role}_proj")
                    saved.append((lin, lin.weight))
                    if quantized:
                        deq = {b: dequantize_experts(*quantized[(layer, b)][role], b, group_size)
                               for b in set(bits[layer])}
                        rows = [deq[b][e] for e, b in enumerate(bits[layer])]
                    else:
                        rows = [quantize_dequantize(lin.weight[e], b, group_size)
                                for e, b in enumerate(bits[layer])]
                    lin.weight = mx.stack(rows).astype(lin.weight.dtype)
            yield model
        finally:
            for lin, w in saved:
                lin.weight = w
    return swap()


def fewest_bits_within(model, tokens, errors, tolerance_pct, group_size, widths=WIDTHS,
                       quantized=None, step=0.125, solver="knapsack") -> dict:
    """The smallest mean width (a multiple of `step` bits) whose assignment (`assign_widths` on
    `errors`) keeps the calibration perplexity of `model` within `tolerance_pct` percent of its
    float experts', by bisection (one forward pass over `tokens` per probe).

    Returns {"bits": {layer: [bits]}, "target": the mean target chosen, "mean_bits" (<= target),
    "ppl_increase_pct", "float_loss" (nats per token), "probes": [(mean target, increase %)]}.
    """
    base = _mean_nll(model, tokens)
    probes = []

    def increase(target):
        bits = assign_widths(errors, target, widths=widths, solver=solver)
        with experts_at_widths(model, bits, group_size, quantized):
            pct = 100.0 * (math.exp(_mean_nll(model, tokens) - base) - 1.0)
        probes.append((target, pct))
        return bits, pct, target

    lo, hi = 0, int(round((widths[-1] - widths[0]) / step))
    best = increase(widths[-1])
    while lo < hi:  # invariant: the target at `hi` steps meets the tolerance (or is the widest)
        mid = (lo + hi) // 2
        probe = increase(widths[0] + mid * step)
        if probe[1] <= tolerance_pct:
            hi, best = mid, probe
        else:
            lo = mid + 1
    return {"bits": best[0], "target": best[2], "mean_bits": mean_bits(best[0]),
            "ppl_increase_pct": best[1],
            "float_loss": base, "probes": probes}


def assignment_perplexities(model, student, calib_tokens, eval_tokens, target_bits: float,
                            group_size: int, *, method="gptq-fit", widths=WIDTHS,
                            loss_tokens: int = 256, progress=False) -> list:
    """Held-out perplexity of the experts as a pack would hold them under each way of choosing
    widths, from one calibration: [{"name", "bits": {layer: [bits]}, "mean_bits", "ppl",
    "tokens"}], the first row every expert at 4 bits (the reference).

    model: the float MoE (calibration: `measure_errors` on calib_tokens by `method`, and
    `layer_losses` on the first `loss_tokens`); student: the same model with its non-expert
    weights as the pack holds them (expert_tune.quantize_resident), whose experts are swapped in
    dequantized (`experts_at_widths`) and computed densely: the runtime's dense-mode values.
    Rows: all 4-bit; knapsack and greedy on the output-error proxy; knapsack on the proxy
    rescaled by the measured layer losses at the narrowest width (convert's --expert-importance
    layer-loss); the same with routing frozen (layer-loss-frozen); the proxy rescaled at every
    width (each layer's measured loss curve).
    """
    from ..moe.quality import held_out_perplexity

    quantized = {}
    errors = measure_errors(model, calib_tokens, group_size, widths, progress, method, quantized)
    quantized = quantized or None
    losses = layer_losses(model, calib_tokens[: loss_tokens + 1], quantized, widths, group_size)
    scaled = scale_by_layer_loss(errors, {layer: row[:1] for layer, row in losses.items()})
    frozen = layer_losses(model, calib_tokens[: loss_tokens + 1], quantized, widths[:1],
                          group_size, frozen_routing=True)
    n = {layer: err.shape[0] for layer, err in errors.items()}
    variants = [("all 4-bit", {layer: [4] * k for layer, k in n.items()}),
                ("knapsack, output error", assign_widths(errors, target_bits, widths=widths)),
                ("greedy, output error", assign_widths(errors, target_bits, widths=widths,
                                                       solver="greedy")),
                ("knapsack, layer loss", assign_widths(scaled, target_bits, widths=widths)),
                ("knapsack, layer loss, routing frozen",
                 assign_widths(scale_by_layer_loss(errors, frozen), target_bits, widths=widths)),
                ("knapsack, layer loss at every width",
                 assign_widths(scale_by_layer_loss(errors, losses), target_bits, widths=widths))]
    rows = []
    for name, bits in variants:
        with experts_at_widths(student, bits, group_size, quantized), dense_experts(student):
            r = held_out_perplexity([student], eval_tokens)
        rows.append({"name": name, "bits": bits, "mean_bits": mean_bits(bits), "ppl": r["ppl"][0],
                     "tokens": r["tokens"]})
    return rows


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
