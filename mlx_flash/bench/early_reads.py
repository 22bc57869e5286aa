"""How well a sparse layer's neurons can be known before its exact mask: recall, precision and
neurons per token of three early-read candidates, on a flash pack with the exact resident-gate
predictor (convert --gate-bits, calibrate --kind gate-threshold).

    python -m mlx_flash.bench early_reads --model PACK --text FILE [FILE ...] [--max-tokens 400]
        [--warmup 64] [--memory-budget 0.65] [--scales 0.8,1.0,1.2] [--json OUT]

The text is decoded token by token in flash mode (teacher forcing). For each layer j and token
the exact mask is |act(gate_j x_j)| > t_j on the FFN input x_j; the candidates are
    pre     the layer's own gate on its pre-attention residual h_j normalised by its
            post-attention RMSNorm (known before the attention runs)
    ahead   the lookahead's estimate, the previous layer's FFN input x_(j-1) times the ratio of
            the two layers' post-attention RMSNorm weights (known one layer earlier)
    hot     the most frequent neurons so far, as many as the layer's mean exact count
with the cut at s * t_j for each scale s (pre, ahead). Counted after `--warmup` tokens; the
summary rows cover the layers the memory plan at `--memory-budget` runs sparse. Nothing is
timed here: what an early read buys is measured by `bench run` (MLX_FLASH_LOOKAHEAD=0/1).
"""

from pathlib import Path

import numpy as np

from ..config import memory_budget_arg
from ..paths import write_json_atomic


def add_arguments(parser):
    parser.add_argument("--model", required=True, help="a flash pack with resident-gate predictors")
    parser.add_argument("--text", nargs="+", required=True, metavar="FILE",
                        help="held-out text (not the calibration text)")
    parser.add_argument("--max-tokens", type=int, default=400, help="tokens decoded (default 400)")
    parser.add_argument("--warmup", type=int, default=64, help="first tokens not counted (default 64)")
    parser.add_argument("--memory-budget", type=memory_budget_arg, default=memory_budget_arg("0.65"),
                        help="the plan whose sparse layers are summed (default 0.65)")
    parser.add_argument("--scales", default="0.8,1.0,1.2", help="cuts s * t tried for pre and ahead (default 0.8,1.0,1.2)")
    parser.add_argument("--json", default=None, metavar="OUT", help="also write the counts as JSON")


class _BlockInput:
    """Stands in for a decoder block in model.layers: records its input (the pre-attention
    residual) and passes every call and attribute through."""

    def __init__(self, block, layer, seen):
        self._block, self._layer, self._seen = block, layer, seen

    def __call__(self, h, *args, **kwargs):
        self._seen["h", self._layer] = h
        return self._block(h, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._block, name)


def _record_ffn_inputs(model, seen):
    """Record each FlashFFN's input x (seen["x", layer]) from its next call on."""
    for block in model.layers:
        ffn = block.mlp
        call = ffn._call

        def recording(x, step, ffn=ffn, call=call):
            seen["x", ffn.layer] = x
            return call(x, step)
        ffn._call = recording


def measure(pack, texts, max_tokens=400, warmup=64, memory_budget=0.65, scales=(0.8, 1.0, 1.2)) -> dict:
    """{"kinds": {layer: plan kind}, "counts": {candidate: {layer: [true positives, predicted,
    exact, tokens]}}, "needed": {sparse layer: the runtime's needed neurons}} over the decoded
    tokens after `warmup` (module docstring)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from ..calibration.dense_pass import text_tokens
    from ..config import FlashConfig
    from ..errors import FlashError
    from ..models import load_tokenizer
    from ..models.flash import build_flash_model, pack_predictors
    from ..sparse.predictor import activation_fn

    pack = Path(pack)
    predictors = pack_predictors(pack)
    if not all(getattr(p, "kind", None) == "gate-threshold" for p in predictors.values()):
        raise FlashError(f"{pack}: early reads need the gate-threshold predictors (calibrate --kind gate-threshold)")
    model = build_flash_model(pack, FlashConfig("flash", memory_budget=memory_budget))
    runtime = model.flash_runtime
    if any(c.resident_gate is None for c in runtime.currents.values()):
        raise FlashError(f"{pack}: early reads need a resident gate (convert --gate-bits)")
    tokens = text_tokens(texts, load_tokenizer(pack), max_tokens)
    seen = {}
    layers = model.layers
    kinds = {j: block.mlp.kind for j, block in enumerate(layers)}
    for j in range(len(layers)):
        layers[j] = _BlockInput(layers[j], j, seen)
    _record_ffn_inputs(model, seen)
    cache = make_prompt_cache(model)
    acts = {j: activation_fn(p.activation) for j, p in predictors.items()}
    counts, freq = {}, {}

    def add(name, j, predicted, exact):
        c = counts.setdefault(name, {}).setdefault(j, [0, 0, 0, 0])
        c[0] += int((predicted & exact).sum())
        c[1] += int(predicted.sum())
        c[2] += int(exact.sum())
        c[3] += 1

    for t, token in enumerate(tokens):
        mx.eval(model(mx.array([[int(token)]]), cache=cache))
        for j, block in enumerate(layers):
            p, gate, act = predictors[j], runtime.currents[j].full_gate, acts[j]
            exact = np.array(p.mask_from_gate(gate(seen["x", j]))).reshape(-1)
            if t >= warmup:
                pre = np.abs(np.array(act(gate(block.post_attention_layernorm(seen["h", j]))))).reshape(-1)
                for s in scales:
                    add(f"pre x{s:g}", j, pre > s * p.threshold, exact)
                if j > 0:
                    ratio = block.post_attention_layernorm.weight / layers[j - 1].post_attention_layernorm.weight
                    ahead = np.abs(np.array(act(gate(seen["x", j - 1] * ratio)))).reshape(-1)
                    for s in scales:
                        add(f"ahead x{s:g}", j, ahead > s * p.threshold, exact)
                f = freq[j]
                k = max(1, round(counts[f"pre x{scales[0]:g}"][j][2] / counts[f"pre x{scales[0]:g}"][j][3]))
                add("hot", j, f >= np.sort(f)[-k], exact)
            freq[j] = freq.get(j, 0) + exact
    # the runtime's own count of each sparse layer's needed neurons over the same tokens
    steps = model.flash_stats.steps[warmup:]
    needed = {j: sum(s.layers[j].neurons_needed for s in steps if j in s.layers)
              for j, k in kinds.items() if k == "sparse"}
    runtime.close()
    return {"kinds": kinds, "counts": counts, "tokens": len(tokens), "warmup": warmup, "needed": needed}


def summarise(result, layers) -> dict:
    """{candidate: (recall, precision, predicted per layer and token, exact per layer and token)}
    summed over `layers`."""
    out = {}
    for name, per_layer in result["counts"].items():
        rows = [per_layer[j] for j in layers if j in per_layer]
        if not rows:
            continue
        tp, pred, exact, tokens = (sum(r[k] for r in rows) for k in range(4))
        out[name] = (tp / max(exact, 1), tp / max(pred, 1), pred / max(tokens, 1), exact / max(tokens, 1))
    return out


def run(args):
    scales = tuple(float(s) for s in args.scales.split(","))
    result = measure(args.model, args.text, args.max_tokens, args.warmup, args.memory_budget, scales)
    kinds = result["kinds"]
    sparse = [j for j, k in kinds.items() if k == "sparse"]
    print(f"Model: {args.model}; {result['tokens'] - result['warmup']} tokens counted "
          f"(after {result['warmup']}); plan at memory budget {args.memory_budget}: {len(sparse)} sparse layers")
    print("| candidate | layers | recall | precision | predicted / layer / token | exact / layer / token |")
    print("|---|---|---|---|---|---|")
    half = len(kinds) // 2
    groups = [("sparse", sparse), (f"sparse < {half}", [j for j in sparse if j < half]),
              (f"sparse >= {half}", [j for j in sparse if j >= half])]
    for name in result["counts"]:
        for label, layers in groups:
            s = summarise(result, layers).get(name)
            if s is not None:
                print(f"| {name} | {label} ({len(layers)}) | {s[0]:.3f} | {s[1]:.3f} | {s[2]:.0f} | {s[3]:.0f} |")
    print(f"Reproduce: {getattr(args, 'command_line', 'python -m mlx_flash.bench early_reads ...')}")
    if args.json:
        write_json_atomic(args.json, {"command": getattr(args, "command_line", None), **result,
                                      "counts": {n: {str(j): c for j, c in v.items()}
                                                 for n, v in result["counts"].items()}})
    return 0
