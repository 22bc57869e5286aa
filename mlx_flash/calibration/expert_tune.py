"""End-to-end tuning of quantized experts (scales and biases; optionally integers) against the float model.

After each expert is rounded at its width (moe/quantize.py), its affine scales and biases move:
every group's w_hat = scale * (1 + a) * q + bias + scale * c, with a and c trained by Adam to
minimise the KL divergence from the float model's next-token distribution to the quantized
model's on calibration text. By default the integers q stay fixed. With an integer learning rate
they move too: each weight holds a float offset u from its integer, started at the float weight's
place within its rounding step (|u| < 1/2, so the first forward pass is the rounding's), and the
forward pass uses clip(round(q + u), 0, 2^bits - 1) with a straight-through gradient (the
gradient of the rounded value taken as that of q + u). The pack keeps MLX's affine format (new
scales and biases, and with moving integers new packed words), so the runtime and kernels read
it unchanged.

The student is the model as the pack will hold it: non-expert weights quantized-dequantized as
`--quantize` stores them, experts at their widths. Experts are computed densely during tuning
(every expert on every token, the routed ones gathered): the same values as mlx-lm's SwitchGLU,
a few large matmuls instead of MLX's per-expert gathers (tens of times faster on the CPU).
"""

import time

import mlx.core as mx
import numpy as np

from ..errors import FlashError
from ..moe.quantize import pack_bits
from .expert_bits import dense_experts, switch_glus
from .relufication import distill_kl

ROLES = ("gate", "up", "down")


def quantize_resident(model, bits: int, group_size: int):
    """Non-expert linear / embedding weights of `model` replaced, in place, by their MLX affine
    quantization at `bits` dequantized (float): the values a pack written with `--quantize bits`
    holds, on float matmuls."""
    from mlx_lm.models.switch_layers import SwitchLinear

    for _, m in model.named_modules():
        if (hasattr(m, "to_quantized") and not isinstance(m, SwitchLinear) and "weight" in m
                and m.weight.ndim == 2 and m.weight.shape[-1] % group_size == 0):
            q = mx.quantize(m.weight, group_size=group_size, bits=bits)
            m.weight = mx.dequantize(*q, group_size=group_size, bits=bits).astype(m.weight.dtype)


def _expert_grids(quantized, bits, group_size):
    """{(layer, role): (q float32 [E, out, in], scale0, bias0 float32 [E, out, groups])} with each
    expert's rows taken from its own width."""
    grids = {}
    for layer, widths in bits.items():
        for role in ROLES:
            qs, ss, bs = [], [], []
            for e, b in enumerate(widths):
                packed, s, bias = (a[e] for a in quantized[(layer, b)][role])
                ones = mx.ones(s.shape, mx.float32)
                qs.append(mx.dequantize(packed, ones, mx.zeros_like(ones), group_size=group_size,
                                        bits=b))
                ss.append(s.astype(mx.float32))
                bs.append(bias.astype(mx.float32))
            grids[(layer, role)] = (mx.stack(qs), mx.stack(ss), mx.stack(bs))
    return grids


def tune_expert_scales(student, teacher, quantized: dict, bits: dict, tokens: np.ndarray, *,
                       steps: int, group_size: int, lr: float = 2e-3, seq_len: int = 256,
                       seed: int = 0, progress: bool = True, lr_by_width: dict = None,
                       integer_lr: float = 0.0, checkpoint_every: int = 0,
                       on_checkpoint=None) -> dict:
    """Train the scales and biases (with integer_lr, also the integers) of each expert at its width
    (module docstring).

    student / teacher: the same MoE architecture (student: non-expert weights as the pack holds
    them, `quantize_resident`; teacher: the float model). quantized: {(layer, bits): {"gate",
    "up", "down": (packed, scales, biases)}} (calibration.expert_bits.measure_errors); bits:
    {layer: [bits per expert]}. tokens: int32 training ids (never the evaluation text); each
    step is one random window of seq_len tokens. lr_by_width: {bits: factor} multiplying `lr`
    for the experts at that width (default 1 for every width): the narrow experts' scales can
    be moved further than the wide ones' in the same steps. integer_lr > 0: the integers move
    too (module docstring), their offsets trained by an Adam of their own at learning rate
    integer_lr, in integer steps (times the width's factor). on_checkpoint(steps done, tuned
    `quantized` as returned) is called every `checkpoint_every` steps (e.g. to score a validation
    split: a run's first n steps are exactly an n-step run, same windows and Adam state).

    Returns {"quantized": a copy of `quantized` whose stacks hold the tuned scales/biases (and,
    with integer_lr, integers) for the experts at that width (other rows unchanged), "kl": [nats
    per token, each step], "seconds", "lr_by_width": the factors applied}. `student`'s experts
    are restored to their float weights.
    """
    import mlx.optimizers as optim

    if len(tokens) < seq_len + 1:
        raise FlashError(f"--expert-tune: needs more than {seq_len} calibration tokens "
                         f"(got {len(tokens)})")
    if integer_lr < 0:
        raise FlashError(f"--expert-tune-int-lr {integer_lr:g}: must be >= 0")
    grids = _expert_grids(quantized, bits, group_size)
    found = switch_glus(student)
    saved = {(layer, r): getattr(found[layer][2], f"{r}_proj").weight for layer, r in grids}
    params = {f"{layer}.{r}": {"a": mx.zeros(g[1].shape), "c": mx.zeros(g[1].shape)}
              for (layer, r), g in grids.items()}
    integers = _Integers(grids, bits, group_size, saved) if integer_lr else None
    if integers:
        for key, u in integers.start().items():
            params[key]["u"] = u
    # each expert's Adam step times its width's factor: a per-expert learning rate
    factor = {f"{layer}.{r}": mx.array([float((lr_by_width or {}).get(b, 1.0))
                                        for b in bits[layer]], mx.float32)[:, None, None]
              for layer, r in grids}

    def expert_weights(p):
        for (layer, r), (q, s0, b0) in grids.items():
            key = f"{layer}.{r}"
            a, c = p[key]["a"], p[key]["c"]
            if integers:
                q = integers.forward(key, q, p[key]["u"])
            n_exp, out, n = q.shape
            w = q.reshape(n_exp, out, n // group_size, group_size) * (s0 * (1 + a))[..., None]
            w = (w + (b0 + s0 * c)[..., None]).reshape(n_exp, out, n)
            getattr(found[layer][2], f"{r}_proj").weight = w.astype(saved[(layer, r)].dtype)

    def loss_fn(p, x, teacher_logits):
        expert_weights(p)
        return distill_kl(student(x).astype(mx.float32), teacher_logits)

    value_and_grad = mx.value_and_grad(loss_fn)
    # one Adam per kind of parameter: the scales' and biases' (lr), the integer offsets' (integer_lr)
    optimizers = {("a", "c"): optim.Adam(learning_rate=lr)}
    if integers:
        optimizers[("u",)] = optim.Adam(learning_rate=integer_lr)

    def update(params, grads):
        out = {n: {} for n in params}
        for names, opt in optimizers.items():
            p = {n: {v: params[n][v] for v in names} for n in params}
            new = opt.apply_gradients({n: {v: grads[n][v] for v in names} for n in grads}, p)
            for n in params:
                for v in names:  # each expert's step times its width's factor (1 without lr_by_width)
                    out[n][v] = p[n][v] + factor[n] * (new[n][v] - p[n][v]) if lr_by_width else new[n][v]
        return out

    rng = np.random.default_rng(seed)
    kl = []
    t0 = time.perf_counter()
    from tqdm import tqdm

    from ..cpu import ops

    kernels = ops.kernels_active()
    ops.set_kernels_enabled(False)  # our CPU kernels (attention, norms) have no gradients (vjp)
    try:
        with dense_experts(student), dense_experts(teacher):
            for _ in tqdm(range(steps), desc="expert tune", unit="step", disable=not progress):
                start = int(rng.integers(0, len(tokens) - seq_len))
                x = mx.array(tokens[start: start + seq_len])[None]
                teacher_logits = teacher(x).astype(mx.float32)
                loss, grads = value_and_grad(params, x, mx.stop_gradient(teacher_logits))
                params = update(params, grads)
                mx.eval(params, [opt.state for opt in optimizers.values()], loss)
                kl.append(float(loss))
                if on_checkpoint and checkpoint_every and len(kl) % checkpoint_every == 0:
                    on_checkpoint(len(kl), _tuned_stacks(quantized, grids, params, bits, integers))
    finally:
        ops.set_kernels_enabled(kernels)
        for (layer, r), w in saved.items():
            getattr(found[layer][2], f"{r}_proj").weight = w

    return {"quantized": _tuned_stacks(quantized, grids, params, bits, integers), "kl": kl,
            "seconds": time.perf_counter() - t0, "lr_by_width": dict(lr_by_width or {})}


class _Integers:
    """The moving integers of tune_expert_scales (module docstring): an offset u per weight."""

    def __init__(self, grids, bits, group_size, floats):
        self.grids, self.group_size, self.floats = grids, group_size, floats
        self.top = {f"{layer}.{r}": mx.array([2.0 ** b - 1 for b in bits[layer]], mx.float32)[:, None, None]
                    for layer, r in grids}

    def start(self) -> dict:
        """{"layer.role": u}: each float weight's place within its rounding step, |u| < 1/2."""
        out = {}
        for (layer, r), (q, s0, b0) in self.grids.items():
            n_exp, rows, n = q.shape
            w = self.floats[(layer, r)].astype(mx.float32).reshape(n_exp, rows, n // self.group_size,
                                                                     self.group_size)
            safe = mx.where(s0 == 0, 1.0, s0)[..., None]
            place = ((w - b0[..., None]) / safe).reshape(q.shape) - q
            out[f"{layer}.{r}"] = mx.clip(place, -0.49, 0.49)
        return out

    def forward(self, key, q, u):
        """clip(round(q + u), 0, top) valued, with the gradient of q + u (straight through)."""
        t = q + u
        t = t + mx.stop_gradient(mx.round(t) - t)
        return mx.minimum(mx.maximum(t, 0.0), self.top[key])

    def rounded(self, key, q, u) -> np.ndarray:
        """The integers of forward's value, uint32 (to pack)."""
        t = mx.minimum(mx.maximum(mx.round(q + u), 0.0), self.top[key])
        return np.array(t).astype(np.uint32)


def _tuned_stacks(quantized, grids, params, bits, integers=None) -> dict:
    """A copy of `quantized` whose stacks hold the scales/biases of `params` ({"layer.role": {"a",
    "c"[, "u"]}}) for the experts at each width (with `integers`, their integers packed anew;
    other rows unchanged)."""
    tuned = {key: dict(stacks) for key, stacks in quantized.items()}
    for (layer, r), (q, s0, b0) in grids.items():
        p = params[f"{layer}.{r}"]
        scale, bias = np.array(s0 * (1 + p["a"])), np.array(b0 + s0 * p["c"])
        q_new = integers.rounded(f"{layer}.{r}", q, p["u"]) if integers else None
        for b in set(bits[layer]):
            rows = [e for e, w in enumerate(bits[layer]) if w == b]
            packed, s, bb = tuned[(layer, b)][r]
            s_new, b_new = np.array(s.astype(mx.float32)), np.array(bb.astype(mx.float32))
            s_new[rows], b_new[rows] = scale[rows], bias[rows]
            if q_new is not None:
                words = np.array(packed)
                words[rows] = pack_bits(q_new[rows], b)
                packed = mx.array(words)
            tuned[(layer, b)][r] = (packed, mx.array(s_new).astype(s.dtype),
                                    mx.array(b_new).astype(bb.dtype))
    return tuned


def validation_windows(tokens: np.ndarray, start: int, n_tokens: int, seq_len: int = 256) -> list:
    """n_tokens // seq_len windows of seq_len + 1 token ids (seq_len scored next tokens each),
    spread evenly over tokens[start:]: a validation split apart from tuning windows drawn from
    tokens[:start]. Raises FlashError when tokens[start:] cannot hold them apart."""
    n = n_tokens // seq_len
    rest = tokens[start:]
    if n < 1 or len(rest) < n * (seq_len + 1):
        raise FlashError(f"--expert-tune-val-tokens {n_tokens}: needs at least "
                         f"{max(n, 1) * (seq_len + 1)} --calib-text tokens after the "
                         f"{start} tuning tokens (got {len(rest)})")
    starts = np.linspace(0, len(rest) - seq_len - 1, n).astype(int)
    return [rest[s: s + seq_len + 1] for s in starts]


def windows_perplexity(model, quantized: dict, bits: dict, group_size: int, windows: list) -> float:
    """Perplexity of `model` with its experts at `bits` from the `quantized` stacks (computed
    densely) on `windows` (validation_windows: each scored on its own)."""
    import math

    from ..moe.quality import sequence_nll
    from .expert_bits import experts_at_widths

    with experts_at_widths(model, bits, group_size, quantized), dense_experts(model):
        nll = np.concatenate([sequence_nll(model, w, len(w) - 1) for w in windows])
    return math.exp(float(np.mean(nll)))


def tune_keeping_best(student, teacher, judge, quantized: dict, bits: dict, tokens: np.ndarray,
                      windows: list, *, steps: int, checkpoint_every: int, group_size: int,
                      on_score=None, **tune_kw) -> dict:
    """tune_expert_scales scored on validation `windows` before tuning (step 0) and every
    `checkpoint_every` steps (and at the last step); keeps the checkpoint with the least
    validation perplexity. judge: a third copy of the student (non-expert weights as the pack
    holds them) used only for scoring. on_score(steps, perplexity): called as each is scored.

    Returns tune_expert_scales' dict with "quantized" = the kept checkpoint's stacks (the
    untuned `quantized` when step 0 scores best), "validation": [(steps, perplexity)],
    "best_steps"."""
    scored, best = [], {}

    def on_checkpoint(n, tuned):
        ppl = windows_perplexity(judge, tuned, bits, group_size, windows)
        scored.append((n, ppl))
        if on_score:
            on_score(n, ppl)
        if not best or ppl < best["ppl"]:
            best.update(steps=n, ppl=ppl, quantized=tuned)

    on_checkpoint(0, quantized)

    out = tune_expert_scales(student, teacher, quantized, bits, tokens, steps=steps,
                             group_size=group_size, checkpoint_every=checkpoint_every,
                             on_checkpoint=on_checkpoint, **tune_kw)
    if scored[-1][0] != steps:
        on_checkpoint(steps, out["quantized"])
    return {**out, "quantized": best["quantized"], "validation": scored, "best_steps": best["steps"]}
