"""Bytes read per token at the same active neurons under three neuron orders of a pack's layers:
the pack's own, by activation frequency, and by co-activation (calibration/reorder.py).

    python -m mlx_flash.bench reorder --model PACK --text FILE [FILE ...] [--max-tokens 4096]
        [--target-sparsity T] [--json OUT]

One dense pass over the text (as calibrate runs it) gives each layer's active neurons per token
(the thresholded model: |act| > t; ReLU-family models t = 0). The orders are fitted on the first
90% of the tokens; on the held-out 10%, each token's active neurons are read as the flash loader
plans it (aligned blocks, merged by this machine's stored read-cost model when there is one, else
only touching blocks merged) and the bytes are counted. Same neurons, different order: the ratio is
what `calibrate --reorder` saves in bytes read per token. Nothing is read from disk here.
"""

import json
from pathlib import Path


def add_arguments(parser):
    parser.add_argument("--model", required=True, help="a flash pack")
    parser.add_argument("--text", nargs="+", required=True, metavar="FILE", help="text the activity is measured on")
    parser.add_argument("--max-tokens", type=int, default=4096, help="tokens of text (default 4096)")
    parser.add_argument("--target-sparsity", type=float, default=0.0,
                        help="threshold |act| at this quantile (default 0: exact zeros, ReLU-family models)")
    parser.add_argument("--threads", type=int, default=32, help="reads in flight the cost model prices (default 32)")
    parser.add_argument("--json", default=None, metavar="OUT", help="also write the rows as JSON")
    parser.add_argument("--quiet", action="store_true")


def run(args):
    from ..calibration.dense_pass import collect_inputs
    from ..calibration.reorder import compare_orders
    from ..io.planner import load_cost
    from ..io.read_cost import describe_load
    from ..pack import read_manifest

    pack = Path(args.model)
    manifest = read_manifest(pack)
    first = pack / manifest.bundles[0].file
    cost = load_cost(first, args.threads, "aio") or load_cost(first, args.threads, "threads")
    data = collect_inputs(pack, args.text, max_tokens=args.max_tokens, progress=not args.quiet)
    rows = compare_orders(data, args.target_sparsity, cost=cost, progress=not args.quiet)
    total = {k: sum(r[k]["bytes"] for r in rows) for k in ("pack", "frequency", "coactivation")}
    reads = {k: sum(r[k]["reads"] for r in rows) for k in ("pack", "frequency", "coactivation")}
    needed = sum(r["pack"]["needed"] for r in rows)
    print(f"Model: {pack}  ({len(rows)} layers, {data.n_train} tokens fit the orders, "
          f"{len(next(iter(data.xs.values()))) - data.n_train} held out)")
    print(f"Cost model: {'stored read-cost profile' if cost is not None else 'none stored (touching blocks merged only)'}"
          + (f" ({describe_load(getattr(cost, 'load', None))})" if cost is not None else ""))
    print("| layer | active % | bundle bytes | pack order KB/token | frequency KB/token | co-activation KB/token | pack / co-activation |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layer']} | {100 * r['active']:.1f} | {r['stride']} | {r['pack']['bytes'] / 1024:.1f} | "
              f"{r['frequency']['bytes'] / 1024:.1f} | {r['coactivation']['bytes'] / 1024:.1f} | "
              f"{r['pack']['bytes'] / max(r['coactivation']['bytes'], 1):.2f}x |")
    print(f"| all | | | {total['pack'] / 1e6:.2f} MB | {total['frequency'] / 1e6:.2f} MB | "
          f"{total['coactivation'] / 1e6:.2f} MB | {total['pack'] / max(total['coactivation'], 1):.2f}x |")
    print(f"Needed bundle bytes per token {needed / 1e6:.2f} MB; reads per token: pack {reads['pack']:.0f}, "
          f"frequency {reads['frequency']:.0f}, co-activation {reads['coactivation']:.0f}")
    print(f"Reproduce: {getattr(args, 'command_line', 'python -m mlx_flash.bench reorder ...')}")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": getattr(args, "command_line", None), "rows": rows,
                                               "total_bytes": total, "reads": reads, "needed": needed},
                                              indent=1))
    return 0


