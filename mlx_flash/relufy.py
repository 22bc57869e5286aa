"""python -m mlx_flash.relufy: make a SwiGLU llama's FFN sparse (ReLU-family activation + fine-tuning).

    python -m mlx_flash.relufy [--model SRC] --text FILE [FILE ...] --out DIR [--steps 200]
        [--activation relu|fatrelu[:T]|cats[:T]|product[:T]|drelu] [--distill W] [--lr 5e-5] [--batch-size 1]
        [--checkpoint-every 50] [--keep-checkpoints 3] [--resume] [--max-minutes M] [--eval-text FILE ...]
        [--layerwise-tokens 8192] [--layerwise-ridge 1e-3] [--hidden-distill W] [--no-compile]
        [--sparsity-allocation uniform|sensitivity] [--allocation-tokens 512]
    python -m mlx_flash.relufy --curve DIR --eval-text FILE [FILE ...] [--markdown OUT] [--json OUT]

SRC defaults to the embedded SmolLM2-135M-Instruct. The output folder DIR is a model folder
(`relu_llama`, float32) that generate, convert, calibrate and eval accept; DIR/checkpoints holds a
loadable model every --checkpoint-every steps (the newest --keep-checkpoints of them are kept),
and --resume continues from the newest. Without --eval-text, every 10th --text file (sorted by
path) is held out for evaluation and not trained on. `--curve DIR` measures every kept checkpoint
on held-out text: perplexity (vs the original model) and FFN activation sparsity against tokens
trained.

Float32 training on Linux needs OpenBLAS preloaded (README, Linux notes):
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python -m mlx_flash.relufy ...
"""

import argparse
import sys
from pathlib import Path

from .calibration.relufication_choices import ALLOCATIONS, DECAYS, KEEP_CHECKPOINTS
from .errors import FlashError
from .paths import write_json_atomic, write_text_atomic


def build_parser():
    p = argparse.ArgumentParser(prog="python -m mlx_flash.relufy",
                                description="Swap a llama's SiLU gate for a ReLU-family activation "
                                            "and fine-tune it so its FFN activations are sparse.")
    p.add_argument("--model", default=None, help="source model (default: the embedded SmolLM2-135M)")
    p.add_argument("--text", nargs="+", metavar="FILE", help="training text files (UTF-8)")
    p.add_argument("--eval-text", nargs="+", default=None, metavar="FILE",
                   help="held-out text (default: every 10th --text file, not trained on)")
    p.add_argument("--out", default=None, help="output model folder (holds checkpoints/ too)")
    p.add_argument("--activation", default="relu",
                   help="relu (default), fatrelu:T (gate values > T kept), cats:T (SiLU kept where "
                        "|silu| > T), product:T (silu(gate) * up kept where its magnitude > T), "
                        "fatrelu / cats / product (per-layer T from --target-sparsity) or drelu")
    p.add_argument("--target-sparsity", type=float, default=None, metavar="S",
                   help="with --activation fatrelu, cats or product: each layer's threshold silences this "
                        "fraction of its hidden values on the first training sequences (e.g. 0.85)")
    p.add_argument("--sparsity-allocation", choices=ALLOCATIONS, default="uniform",
                   help="with --activation cats --target-sparsity S: every layer at S (uniform, default) or "
                        "per-layer targets averaging S, lower in the layers whose sparsity costs the original "
                        "model most (measured KL when only that layer is thresholded; about a minute)")
    p.add_argument("--allocation-tokens", type=int, default=512, metavar="N",
                   help="training tokens the sensitivity allocation measures on (default 512)")
    p.add_argument("--layerwise-tokens", type=int, default=None, metavar="N",
                   help="before end-to-end training, refit each layer's down projection in closed form "
                        "on N training tokens so the layer reproduces the original model's residual "
                        "stream (layer-wise distillation, minutes; 0: off; default 8192, and 0 with "
                        "--activation product, whose untrained swap the fit makes worse)")
    p.add_argument("--layerwise-ridge", type=float, default=1e-3, metavar="R",
                   help="ridge of the layer-wise least squares, relative to the mean hidden energy "
                        "(default 1e-3)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps in all (default 200)")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per step (default 1)")
    p.add_argument("--sequence-length", type=int, default=256, help="tokens per sequence (default 256)")
    p.add_argument("--lr", type=float, default=5e-5, help="AdamW learning rate (default 5e-5)")
    p.add_argument("--warmup", type=int, default=10, help="linear warm-up steps (default 10)")
    p.add_argument("--decay", choices=DECAYS, default="cosine",
                   help="after the warm-up: cosine decay to 10%% of --lr at --steps (default) or a constant rate")
    p.add_argument("--distill", type=float, default=0.0, metavar="W",
                   help="weight of KL(dense teacher || student) added to the LM loss (default 0: off)")
    p.add_argument("--hidden-distill", type=float, default=0.0, metavar="W",
                   help="weight of the residual streams' relative squared error against the dense "
                        "teacher's, every layer, added to the loss (default 0: off)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="mx.compile the whole training step (default on; --no-compile: eager)")
    p.add_argument("--checkpoint-every", type=int, default=50, metavar="N", help="checkpoint every N steps")
    p.add_argument("--keep-checkpoints", type=int, default=KEEP_CHECKPOINTS, metavar="N",
                   help="keep only the newest N checkpoints, older ones deleted once a newer one is "
                        f"written (default {KEEP_CHECKPOINTS}; 0: keep all; --curve measures the kept ones)")
    p.add_argument("--resume", action="store_true", help="continue from DIR's newest checkpoint")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop after this many minutes of training (checkpoint + model written)")
    p.add_argument("--max-train-tokens", type=int, default=None, help="tokenize at most this much training text")
    p.add_argument("--eval-tokens", type=int, default=4096, help="held-out tokens measured (default 4096)")
    p.add_argument("--seed", type=int, default=0, help="data order seed")
    p.add_argument("--curve", default=None, metavar="DIR",
                   help="instead of training: measure every checkpoint of the run in DIR")
    p.add_argument("--markdown", default=None, metavar="OUT", help="--curve: also write the table here")
    p.add_argument("--json", default=None, metavar="OUT", help="write the report / curve as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--verbose", action="store_true", help="show tracebacks on errors")
    return p


def _check_files(flag, files):
    for f in files:
        if not Path(f).is_file():
            raise FlashError(f"{flag} {f}: no such file")


def _main(argv):
    from .blas import preload_openblas
    from .calibration import relufication as R

    args = build_parser().parse_args(argv)
    preload_openblas(argv)  # float32 work: OpenBLAS on Linux (blas.py)
    log = (lambda *a: print(*a, file=sys.stderr, flush=True))
    if args.curve:
        if not args.eval_text:
            raise FlashError("--curve: needs --eval-text FILE ... (held-out text)")
        _check_files("--eval-text", args.eval_text)
        rows = R.curve(Path(args.curve), args.eval_text, eval_tokens=args.eval_tokens,
                       seq_len=args.sequence_length, original=args.model, progress=not args.quiet)
        table = R.format_curve(rows)
        print(table)
        if args.markdown:
            write_text_atomic(Path(args.markdown), table + "\n")
        if args.json:
            write_json_atomic(Path(args.json), rows)
        return 0
    if not args.text:
        raise FlashError("--text: training text files are required (or --curve DIR)")
    if not args.out:
        raise FlashError("--out: the output folder is required")
    _check_files("--text", args.text)
    hidden_act, _ = R.parse_activation(args.activation)
    if args.layerwise_tokens is None:
        args.layerwise_tokens = 0 if hidden_act == "product" else 8192
    for flag, value, low in (("--steps", args.steps, 1), ("--batch-size", args.batch_size, 1),
                             ("--sequence-length", args.sequence_length, 2),
                             ("--checkpoint-every", args.checkpoint_every, 0),
                             ("--keep-checkpoints", args.keep_checkpoints, 0), ("--warmup", args.warmup, 0),
                             ("--eval-tokens", args.eval_tokens, 2), ("--layerwise-tokens", args.layerwise_tokens, 0),
                             ("--allocation-tokens", args.allocation_tokens, 1)):
        if value < low:
            raise FlashError(f"{flag} {value}: must be at least {low}")
    if not args.layerwise_ridge > 0:
        raise FlashError(f"--layerwise-ridge {args.layerwise_ridge}: must be > 0")
    if not args.lr > 0 or args.distill < 0:
        raise FlashError(f"--lr {args.lr} / --distill {args.distill}: the rate must be > 0, the weight >= 0")
    if args.hidden_distill < 0:
        raise FlashError(f"--hidden-distill {args.hidden_distill}: the weight must be >= 0")
    if args.eval_text:
        _check_files("--eval-text", args.eval_text)
        train_files, eval_files = list(args.text), list(args.eval_text)
    else:
        train_files, eval_files = R.split_by_file(args.text)
        if not train_files:
            raise FlashError("--text: too few files to hold every 10th out; pass --eval-text")
    from .sources import resolve_model

    src = resolve_model(args.model)
    report = R.relufy(src, train_files, Path(args.out), activation=args.activation, steps=args.steps,
                      batch_size=args.batch_size, seq_len=args.sequence_length, lr=args.lr,
                      warmup=args.warmup, decay=args.decay, distill=args.distill,
                      hidden_distill=args.hidden_distill, compiled=args.compile,
                      allocation=args.sparsity_allocation, allocation_tokens=args.allocation_tokens,
                      checkpoint_every=args.checkpoint_every, keep_checkpoints=args.keep_checkpoints,
                      resume=args.resume, seed=args.seed, max_minutes=args.max_minutes,
                      max_train_tokens=args.max_train_tokens, eval_files=eval_files,
                      eval_tokens=args.eval_tokens, target_sparsity=args.target_sparsity,
                      layerwise_tokens=args.layerwise_tokens, layerwise_ridge=args.layerwise_ridge, progress=not args.quiet, log=log)
    after = report.get("after")
    summary = f"Wrote {args.out}: {report['steps']} steps, {report['tokens_trained']} tokens, " \
              f"{report['seconds'] / 60:.1f} min"
    if after:
        summary += f"; held-out ppl {after['ppl']:.3f}, FFN sparsity {100 * after['sparsity']:.1f}%"
        if report.get("before"):
            summary += f" (original ppl {report['before']['original']['ppl']:.3f})"
    print(summary)
    if args.json:
        write_json_atomic(Path(args.json), report)
    return 0


def main(argv=None):
    from .cli import run_cli

    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
