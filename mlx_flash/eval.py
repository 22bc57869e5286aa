"""python -m mlx_flash.eval: perplexity and greedy-token agreement of a run mode against dense.

    python -m mlx_flash.eval ppl --model PACK --mode flash [--memory-budget 0.65] [--window 5]
        --text FILE [FILE ...] [--max-tokens 1024] [--sequence-length 256] [--json OUT]
    python -m mlx_flash.eval sweep --model PACK --calib-text FILE... --text FILE...
        [--target-sparsity 0.1 0.2 ...] [--rank 64] [--memory-budget 0.65] [--window 5] [--json OUT]

How the text is cut and scored, and what the sweep writes: mlx_flash/calibration/quality.py.
"""

import argparse
import json
import os
import sys
from pathlib import Path

from .calibration.fit import DEFAULTS, check_text_files, check_writable
from .calibration.quality import (DEFAULT_MAX_TOKENS, DEFAULT_SEQUENCE_LENGTH, evaluate_ppl, format_ppl,
                                  format_sweep, sweep)
from .blas import preload_openblas
from .cli import run_cli
from .config import MODES, parse_memory_budget
from .errors import FlashError
from .paths import write_json_atomic, write_text_atomic
from .sparse.predictor import KINDS


def _common(p):
    p.add_argument("--model", required=True, help="a flash pack (python -m mlx_flash.convert --out PACK)")
    p.add_argument("--text", nargs="+", required=True, metavar="FILE", help="evaluation text files (UTF-8)")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help=f"evaluate at most this many tokens (default {DEFAULT_MAX_TOKENS})")
    p.add_argument("--sequence-length", type=int, default=DEFAULT_SEQUENCE_LENGTH,
                   help=f"tokens per sequence, each with a fresh KV cache (default {DEFAULT_SEQUENCE_LENGTH})")
    p.add_argument("--memory-budget", default=None,
                   help="fraction of the pack (0.65) or size (6GB) for weights (default: no limit; "
                        "sweep: 0.65)")
    p.add_argument("--window", type=int, default=5, help="flash: neuron-cache window in tokens (default 5)")
    p.add_argument("--threads", type=int, default=32, help="parallel flash reads (default 32)")
    p.add_argument("--json", default=None, metavar="OUT", help="also write the results as JSON ('-' = stdout)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--verbose", action="store_true", help="show tracebacks on errors")


def build_parser():
    parser = argparse.ArgumentParser(prog="python -m mlx_flash.eval",
                                     description="Perplexity and greedy agreement against dense.")
    sub = parser.add_subparsers(dest="command", required=True)
    ppl = sub.add_parser("ppl", help="perplexity of one mode vs dense on the same text")
    _common(ppl)
    ppl.add_argument("--mode", choices=MODES, default="flash", help="run mode to evaluate (default flash)")
    ppl.add_argument("--source", default=None, metavar="MODEL",
                     help="also the perplexity of the model the pack was converted from (a .gguf file "
                          "or model folder) on the same text: is the pack's dense model the source's?")
    ppl.add_argument("--all-sparse", action="store_true",
                     help="flash: run every layer with its predictor and neuron cache instead of the "
                          "per-layer memory plan (measures the predictors' effect on quality)")
    sw = sub.add_parser("sweep", help="calibrate at several target sparsities, evaluate each in flash mode")
    _common(sw)
    sw.add_argument("--calib-text", nargs="+", required=True, metavar="FILE",
                    help="calibration text files (must not overlap --text)")
    sw.add_argument("--calib-tokens", type=int, default=16384, help="calibration tokens (default 16384)")
    sw.add_argument("--target-sparsity", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.4, 0.5],
                    help="target sparsities to calibrate (default 0.1 0.2 0.3 0.4 0.5)")
    sw.add_argument("--kind", choices=KINDS, default=None, help="predictor kind (calibrate's default)")
    sw.add_argument("--rank", type=int, default=None, help=f"predictor rank (default {DEFAULTS['rank']})")
    sw.add_argument("--recall", type=float, default=None,
                    help=f"low-rank-gate target recall (default {DEFAULTS['recall']})")
    sw.add_argument("--threshold", type=float, default=None, help="low-rank sigmoid cutoff")
    sw.add_argument("--markdown", default=None, metavar="OUT", help="write the curve as a markdown table")
    return parser


def _write_json(dest, obj):
    if dest == "-":
        print(json.dumps(obj, indent=1))
        return
    write_json_atomic(Path(dest), obj)


def _main(argv):
    args = build_parser().parse_args(argv)
    preload_openblas(argv)  # float32 work: OpenBLAS on Linux (blas.py)
    if args.max_tokens < 2:
        raise FlashError(f"--max-tokens {args.max_tokens}: must be at least 2")
    # everything that can be checked before minutes of model passes
    check_text_files(args.text)
    if args.command == "sweep":
        check_text_files(args.calib_text)
    for flag, dest in (("--json", args.json), ("--markdown", getattr(args, "markdown", None))):
        if dest and dest != "-":
            parent = Path(dest).expanduser().parent
            if not parent.is_dir():
                raise FlashError(f"{flag} {dest}: no folder {parent}")
            check_writable(parent, flag)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    progress = not args.quiet
    budget = parse_memory_budget(args.memory_budget, "--memory-budget")
    if args.command == "ppl":
        r = evaluate_ppl(args.model, args.text, mode=args.mode, memory_budget=budget,
                         window=args.window, threads=args.threads, max_tokens=args.max_tokens,
                         seq_len=args.sequence_length, progress=progress, all_sparse=args.all_sparse,
                         source=args.source)
        print(format_ppl(r))
        if args.json:
            _write_json(args.json, r)
        return 0
    budget = budget or parse_memory_budget(0.65, "--memory-budget")
    rows = sweep(args.model, args.calib_text, args.text, target_sparsities=args.target_sparsity,
                 memory_budget=budget, window=args.window, threads=args.threads,
                 max_tokens=args.max_tokens, seq_len=args.sequence_length,
                 calib_tokens=args.calib_tokens, progress=progress, kind=args.kind, rank=args.rank,
                 recall=args.recall, threshold=args.threshold)
    table = format_sweep(rows)
    print(table)
    if args.markdown:
        write_text_atomic(Path(args.markdown), table + "\n")
    if args.json:
        _write_json(args.json, rows)
    return 0


def main(argv=None):
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
