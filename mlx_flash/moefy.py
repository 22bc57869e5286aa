"""python -m mlx_flash.moefy: a derived MoE test model (MoEfication of a dense model).

    python -m mlx_flash.moefy [--model SRC] --text FILE [FILE ...] [--experts 16 --top-k 4]
        [--max-tokens 8192] [--eval-text FILE ...] --out DIR
        [--finetune-steps N --finetune-text FILE ... [--finetune-train experts|routers|both] ...]

Splits each FFN of SRC (default: the embedded SmolLM2-135M) into experts by co-activation on the
--text files and trains a router per layer (mlx_flash/moe/moefy.py); writes an mlx-lm `mixtral`
folder labelled as derived. --eval-text (never the training text) reports held-out perplexity of
the dense model and the MoEfied one.

--finetune-steps N then distills the MoE from SRC end to end (calibration/moe_finetune.py) on
--finetune-text: the split model is kept in OUT/untuned, checkpoints go to OUT/checkpoints, the
tuned model to OUT. --from-moefied DIR fine-tunes an existing moefy folder instead of splitting
again; --resume continues OUT's newest checkpoint.
"""

import argparse
import sys
from pathlib import Path

from .blas import preload_openblas
from .cli import run_cli
from .errors import FlashError
from .paths import write_json_atomic


def build_parser():
    p = argparse.ArgumentParser(prog="python -m mlx_flash.moefy", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="dense llama-family source (default: embedded)")
    p.add_argument("--text", nargs="+", default=None,
                   help="text the split and the routers are fitted on (not with --from-moefied / --resume)")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=None,
                   help="experts per token (default 4; with --from-moefied: that model's, or it is "
                        "re-routed to this many before the fine-tune)")
    p.add_argument("--max-tokens", type=int, default=8192, help="training tokens")
    p.add_argument("--eval-text", nargs="+", default=None, help="held-out text for perplexity")
    p.add_argument("--eval-tokens", type=int, default=4096)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verbose", action="store_true")
    f = p.add_argument_group("end-to-end fine-tune (distillation from SRC)")
    f.add_argument("--finetune-steps", type=int, default=0, metavar="N", help="AdamW steps (0: none)")
    f.add_argument("--finetune-text", nargs="+", default=None, metavar="FILE",
                   help="training text (never --eval-text)")
    f.add_argument("--finetune-eval-text", nargs="+", default=None, metavar="FILE",
                   help="validation text: perplexity before training and at every checkpoint")
    f.add_argument("--finetune-tokens", type=int, default=262144,
                   help="training tokens at most (the files shuffled by --seed first)")
    f.add_argument("--finetune-train", choices=("routers", "experts", "both"), default="experts",
                   help="what trains: the routers, the experts' weights, or both")
    f.add_argument("--finetune-lr", type=float, default=1e-4, help="peak AdamW learning rate")
    f.add_argument("--finetune-warmup", type=int, default=10, help="linear warm-up steps")
    f.add_argument("--finetune-decay", choices=("constant", "cosine"), default="constant")
    f.add_argument("--finetune-batch-size", type=int, default=1, help="sequences of 256 tokens per step")
    f.add_argument("--finetune-ce", type=float, default=0.0,
                   help="weight of the next-token cross-entropy added to the KL to SRC")
    f.add_argument("--checkpoint-every", type=int, default=50)
    f.add_argument("--keep-checkpoints", type=int, default=2, help="newest checkpoints kept (0: all)")
    f.add_argument("--max-minutes", type=float, default=None, help="stop the fine-tune after this")
    f.add_argument("--from-moefied", default=None, metavar="DIR",
                   help="fine-tune this moefy folder instead of splitting SRC again")
    f.add_argument("--resume", action="store_true", help="continue OUT's newest fine-tune checkpoint")
    return p


def _check(args):
    finetune = args.finetune_steps > 0
    if (args.from_moefied or args.resume) and not finetune:
        raise FlashError("--from-moefied / --resume: need --finetune-steps")
    if not (args.from_moefied or args.resume) and not args.text:
        raise FlashError("--text: required (the text the experts are split on)")
    if finetune and not args.finetune_text:
        raise FlashError("--finetune-text: required with --finetune-steps")
    checks = [("--eval-text", args.eval_text, "--text", args.text),
              ("--eval-text", args.eval_text, "--finetune-text", args.finetune_text),
              ("--finetune-eval-text", args.finetune_eval_text, "--finetune-text", args.finetune_text)]
    for held_flag, held, flag, files in checks:
        if held and files and set(held) & set(files):
            raise FlashError(f"{held_flag}: held-out text must not repeat a {flag} file")
    if args.from_moefied and not Path(args.from_moefied, "config.json").is_file():
        raise FlashError(f"--from-moefied {args.from_moefied}: no config.json (not a moefy folder)")


def _main(argv):
    from .models import load_model, load_tokenizer
    from .sources import resolve_model
    from .calibration.dense_pass import text_tokens
    from .moe.moefy import moefy
    from .moe.quality import held_out_perplexity

    args = build_parser().parse_args(argv)
    preload_openblas(argv)  # float32 work: OpenBLAS on Linux (blas.py)
    _check(args)
    src = resolve_model(args.model)
    out = Path(args.out)
    finetune = args.finetune_steps > 0
    split_dir = out / "untuned" if finetune else out
    start = Path(args.from_moefied) if args.from_moefied else split_dir
    report = {}
    if not (args.from_moefied or args.resume):
        model, config = load_model(src, lazy=False)
        tokenizer = load_tokenizer(src)
        tokens = text_tokens(args.text, tokenizer, args.max_tokens)
        report = moefy(model, config, tokens, src, split_dir, experts=args.experts, top_k=args.top_k or 4,
                       seed=args.seed, text_label=args.text)
        recalls = [r["router_recall_train"] for r in report["layers"]]
        print(f"wrote {split_dir} ({report['tokens']} training tokens, {report['seconds']:.0f} s); "
              f"router top-{args.top_k or 4} recall on training tokens: mean {sum(recalls) / len(recalls):.3f}, "
              f"min {min(recalls):.3f}")
        del model
    if finetune:
        from .calibration.moe_finetune import finetune_moe

        report["finetune"] = finetune_moe(
            start, src, args.finetune_text, out, steps=args.finetune_steps,
            trainable=args.finetune_train, lr=args.finetune_lr, warmup=args.finetune_warmup,
            decay=args.finetune_decay, batch_size=args.finetune_batch_size, ce_weight=args.finetune_ce,
            max_train_tokens=args.finetune_tokens, checkpoint_every=args.checkpoint_every,
            keep_checkpoints=args.keep_checkpoints, resume=args.resume, max_minutes=args.max_minutes,
            eval_files=args.finetune_eval_text or (), seed=args.seed, top_k=args.top_k,
            progress=not args.verbose)
        print(f"wrote {out} (fine-tuned {report['finetune']['steps']} steps, "
              f"{report['finetune']['tokens_trained']} tokens, {report['finetune']['seconds'] / 60:.1f} min)")
    if args.eval_text:
        import mlx.core as mx
        from mlx_lm.utils import dequantize_model

        tokenizer = load_tokenizer(out)
        tokens = text_tokens(args.eval_text, tokenizer, args.eval_tokens, flag="--eval-text")
        dense = dequantize_model(load_model(src, lazy=False)[0])  # as moefy split it
        dense.set_dtype(mx.float32)
        names = ["dense", "moefied"] if not finetune else ["dense", "untuned", "fine-tuned"]
        folders = [out] if not finetune else [start, out]
        ppl = held_out_perplexity([dense] + [load_model(f)[0] for f in folders], tokens)
        print(f"held-out perplexity ({ppl['tokens']} tokens): " + ", ".join(
            f"{n} {v:.3f}" + ("" if i == 0 else f" (x{v / ppl['ppl'][0]:.3f})")
            for i, (n, v) in enumerate(zip(names, ppl["ppl"]))))
        report["eval"] = ppl
    if report:
        write_json_atomic(Path(out, "moefy_report.json"), report)


def main(argv=None):
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
