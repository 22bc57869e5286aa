"""Bytes read per token at the same active neurons under four neuron orders of a pack's layers:
the pack's own, by activation frequency, by co-activation (calibration/reorder.py) and a
nearest-neighbour chain of neurons active on the same tokens (sparse/neuron_order.chain_order).

    python -m mlx_flash.bench reorder --model PACK --text FILE [FILE ...] [--max-tokens 4096]
        [--target-sparsity T] [--json OUT]

One dense pass over the text (as calibrate runs it) gives each layer's active neurons per token
(the thresholded model: |act| > t; ReLU-family models t = 0). The orders are fitted on the first
90% of the tokens; on the held-out 10%, each token's active neurons are read as the flash loader
plans it (aligned blocks, merged by this machine's stored read-cost model when there is one, else
only touching blocks merged) and the bytes are counted, and with a stored cost model priced as
the memory plan prices a loader call (ms per token). Same neurons, different order: the ratio is
what `calibrate --reorder` saves in bytes read per token. Nothing is read from disk here.
"""

from pathlib import Path

from ..paths import write_json_atomic


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
    from ..io.planner import load_cost, profile_file
    from ..io.read_cost import describe_profile
    from ..pack import read_manifest

    pack = Path(args.model)
    manifest = read_manifest(pack)
    first = pack / manifest.bundles[0].file
    cost = load_cost(first, args.threads, "aio") or load_cost(first, args.threads, "threads")
    data = collect_inputs(pack, args.text, max_tokens=args.max_tokens, progress=not args.quiet)
    rows = compare_orders(data, args.target_sparsity, cost=cost, progress=not args.quiet)
    names = {"pack": "pack order", "frequency": "frequency", "coactivation": "co-activation", "chain": "chain"}
    total = {k: sum(r[k]["bytes"] for r in rows) for k in names}
    reads = {k: sum(r[k]["reads"] for r in rows) for k in names}
    priced = cost is not None
    seconds = {k: sum(r[k]["seconds"] for r in rows) for k in names} if priced else None
    needed = sum(r["pack"]["needed"] for r in rows)
    print(f"Model: {pack}  ({len(rows)} layers, {data.n_train} tokens fit the orders, "
          f"{len(next(iter(data.xs.values()))) - data.n_train} held out)")
    print("Cost model: " + (describe_profile(cost, profile_file()) if cost is not None
                            else "none stored (touching blocks merged only)"))
    unit = " KB/token" + (" (ms)" if priced else "")
    print("| layer | active % | bundle bytes | " + " | ".join(n + unit for n in names.values())
          + " | pack / co-activation | pack / chain |")
    print("|---|---|---|" + "---|" * (len(names) + 2))

    def cell(r, k):
        return f"{r[k]['bytes'] / 1024:.1f}" + (f" ({1e3 * r[k]['seconds']:.3f})" if priced else "")

    for r in rows:
        print(f"| {r['layer']} | {100 * r['active']:.1f} | {r['stride']} | " + " | ".join(cell(r, k) for k in names)
              + f" | {r['pack']['bytes'] / max(r['coactivation']['bytes'], 1):.2f}x"
              + f" | {r['pack']['bytes'] / max(r['chain']['bytes'], 1):.2f}x |")
    print("| all | | | " + " | ".join(f"{total[k] / 1e6:.2f} MB" + (f" ({1e3 * seconds[k]:.2f} ms)" if priced else "")
                                     for k in names)
          + f" | {total['pack'] / max(total['coactivation'], 1):.2f}x | {total['pack'] / max(total['chain'], 1):.2f}x |")
    print(f"Needed bundle bytes per token {needed / 1e6:.2f} MB; reads per token: "
          + ", ".join(f"{names[k]} {reads[k]:.0f}" for k in names)
          + ("; ms: the read time each order's reads are priced at, one loader call per layer and token"
             if priced else ""))
    print(f"Reproduce: {getattr(args, 'command_line', 'python -m mlx_flash.bench reorder ...')}")
    if args.json:
        write_json_atomic(args.json, {"command": getattr(args, "command_line", None), "rows": rows,
                                      "total_bytes": total, "reads": reads, "needed": needed,
                                      "seconds": seconds})
    return 0


