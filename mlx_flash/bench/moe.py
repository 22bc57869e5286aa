"""MoE expert caching and prediction on real routing (EdgeMoE Figure 13 and 3.3.2).

    python -m mlx_flash.bench moe --model MOE_DIR --calib-text FILE... --text FILE...
        [--tokens 2048] [--calib-tokens 4096] [--width K] [--pack PACK --decode-tokens 32]

Routing is recorded on --text (held out) with the model fully loaded; the expert cache is replayed
on that trace token by token (decode order) with each policy at every per-layer cache size, next to
Belady's optimum on the same trace; the predictors (hidden-state lookahead, statistical profile
fitted on --calib-text) are scored for recall / precision of the next MoE layer's experts, and the
best policy is replayed again with the lookahead's experts preloaded.
--pack runs the streamed runtime itself (dense / naive / hybrid / flash at half the experts) for
--decode-tokens teacher-forced decode steps: tokens/s, bytes read and host syncs per token, and
whether every step's logits equal dense's bit for bit.
"""

import json
import platform
import time
from pathlib import Path

import numpy as np

from ..errors import FlashError


def add_arguments(p):
    p.add_argument("--model", required=True, help="mlx-lm MoE folder (e.g. python -m mlx_flash.moefy's)")
    p.add_argument("--calib-text", nargs="+", required=True, help="text for the routing profile")
    p.add_argument("--text", nargs="+", required=True, help="held-out text the trace is recorded on")
    p.add_argument("--tokens", type=int, default=2048, help="trace tokens")
    p.add_argument("--calib-tokens", type=int, default=4096)
    p.add_argument("--width", type=int, default=None, help="experts preloaded per layer (default top_k)")
    p.add_argument("--pack", default=None, help="also run the streamed runtime on this MoE pack")
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--ppl-k", type=int, nargs="*", default=None,
                   help="also report held-out perplexity of a moefied model at these top-k, next "
                        "to its dense source (config's derived_from)")
    p.add_argument("--ppl-packs", nargs="+", default=None, metavar="PACK",
                   help="also report held-out perplexity on --text of these MoE packs (every expert "
                        "resident: the logits the streamed runtime computes, bit for bit) and their "
                        "mean expert bits, each as a ratio to the first (e.g. an all-4-bit pack, "
                        "then convert --expert-bits ones)")
    p.add_argument("--json", default=None, help="write the figures here")


def hit_rate_table(trace, n_experts, top_k, width, profile):
    """Rows {"slots", policy: hit rate, ...} for per-layer capacities top_k..E, plus predictor
    recall / precision {name: (recall, precision)}."""
    from ..moe.cache import simulate
    from ..moe.predict import predictions, preload_plan, recall_precision

    accesses = trace.accesses()
    layers = trace.layers
    preds = {"lookahead": predictions(trace, "lookahead", width),
             "profile": predictions(trace, "profile", width, profile)}
    scores = {name: recall_precision(trace, p) for name, p in preds.items()}
    rows = []
    for slots in range(top_k, n_experts + 1):
        cap = {layer: slots for layer in layers}
        row = {"slots": slots}
        for policy in ("lru", "lfu", "layer", "belady"):
            row[policy] = simulate(accesses, layers, cap, policy).hit_rate
        best = max(("lru", "lfu", "layer"), key=lambda p: row[p])
        row["best"] = best
        if slots >= top_k + width or slots == n_experts:
            row["best+lookahead"] = simulate(accesses, layers, cap, best,
                                             preload=preload_plan(trace, preds["lookahead"])).hit_rate
        rows.append(row)
    half = n_experts // 2
    if half >= top_k:  # one pool of the same total size: where the layer-aware distance matters
        pooled = {p: simulate(accesses, layers, half * len(layers), p).hit_rate
                  for p in ("lru", "lfu", "layer", "belady")}
        rows.append({"slots": f"{half} (pooled)", **pooled})
    return rows, scores


def runtime_rows(pack, tokens, n_steps, slots, width):
    """Per mode: tokens/s, bytes read / token, host syncs / token, hit rate, exact vs dense."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from ..config import FlashConfig
    from ..models.moe import build_moe_model

    runs = [("dense", {}), ("naive", {}), ("hybrid", {"capacity": slots, "policy": "lru"}),
            ("flash", {"capacity": slots, "policy": "lru", "predictor": "lookahead",
                       "preload_width": width})]
    ref, rows = None, []
    for mode, kw in runs:
        model = build_moe_model(pack, FlashConfig(mode=mode), **kw)
        cache = make_prompt_cache(model)
        logits = []
        t0 = time.perf_counter()
        for t in tokens[:n_steps]:
            out = model(mx.array([[int(t)]]), cache=cache)[0, -1]
            mx.eval(out)
            logits.append(np.array(out))
        seconds = time.perf_counter() - t0
        store = model.moe_store
        if ref is None:
            ref = logits
        rows.append({"mode": mode, **kw, "tok_s": n_steps / seconds,
                     "exact": all(np.array_equal(a, b) for a, b in zip(ref, logits)),
                     "mb_read_per_token": store.bytes_read / n_steps / 1e6 if store else 0.0,
                     "host_syncs_per_token": store.host_syncs / n_steps if store else 0.0,
                     "hit_rate": store.cache.stats.hit_rate if store and store.keep else None})
        if store:
            store.close()
    return rows


def pack_perplexity(packs, tokens):
    """[{"pack", "ppl", "expert_bits": mean bits per expert weight, "tokens"}] of MoE packs."""
    from ..config import FlashConfig
    from ..models.moe import build_moe_model
    from ..moe.quality import held_out_perplexity
    from ..moe.store import expert_widths
    from ..pack import read_manifest

    rows = []
    for pack in packs:
        widths = [b for bits in expert_widths(read_manifest(pack)).values() for b in bits]
        r = held_out_perplexity([build_moe_model(pack, FlashConfig(mode="dense"))], tokens)
        rows.append({"pack": str(pack), "ppl": r["ppl"][0], "tokens": r["tokens"],
                     "expert_bits": float(np.mean(widths))})
        print(f"held-out perplexity ({r['tokens']} tokens) {pack}: {rows[-1]['ppl']:.3f} at "
              f"{rows[-1]['expert_bits']:.3f} bits per expert weight "
              f"(x{rows[-1]['ppl'] / rows[0]['ppl']:.4f} vs {rows[0]['pack']})", flush=True)
    return rows


def moefied_perplexity(model_dir, config, tokens, ks):
    """Held-out perplexity of the dense source and of the moefied model at each top-k."""
    from ..models import load_model
    from ..moe.quality import held_out_perplexity, set_moefied_top_k

    src = config.get("derived_from")
    if not src or "moefied" not in config:
        raise FlashError(f"--ppl-k: {model_dir} is not a moefied model (no derived_from)")
    dense, _ = load_model(Path(src), lazy=False)
    from mlx_lm.utils import dequantize_model

    dense = dequantize_model(dense)  # moefy's reference: the source dequantized, as it was split
    out = {"dense": held_out_perplexity([dense], tokens)["ppl"][0]}
    del dense
    moe, _ = load_model(Path(model_dir))
    for k in ks:
        set_moefied_top_k(moe, k)
        r = held_out_perplexity([moe], tokens)
        out[f"top{k}"] = r["ppl"][0]
        print(f"held-out perplexity ({r['tokens']} tokens): top-{k} of {config['num_local_experts']} "
              f"{out[f'top{k}']:.2f} vs dense {out['dense']:.2f} (x{out[f'top{k}'] / out['dense']:.2f})")
    return out


def run(args):
    import mlx.core as mx  # noqa: F401

    from ..models import load_model, load_tokenizer
    from ..models.moe import top_k_of, _n_experts
    from ..calibration.dense_pass import text_tokens
    from ..moe.predict import RoutingProfile, record_routing

    model, config = load_model(Path(args.model))
    tokenizer = load_tokenizer(Path(args.model))
    top_k, n_experts = top_k_of(config), _n_experts(config)
    if n_experts is None:
        raise FlashError(f"--model {args.model}: config.json names no expert count")
    width = args.width or top_k
    calib = text_tokens(args.calib_text, tokenizer, args.calib_tokens, flag="--calib-text")
    text = text_tokens(args.text, tokenizer, args.tokens, flag="--text")
    if set(map(str, args.calib_text)) & set(map(str, args.text)):
        raise FlashError("--text: held-out text must not repeat a --calib-text file")
    t0 = time.perf_counter()
    profile = RoutingProfile(record_routing(model, calib, width), n_experts)
    trace = record_routing(model, text, width)
    rows, scores = hit_rate_table(trace, n_experts, top_k, width, profile)
    print(f"# MoE expert cache on real routing: {args.model} ({n_experts} experts, top-{top_k}, "
          f"{len(trace.layers)} MoE layers), trace {trace.experts.shape[0]} held-out tokens "
          f"in decode order, per-layer cache; {platform.machine()} {platform.node()}, "
          f"{time.perf_counter() - t0:.0f} s")
    print(f"# command: {args.command_line}")
    print(f"| slots/layer | LRU | LFU | layer-aware | Belady | best + lookahead preload (width {width}) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        pre = f"{r['best+lookahead']:.3f} ({r['best']})" if "best+lookahead" in r else "-"
        print(f"| {r['slots']} | {r['lru']:.3f} | {r['lfu']:.3f} | {r['layer']:.3f} | "
              f"{r['belady']:.3f} | {pre} |")
    for name, (rec, prec) in scores.items():
        print(f"next-layer predictor {name}: recall {rec:.3f}, precision {prec:.3f} at width {width}")
    half = next((r for r in rows if r["slots"] == n_experts // 2), None)
    if half:
        best = max(half[p] for p in ("lru", "lfu", "layer"))
        print(f"half the experts cached ({half['slots']}/layer): best policy {best:.3f}, "
              f"Belady {half['belady']:.3f} (gap {half['belady'] - best:.3f})")
    result = {"command": args.command_line, "rows": rows,
              "predictors": {k: {"recall": v[0], "precision": v[1]} for k, v in scores.items()}}
    if args.pack:
        rt = runtime_rows(args.pack, text, args.decode_tokens, max(top_k, n_experts // 2), width)
        print(f"# runtime on {args.pack}: {args.decode_tokens} teacher-forced decode steps, "
              f"{n_experts // 2} slots/layer (shared 2-core machine: ratios only)")
        print("| mode | tok/s | MB read/token | host syncs/token | hit rate | logits == dense |")
        print("|---|---|---|---|---|---|")
        for r in rt:
            hr = f"{r['hit_rate']:.3f}" if r["hit_rate"] is not None else "-"
            print(f"| {r['mode']} | {r['tok_s']:.1f} | {r['mb_read_per_token']:.2f} | "
                  f"{r['host_syncs_per_token']:.0f} | {hr} | {r['exact']} |")
        result["runtime"] = rt
    if args.ppl_k:
        result["perplexity"] = moefied_perplexity(args.model, config, text, args.ppl_k)
    if args.ppl_packs:
        result["pack_perplexity"] = pack_perplexity(args.ppl_packs, text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 0
