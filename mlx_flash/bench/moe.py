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
    p.add_argument("--importance-samples", type=int, default=0, metavar="N",
                   help="also check convert --expert-bits' importance proxy against EdgeMoE's "
                        "measure (one expert at 2 bits, loss change on --calib-text) on N random "
                        "experts: Spearman rank correlation (group size --group-size)")
    p.add_argument("--bits-variants", type=float, default=None, metavar="AVG",
                   help="also report held-out perplexity with the experts at a mean of AVG bits "
                        "chosen each way convert can (calibration on the first --calib-tokens "
                        "--calib-text tokens, at most as many as convert --expert-bits takes "
                        "by default; gptq-fit, non-expert weights 4-bit, group size --group-size), "
                        "next to every expert at 4 bits: one calibration for all rows")
    p.add_argument("--group-size", type=int, default=32,
                   help="--importance-samples' and --bits-variants' group size")
    p.add_argument("--routing-stability", type=int, nargs="+", default=None, metavar="BITS",
                   help="also report how many of each token's experts change at later layers when "
                        "only layer --stability-layer's experts are quantized (mx.quantize, group "
                        "size --group-size) at each BITS, on the first --stability-tokens --text tokens")
    p.add_argument("--stability-layer", type=int, default=0)
    p.add_argument("--stability-tokens", type=int, default=1024)
    p.add_argument("--no-cache-tables", action="store_true",
                   help="skip the routing traces' cache and predictor tables (only the --ppl-k, "
                        "--ppl-packs, --bits-variants, --routing-stability figures)")
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


def capacity_rows(calib_trace, trace, top_k, n_experts):
    """Rows {"slots", "policy", "equal", "calibrated", "min", "max"}: held-out hit rate of the
    best policy with `slots` per layer in every layer vs the same total split by the calibration
    trace's per-layer hit curves (moe.cache.layer_capacities)."""
    from ..moe.cache import hit_curves, simulate, split_slots_by_curves

    layers, accesses, calib = trace.layers, trace.accesses(), calib_trace.accesses()
    sizes = list(range(top_k, n_experts + 1))
    rows, curves = [], {}
    for slots in range(top_k, n_experts):
        equal = {layer: slots for layer in layers}
        policy = max(("lru", "lfu"), key=lambda p: simulate(accesses, layers, equal, p).hits)
        if policy not in curves:
            curves[policy] = hit_curves(calib, layers, policy, sizes)
        cap = split_slots_by_curves(curves[policy], sizes, slots * len(layers))
        rows.append({"slots": slots, "policy": policy,
                     "equal": simulate(accesses, layers, equal, policy).hit_rate,
                     "calibrated": simulate(accesses, layers, cap, policy).hit_rate,
                     "min": min(cap.values()), "max": max(cap.values()), "capacity": cap})
    return rows


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


def bits_variant_rows(args, calib, text):
    """calibration.expert_bits.assignment_perplexities on --model, printed as a table."""
    from collections import Counter

    from ..calibration.expert_bits import assignment_perplexities
    from ..calibration.expert_tune import quantize_resident
    from ..models import load_model

    model, _ = load_model(Path(args.model), lazy=False)
    student, _ = load_model(Path(args.model), lazy=False)
    quantize_resident(student, 4, args.group_size)
    rows = assignment_perplexities(model, student, calib, text, args.bits_variants,
                                   args.group_size)
    print(f"# experts at a mean of {args.bits_variants:g} bits (gptq-fit, group size "
          f"{args.group_size}, non-expert weights 4-bit; calibration {len(calib)} tokens), "
          f"held-out perplexity on {rows[0]['tokens']} --text tokens")
    print("| widths chosen by | mean bits | experts per width | held-out ppl | vs all 4-bit |")
    print("|---|---|---|---|---|")
    for r in rows:
        counts = Counter(b for bits in r["bits"].values() for b in bits)
        per = ", ".join(f"{b}-bit {counts[b]}" for b in sorted(counts))
        print(f"| {r['name']} | {r['mean_bits']:.3f} | {per} | {r['ppl']:.2f} | "
              f"x{r['ppl'] / rows[0]['ppl']:.3f} |", flush=True)
    return rows


def routing_stability(model, tokens, widths, layer=0, group_size=32, seq_len=256) -> list:
    """Rows {"bits", "kl": KL(float || perturbed) nats per token, "changed": [per MoE layer: mean
    over tokens of the experts chosen that the float model did not choose]} with only `layer`'s
    experts quantized-dequantized (mx.quantize) at each of `widths` bits, over the windows of
    seq_len of `tokens`: how far a small error early re-routes the later layers."""
    import mlx.core as mx

    from ..calibration.expert_bits import experts_at_widths, routing_replay, switch_glus
    from ..calibration.training import distill_kl

    found = switch_glus(model)
    if layer not in found:
        raise FlashError(f"--stability-layer {layer}: not an MoE layer of the model")
    n_exp = found[layer][2].up_proj.weight.shape[0]
    windows = [mx.array(tokens[s: s + seq_len])[None] for s in range(0, len(tokens) - seq_len + 1, seq_len)]
    if not windows:
        raise FlashError(f"--stability-tokens: need at least {seq_len} --text tokens")
    rows = []
    with routing_replay(model) as replays:
        ref = [model(w) for w in windows]
        mx.eval(ref)
        ref_chosen = [r.chosen for r in replays]
        for bits in widths:
            for r in replays:
                r.chosen = []
            with experts_at_widths(model, {layer: [bits] * n_exp}, group_size):
                logits = [model(w) for w in windows]
                kl = float(mx.mean(mx.stack([distill_kl(q, t) for t, q in zip(ref, logits)])).item())
            changed = [float(np.mean([np.array(mx.sum(new & ~old, axis=-1)).mean()
                                      for new, old in zip(r.chosen, old_calls)]))
                       for r, old_calls in zip(replays, ref_chosen)]
            rows.append({"bits": bits, "kl": kl, "changed": changed})
    return rows


def print_routing_stability(rows, layer, tokens, top_k, shown=(5, 10, 20, 25)):
    shown = [i for i in shown if i < len(rows[0]["changed"])] or [len(rows[0]["changed"]) - 1]
    print(f"# routing stability: only layer {layer}'s experts quantized (mx.quantize), {tokens} "
          f"--text tokens; experts per token (of {top_k}) that differ from the float model's")
    print(f"| layer {layer}'s experts at | KL from float (nats/token) | changed at layers "
          f"{' / '.join(map(str, shown))} | mean over all layers |")
    print("|---|---|---|---|")
    for r in rows:
        changed = " / ".join(f"{r['changed'][i]:.2f}" for i in shown)
        print(f"| {r['bits']} bits | {r['kl']:.4f} | {changed} | {np.mean(r['changed']):.2f} |", flush=True)


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


def cache_tables(args, model, calib, text, width, top_k, n_experts) -> dict:
    """The routing traces' tables, printed: hit rate of every policy at every per-layer cache
    size next to Belady's, the predictors' recall / precision, and the calibrated slot split."""
    from ..moe.predict import RoutingProfile, record_routing

    t0 = time.perf_counter()
    calib_trace = record_routing(model, calib, width)
    profile = RoutingProfile(calib_trace, n_experts)
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
    caps = capacity_rows(calib_trace, trace, top_k, n_experts)
    print("| slots/layer (total = x MoE layers) | policy | hit rate, equal split | hit rate, split by "
          "calibration routing | calibrated slots min..max |")
    print("|---|---|---|---|---|")
    for r in caps:
        print(f"| {r['slots']} | {r['policy']} | {r['equal']:.3f} | {r['calibrated']:.3f} | "
              f"{r['min']}..{r['max']} |")
    return {"rows": rows, "capacity": caps,
            "predictors": {k: {"recall": v[0], "precision": v[1]} for k, v in scores.items()}}


def run(args):
    import mlx.core as mx  # noqa: F401

    from ..models import load_model, load_tokenizer
    from ..models.moe import top_k_of, _n_experts
    from ..calibration.dense_pass import text_tokens

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
    result = {"command": args.command_line}
    if not args.no_cache_tables:
        result.update(cache_tables(args, model, calib, text, width, top_k, n_experts))
    else:
        print(f"# {args.model}: {platform.machine()} {platform.node()}\n# command: {args.command_line}")
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
    if args.importance_samples:
        from ..calibration.expert_bits import EXPERT_BITS_CALIB_TOKENS, measure_errors, validate_importance

        proxy = calib[:EXPERT_BITS_CALIB_TOKENS]  # the tokens convert --expert-bits measures on
        errors = measure_errors(model, proxy, args.group_size, progress=False)
        check = validate_importance(model, calib[:1024], errors, args.group_size,
                                    samples=args.importance_samples)
        print(f"importance proxy on {len(proxy)} calibration tokens vs loss change (one expert at "
              f"2 bits, {len(check['pairs'])} experts, {len(calib[:1024])} calibration tokens, base "
              f"loss {check['base_loss']:.3f} nats): Spearman {check['spearman']:.3f} "
              f"({check['seconds']:.0f} s)", flush=True)
        check["proxy_tokens"] = len(proxy)
        result["importance"] = check
    if args.bits_variants is not None:
        from ..calibration.expert_bits import EXPERT_BITS_CALIB_TOKENS

        result["bits_variants"] = bits_variant_rows(args, calib[:EXPERT_BITS_CALIB_TOKENS], text)
    if args.ppl_packs:
        result["pack_perplexity"] = pack_perplexity(args.ppl_packs, text)
    if args.routing_stability:
        n = (min(args.stability_tokens, len(text)) // 256) * 256
        result["routing_stability"] = routing_stability(model, text[:n], args.routing_stability,
                                                        args.stability_layer, args.group_size)
        print_routing_stability(result["routing_stability"], args.stability_layer, n, top_k)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 0


# ---- bench run on MoE packs (EdgeMoE's baselines, Figure 16 ablation, Figure 13 on the run) ------

def generate_moe(pack, mode, prompt, gen_tokens, budget=None, threads=32, capacity=None,
                 policy="layer", predictor="lookahead", preload_width=None, record=False,
                 temp=0.0, seed=0, kernels=True, **_) -> dict:
    """A `bench run` child on an MoE pack: load `pack` in `mode`, generate greedily, measure.

    Returns JSON-ready figures: `summary` per decode token (total_ms, io_ms = time the token
    waited for expert reads: foreground reads + waits on the background preload, compute_ms
    the rest, bytes_read = device bytes the token waited for (the read planner may cover the
    gap between two nearby experts), preload_bytes read in the background, useful_bytes = the
    expert blocks asked for (both), hit_rate, host_syncs) and for the run (prompt_ms,
    tokens, peak_memory from MLX, peak_rss in bytes), `plan_weights_bytes` (resident + slot bank
    + scratch bank), load seconds, and with `record` the decode routing [(layer, experts)].
    kernels: False turns the CPU kernels off in this child (MLX's own ops: gather_qmm for the
    experts); on, where they run, dense mode holds every expert in a slot bank read at load (the
    same compute path as the streamed rows; models.moe).
    """
    import resource
    import sys

    import mlx.core as mx
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from ..config import FlashConfig
    from ..cpu import ops
    from ..models import load_tokenizer
    from ..models.moe import build_moe_model
    from ..moe.switch import StreamedSwitchGLU
    from ..pack import read_manifest

    if not kernels:
        ops.set_kernels_enabled(False)
    t0 = time.perf_counter()
    model = build_moe_model(pack, FlashConfig(mode=mode, memory_budget=budget, threads=threads),
                            policy=policy, predictor=predictor, preload_width=preload_width,
                            capacity=capacity)
    tokenizer = load_tokenizer(Path(pack))
    load_s = time.perf_counter() - t0
    store = model.moe_store
    routes = []
    if record and store is not None:
        for module in (m for _, m in model.named_modules() if isinstance(m, StreamedSwitchGLU)):
            module._on_route = lambda layer, ids, _ahead: routes.append((layer, ids.copy()))

    def snapshot():
        s = store
        return {"t": time.perf_counter(), "io": s.io_snapshot() if s else None,
                "hits": s.cache.stats.hits if s and s.keep else 0,
                "misses": s.cache.stats.misses if s and s.keep else 0,
                "syncs": s.host_syncs if s else 0, "routes": len(routes)}

    mx.random.seed(seed)
    marks, t1 = [], time.perf_counter()
    for _ in stream_generate(model, tokenizer, list(prompt), max_tokens=gen_tokens,
                             sampler=make_sampler(temp=temp)):
        marks.append(snapshot())
    if store is not None:
        store.close()
    first, last = marks[0], marks[-1]
    n = max(1, len(marks) - 1)

    def per_token(key):
        return (last[key] - first[key]) / n

    total_ms = 1e3 * per_token("t")
    io_log = io_per_token(first["io"], last["io"], n)
    io_ms = 1e3 * sum(v[2] for kind in ("demand", "preload_wait") for v in io_log[kind].values())
    accesses = (last["hits"] - first["hits"]) + (last["misses"] - first["misses"])
    summary = {"total_ms": total_ms, "io_ms": io_ms, "compute_ms": total_ms - io_ms,
               "bytes_read": sum(v[1] for v in io_log["demand"].values()),
               "preload_bytes": sum(v[1] for v in io_log["preload"].values()),
               "waited_preload_bytes": sum(v[1] for v in io_log["preload_wait"].values()),
               "useful_bytes": io_log["useful"], "io_log": io_log,
               "hit_rate": (last["hits"] - first["hits"]) / accesses if accesses else None,
               "host_syncs": per_token("syncs"), "prompt_ms": 1e3 * (first["t"] - t1),
               "tokens": len(marks), "peak_memory": mx.get_peak_memory(),
               "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
               * (1 if sys.platform == "darwin" else 1024)}
    manifest = read_manifest(pack)
    weights = manifest.resident.length
    if store is None:
        weights += sum(b.count * b.stride for b in manifest.bundles)
    else:  # slot banks + scratch banks (naive mode's, or a long prompt's, one-layer bank)
        weights += sum(a.nbytes for bank in [*store.banks.values(), *store.scratch.values()]
                       for a in bank.values())
    out = {"mode": mode, "kernels": ops.kernels_active(), "budget": budget, "capacity": capacity, "policy": policy,
           "predictor": predictor if mode == "flash" else None, "load_s": load_s,
           "summary": summary, "plan_weights_bytes": weights,
           "slots_per_layer": (store.cache.capacity_of(next(iter(store.entries)))
                               if store is not None and store.keep else None)}
    if record:
        out["routes"] = [(int(layer), ids.reshape(-1).tolist()) for layer, ids in routes[first["routes"]:]]
    return out


IO_KINDS = ("demand", "preload", "preload_wait")


def io_per_token(first, last, tokens) -> dict:
    """ExpertStore.io_snapshot's difference between two marks, per token: {kind: {str(reads in
    flight): [loader calls, device bytes, seconds]}, "useful": bytes} (zeros without a store)."""
    out = {kind: {} for kind in IO_KINDS}
    out["useful"] = 0.0
    if first is None:
        return out
    for kind in IO_KINDS:
        for depth, now in last[kind].items():
            before = first[kind].get(depth, [0, 0, 0.0])
            delta = [(a - b) / tokens for a, b in zip(now, before)]
            if delta[0] > 0:
                out[kind][str(depth)] = delta
    out["useful"] = (last["useful"] - first["useful"]) / tokens
    return out


MLX_ROW = "MLX ops: "  # label prefix of a row run with the CPU kernels off (bench run --mlx-rows)


def suite_rows(args, pack, manifest) -> list:
    """[(label, pack, mode, kwargs)]: EdgeMoE's baselines and the Figure 16 ablation rows (those
    named by --moe-rows, default all)."""
    from ..models.moe import top_k_of
    from ..pack import read_manifest

    top_k = top_k_of(manifest.config)
    q = manifest.config.get("quantization") or {}
    bits = f"{q['bits']}-bit" if q else "float"
    # IO-FREE holds the whole model: its cap is raised to the pack (+ the same process baseline)
    rows = [("IO-FREE (dense: every expert resident, cap raised to the whole model)", pack,
             "dense", {"budget": None})]
    if args.io_exp_pack:
        exp = read_manifest(Path(args.io_exp_pack).expanduser())
        eq = exp.config.get("quantization") or {}
        rows.append((f"IO-EXP (naive: experts read on demand, {eq.get('bits', 16)}-bit)",
                     args.io_exp_pack, "naive", {"budget": None}))
    rows += [
        (f"IO-QEXP (naive: experts read on demand, {bits})", pack, "naive",
         {"budget": None, "record": True}),
        ("cache only (hybrid: expert cache, no preload)", pack, "hybrid",
         {"policy": args.moe_policy}),
        (f"preload only (flash, {2 * top_k} slots: this and the predicted experts)", pack,
         "flash", {"budget": None, "capacity": 2 * top_k, "policy": args.moe_policy}),
        ("ours (flash: expert cache + preload)", pack, "flash", {"policy": args.moe_policy}),
    ]
    wanted = getattr(args, "moe_rows", None)
    if wanted:
        names = {"IO-FREE": "io-free", "IO-EXP": "io-exp", "IO-QEXP": "io-qexp",
                 "cache only": "cache", "preload only": "preload", "ours": "ours"}
        rows = [r for r in rows if names[r[0].split(" (")[0]] in wanted]
    return rows


def with_compute_paths(rows, mlx_rows: bool, kernels: bool) -> list:
    """[(label, pack, mode, kwargs, on_kernels)]: each row on the CPU kernels when `kernels`,
    and with `mlx_rows` each followed by itself on MLX's own ops (label prefixed MLX_ROW)."""
    if not mlx_rows:
        return [(*row, kernels) for row in rows]
    return [row for label, *rest in rows
            for row in ((label, *rest, True), (f"{MLX_ROW}{label}", *rest, False))]


def aggregate_moe(records) -> dict:
    """Mean/std over the repeats of one row."""
    import statistics

    ok = [r for r in records if r["ok"]]
    row = {"label": records[0]["label"], "runs": len(records), "ok_runs": len(ok),
           "errors": sorted({str(r["error"]).splitlines()[-1][:200] for r in records if not r["ok"]}),
           "oom_killed": any(r.get("oom_killed") for r in records),
           "peak_bytes": max((r["peak_bytes"] or 0 for r in records), default=None),
           "cap_bytes": records[0]["cap_bytes"], "pack": records[0]["kwargs"]["pack"],
           "mode": records[0]["kwargs"]["mode"]}
    if not ok:
        return row
    for key in ("total_ms", "io_ms", "compute_ms", "bytes_read", "preload_bytes",
                "waited_preload_bytes", "hit_rate", "host_syncs", "prompt_ms", "peak_memory",
                "peak_rss"):
        vals = [r["value"]["summary"].get(key) for r in ok]
        vals = [v for v in vals if v is not None]
        row[key] = statistics.fmean(vals) if vals else None
        row[key + "_std"] = statistics.stdev(vals) if len(vals) > 1 else 0.0
    row["tok_s"] = 1e3 / row["total_ms"] if row["total_ms"] else None
    logs = [r["value"]["summary"].get("io_log") or {} for r in ok]
    row["io_log"] = {kind: {d: [sum(log.get(kind, {}).get(d, [0, 0, 0.0])[i] for log in logs) / len(logs)
                                for i in range(3)]
                            for d in sorted({d for log in logs for d in log.get(kind, {})}, key=int)}
                     for kind in IO_KINDS}
    row["tokens"] = ok[0]["value"]["summary"]["tokens"]
    row["plan_weights_bytes"] = ok[0]["value"]["plan_weights_bytes"]
    row["slots_per_layer"] = ok[0]["value"]["slots_per_layer"]
    row["load_s"] = statistics.fmean(r["value"]["load_s"] for r in ok)
    return row


def expert_io_accounting(rows, threads, total_bytes=128 << 20, runs=3, reference=None) -> list:
    """Per row that waited for expert bytes: what the token waited for and fio's time for the same
    bytes. rows: aggregate_moe rows ("label", "pack", "io_log" per token). For each kind of wait
    ("demand" reads, "preload_wait" on a preload that had not landed; waited preload bytes count
    as bytes) the fio-equivalent ms is the sum over the loader calls' depths (reads in flight,
    at most `threads`) of their bytes / fio's throughput on the pack's expert blocks at that
    depth (median of `runs` fio runs: a shared disk moves it). reference: (pack, depth) -> fio
    reference dict (bench.io.expert_fio_reference by default; tests pass their own).
    Returns [{"label", "<kind>_mb", "<kind>_ms", "<kind>_fio_ms" for demand and preload_wait,
    "preload_mb", "wait_ms", "fio_ms", "over_fio", "fio": {depth: GB/s}, "command"}] ([] without fio).
    """
    from .io import expert_fio_reference, fio_ms

    refs = {}

    def gbps(pack, depth):
        if (pack, depth) not in refs:
            if reference is not None:
                got = [reference(pack, depth)]
            else:
                got = [expert_fio_reference(pack, depth, total_bytes) for _ in range(max(1, runs))]
            refs[(pack, depth)] = (None if got[0] is None
                                   else sorted(got, key=lambda r: r["gbps"])[len(got) // 2])
        return refs[(pack, depth)]

    out = []
    for row in rows:
        log = row.get("io_log") or {}
        waited = {kind: log.get(kind, {}) for kind in ("demand", "preload_wait")}
        if not any(v[1] for kind in waited.values() for v in kind.values()):
            continue
        entry = {"label": row["label"], "fio": {}}
        for kind, by_depth in waited.items():
            entry[f"{kind}_mb"] = sum(v[1] for v in by_depth.values()) / 1e6
            entry[f"{kind}_ms"] = 1e3 * sum(v[2] for v in by_depth.values())
            fio = 0.0
            for depth, (_, nbytes, _) in by_depth.items():
                depth = max(1, min(int(threads), int(depth)))
                ref = gbps(row["pack"], depth)
                if ref is None:
                    return []
                entry["fio"][depth] = ref["gbps"]
                entry["command"] = ref["command"]
                fio += fio_ms(nbytes, ref)
            entry[f"{kind}_fio_ms"] = fio
        entry["preload_mb"] = sum(v[1] for v in log.get("preload", {}).values()) / 1e6
        entry["wait_ms"] = entry["demand_ms"] + entry["preload_wait_ms"]
        entry["fio_ms"] = entry["demand_fio_ms"] + entry["preload_wait_fio_ms"]
        entry["over_fio"] = entry["wait_ms"] / entry["fio_ms"] if entry["fio_ms"] else None
        out.append(entry)
    return out


def expert_io_lines(entries) -> str:
    """expert_io_accounting's rows as report lines ('' when there are none)."""
    if not entries:
        return ""
    lines = ["", "Expert I/O per decode token vs fio's time for the same bytes (O_DIRECT random "
             "reads of the pack's expert blocks at each loader call's depth; target <= 1.3x):", "",
             "| row | demand MB | demand ms | fio ms | waited preload MB | preload wait ms | fio ms "
             "| background preload MB | waited / fio |", "|---|---|---|---|---|---|---|---|---|"]
    for e in entries:
        lines.append(f"| {e['label']} | {e['demand_mb']:.1f} | {e['demand_ms']:.1f} | "
                     f"{e['demand_fio_ms']:.1f} | {e['preload_wait_mb']:.1f} | "
                     f"{e['preload_wait_ms']:.1f} | {e['preload_wait_fio_ms']:.1f} | "
                     f"{e['preload_mb']:.1f} | {e['over_fio']:.2f}x |")
    depths = sorted({d: g for e in entries for d, g in e["fio"].items()}.items())
    lines.append("fio GB/s by depth: " + ", ".join(f"{d}: {g:.3f}" for d, g in depths)
                 + f" (`{entries[0]['command']}`, --iodepth per depth)")
    return "\n".join(lines) + "\n"


def hit_rate_vs_slots(routes, n_experts, top_k, measured=None) -> list:
    """EdgeMoE Figure 13 on a recorded decode trace [(layer, experts)]: per-layer slots -> hit
    rate of LRU, LFU, the layer-aware policy and Belady's optimum (no preload)."""
    from ..moe.cache import simulate

    layers = sorted({layer for layer, _ in routes})
    points = sorted({top_k, *(max(top_k, n_experts * f // 8) for f in (1, 2, 4, 6)), n_experts})
    rows = []
    for slots in points:
        cap = {layer: slots for layer in layers}
        rows.append({"slots": slots, **{p: simulate(routes, layers, cap, p).hit_rate
                                        for p in ("lru", "lfu", "layer", "belady")}})
    return rows


def run_suite(suite, args, prompts, peer_names, out, command, machine, packages, profile_line) -> int:
    """`bench run` on an MoE pack: every row cold, in a fresh child, under the same cap.
    machine, packages, profile_line: bench run's machine_info(), package_versions() and
    stored_profile_line() (the read-cost profile that prices the runs' reads)."""
    import os

    from ..cpu import ops
    from ..models.moe import _n_experts, top_k_of
    from . import peers as peer_mod
    from ..paths import write_json_atomic
    from .report import write_text

    manifest = suite.manifest
    config = manifest.config
    top_k, n_experts = top_k_of(config), _n_experts(config)
    kernels = ops.kernels_active()
    rows = with_compute_paths(suite_rows(args, suite.pack, manifest), args.mlx_rows, kernels)
    for rep in range(args.repeats):  # repeats outermost: background load hits every row alike
        for label, pack, mode, kw, on_kernels in rows:
            if kw.get("record") and (rep or not on_kernels):
                kw = {k: v for k, v in kw.items() if k != "record"}
            kwargs = {"pack": str(pack), "mode": mode, "prompt": prompts[rep]["ids"],
                      "gen_tokens": args.gen_tokens, "budget": args.memory_budget,
                      "threads": args.threads, "kernels": on_kernels, "temp": args.temp,
                      "seed": rep, **kw}
            budget = suite.pack_bytes if mode == "dense" else suite.budget_bytes
            suite.child("moe", label, "mlx_flash.bench.moe:generate_moe", kwargs,
                        budget_bytes=budget, paths=[pack], repeat=rep)
    peer_results = peer_mod.run_peers(suite, peer_names, prompts, out)
    table = [aggregate_moe([r for r in suite.runs if r["group"] == "moe" and r["label"] == label])
             for label, *_ in rows]
    routes = next((r["value"]["routes"] for r in suite.runs
                   if r["ok"] and r["value"] and "routes" in r["value"]), None)
    fig13 = hit_rate_vs_slots(routes, n_experts, top_k) if routes else []
    expert_bytes = sum(b.count * b.stride for b in manifest.bundles)
    result = {
        "command": command, "cwd": os.getcwd(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine, "packages": packages,
        "model": {"pack": str(suite.pack), "pack_bytes": suite.pack_bytes,
                  "resident_bytes": manifest.resident.length, "expert_bytes": expert_bytes,
                  "moe_layers": len(manifest.bundles), "experts": n_experts, "top_k": top_k,
                  "synthetic": manifest.synthetic, "io_exp_pack": args.io_exp_pack},
        "protocol": {"prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens,
                     "repeats": args.repeats, "threads": args.threads,
                     "memory_budget": args.memory_budget, "budget_bytes": suite.budget_bytes,
                     "policy": args.moe_policy, "kernels": kernels, "mlx_rows": args.mlx_rows,
                     "temp": args.temp,
                     "prompts": [{k: v for k, v in p.items() if k != "ids"} for p in prompts],
                     "eviction": {m: {"max_residency_after": r} for m, r in suite.evictions.items()},
                     "cap": {**suite.cap, "cap_bytes": suite.cap_for(suite.budget_bytes)}},
        "read_cost_profile": profile_line,
        "rows": table, "peers": peer_results, "hit_rate_vs_slots": fig13,
        "runs": [{k: v for k, v in r.items() if k != "value"} | {"value": _without_routes(r["value"])}
                 for r in suite.runs],
    }
    result["speedups"] = moe_speedups(table, peer_results)
    result["io_vs_fio"] = expert_io_accounting(table, args.threads)
    write_json_atomic(out / "results.json", result, default=str)
    text = moe_markdown(result) + expert_io_lines(result["io_vs_fio"])
    write_text(out / "report.md", text)
    (out / "runs.partial.json").unlink(missing_ok=True)
    print(text)
    print(f"\nresults: {out / 'results.json'}\nreport:  {out / 'report.md'}")
    return 0


def _without_routes(value):
    if not isinstance(value, dict) or "routes" not in value:
        return value
    return {k: v for k, v in value.items() if k != "routes"} | {"routes": f"{len(value['routes'])} accesses"}


def moe_speedups(table, peers) -> dict:
    """ours' tokens/s over each baseline's (None where a row did not run)."""
    by = {r["label"].split(" (")[0]: r for r in table}
    ours = by.get("ours", {}).get("total_ms")
    out = {}
    if not ours:
        return out
    for name, row in by.items():
        if name != "ours" and row.get("total_ms"):
            out[name] = row["total_ms"] / ours
    for name, res in peers.items():
        if res.get("ok") and res.get("total_ms"):
            out[name] = res["total_ms"] / ours
    return out


def moe_markdown(result) -> str:
    m, p = result["model"], result["protocol"]
    syn = m["synthetic"]
    gb = 1e9
    lines = [f"# bench run on an MoE pack: {m['pack']}",
             "",
             (f"**SYNTHETIC weights ({syn['arch']}): random, for speed only; random routers, so "
              f"hit rates describe this random model's routing, not a trained model's.**"
              if syn else "Real weights."),
             f"Pack {m['pack_bytes'] / gb:.3f} GB: resident {m['resident_bytes'] / gb:.3f} GB, experts "
             f"{m['expert_bytes'] / gb:.3f} GB ({m['moe_layers']} MoE layers x {m['experts']} experts, "
             f"top-{m['top_k']}). Budget {p['memory_budget']} = {p['budget_bytes'] / gb:.3f} GB; cap "
             + (f"{p['cap']['cap_bytes'] / gb:.3f} GB (cgroup v1, budget + measured process baseline "
                f"+ KV cache)" if p["cap"].get("used") else f"none ({p['cap'].get('reason')})")
             + f"; eviction before each run: {', '.join(p['eviction']) or '-'}.",
             f"Prompt {p['prompt_tokens']} tokens, {p['gen_tokens']} generated "
             f"({'sampled at temperature ' + str(p['temp']) if p['temp'] else 'greedy'}), "
             f"{p['repeats']} cold run(s) per row, policy {p['policy']}, {p['threads']} reads in flight, "
             "compute: " + ("CPU kernels (rows marked MLX ops: MLX's own ops, gather_qmm)"
                           if p["mlx_rows"] else "CPU kernels" if p["kernels"]
                           else "MLX's own ops (gather_qmm)") + ".",
             f"Machine: {result['machine'].get('cpu', '?')}, {result['machine']['cpus']} cores, load "
             f"{result['machine']['load_average']} (shared machine: compare rows, not absolute figures).",
             f"Reads priced by the {result['read_cost_profile']}.",
             f"Command: `{result['command']}`", "",
             "| row | tok/s | ms/token | I/O ms/token | MB read/token | preload MB/token | hit rate "
             "| host syncs/token | peak GB (cap) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if not r.get("total_ms"):
            why = "OOM-killed under the cap" if r.get("oom_killed") else "; ".join(r["errors"])[:120]
            lines.append(f"| {r['label']} | did not run: {why} | | | | | | | "
                         f"{(r['peak_bytes'] or 0) / gb:.2f} |")
            continue
        hr = f"{r['hit_rate']:.3f}" if r.get("hit_rate") is not None else "-"
        lines.append(f"| {r['label']} | {r['tok_s']:.2f} | {r['total_ms']:.0f} ± {r['total_ms_std']:.0f} "
                     f"| {r['io_ms']:.0f} | {r['bytes_read'] / 1e6:.1f} | {r['preload_bytes'] / 1e6:.1f} "
                     f"| {hr} | {r['host_syncs']:.0f} | {(r['peak_bytes'] or 0) / gb:.2f} |")
    for name, res in result["peers"].items():
        if res.get("ok"):
            lines.append(f"| {name} ({res['note']}) | {1e3 / res['total_ms']:.2f} | "
                         f"{res['total_ms']:.0f} ± {res['total_ms_std']:.0f} | - | - | - | - | - | "
                         f"{(res['peak_bytes'] or 0) / gb:.2f} |")
        else:
            lines.append(f"| {name} | {res['status']}: {str(res.get('error'))[:120]} | | | | | | | |")
    if result["speedups"]:
        lines += ["", "ours vs each row (ms/token ratio): " + ", ".join(
            f"{k} {v:.2f}x" for k, v in result["speedups"].items())]
    by_label = {r["label"]: r for r in result["rows"]}
    paths = [(r["label"].split(" (")[0], r["total_ms"] / by_label[MLX_ROW + r["label"]]["total_ms"])
             for r in result["rows"] if by_label.get(MLX_ROW + r["label"], {}).get("total_ms")
             and r.get("total_ms")]
    if paths:
        lines += ["", "each row's MLX-ops run vs its CPU-kernel run (ms/token ratio, higher: the "
                  "kernels faster): " + ", ".join(f"{k} {1 / v:.2f}x" for k, v in paths)]
    if result["hit_rate_vs_slots"]:
        lines += ["", "Hit rate vs per-layer cache size on the decode routing recorded in the "
                  "IO-QEXP run (no preload; EdgeMoE Figure 13):", "",
                  "| slots/layer | LRU | LFU | layer-aware | Belady |", "|---|---|---|---|---|"]
        for r in result["hit_rate_vs_slots"]:
            lines.append(f"| {r['slots']} | {r['lru']:.3f} | {r['lfu']:.3f} | {r['layer']:.3f} | "
                         f"{r['belady']:.3f} |")
    return "\n".join(lines) + "\n"
