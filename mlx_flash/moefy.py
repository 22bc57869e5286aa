"""python -m mlx_flash.moefy: a derived MoE test model (MoEfication of a dense model).

    python -m mlx_flash.moefy [--model SRC] --text FILE [FILE ...] [--experts 16 --top-k 4]
        [--max-tokens 8192] [--eval-text FILE ...] --out DIR

Splits each FFN of SRC (default: the embedded SmolLM2-135M) into experts by co-activation on the
--text files and trains a router per layer (mlx_flash/moe/moefy.py); writes an mlx-lm `mixtral`
folder labelled as derived. --eval-text (never the training text) reports held-out perplexity of
the dense model and the MoEfied one.
"""

import argparse
import json
import sys
from pathlib import Path

from .cli import run_cli
from .errors import FlashError


def build_parser():
    p = argparse.ArgumentParser(prog="python -m mlx_flash.moefy", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="dense llama-family source (default: embedded)")
    p.add_argument("--text", nargs="+", required=True, help="training text files")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=8192, help="training tokens")
    p.add_argument("--eval-text", nargs="+", default=None, help="held-out text for perplexity")
    p.add_argument("--eval-tokens", type=int, default=4096)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verbose", action="store_true")
    return p


def _main(argv):
    from .models import load_model, load_tokenizer
    from .sources import resolve_model
    from .calibration.dense_pass import text_tokens
    from .moe.moefy import moefy
    from .moe.quality import held_out_perplexity

    args = build_parser().parse_args(argv)
    if args.eval_text and set(args.eval_text) & set(args.text):
        raise FlashError("--eval-text: held-out text must not repeat a --text file")
    src = resolve_model(args.model)
    model, config = load_model(src, lazy=False)
    tokenizer = load_tokenizer(src)
    tokens = text_tokens(args.text, tokenizer, args.max_tokens)
    report = moefy(model, config, tokens, src, args.out, experts=args.experts, top_k=args.top_k,
                   seed=args.seed, text_label=args.text)
    recalls = [r["router_recall_train"] for r in report["layers"]]
    print(f"wrote {args.out} ({report['tokens']} training tokens, {report['seconds']:.0f} s); "
          f"router top-{args.top_k} recall on training tokens: mean {sum(recalls) / len(recalls):.3f}, "
          f"min {min(recalls):.3f}")
    if args.eval_text:
        tokens = text_tokens(args.eval_text, tokenizer, args.eval_tokens, flag="--eval-text")
        moe_model, _ = load_model(Path(args.out))
        ppl = held_out_perplexity([model, moe_model], tokens)
        print(f"held-out perplexity ({ppl['tokens']} tokens): dense {ppl['ppl'][0]:.3f}, "
              f"moefied {ppl['ppl'][1]:.3f} (x{ppl['ppl'][1] / ppl['ppl'][0]:.3f})")
        report["eval"] = ppl
    Path(args.out, "moefy_report.json").write_text(json.dumps(report, indent=1))


def main(argv=None):
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
