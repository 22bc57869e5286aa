"""python -m mlx_flash.prune: unstructured pruning (Wanda or magnitude) -> an mlx-lm model folder.

    python -m mlx_flash.prune [--model SRC] --method wanda|magnitude --sparsity 0.5
        [--text FILES] [--eval-text FILES] [--layers ffn,attn] --out DIR

Prunes every selected linear layer (default: FFN and attention projections; never embeddings,
norms or the output head) to --sparsity zeros per output row, saves the result in float16, and
prints the perplexity of the pruned and the dense model on held-out text (--eval-text, default
documentation shipped on this machine, never the calibration files). The folder works with
generate, convert (add --encoding endor to store the zeros as a bitmap) and eval.
"""

import argparse
import sys
import time
from pathlib import Path

from .blas import preload_openblas
from .cli import run_cli
from .errors import FlashError


def _main(argv):
    from .endor.prune import DEFAULT_LAYERS, METHODS, check_args

    parser = argparse.ArgumentParser(prog="python -m mlx_flash.prune", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None,
                        help="source model (folder, GGUF, hub id); default the embedded model")
    parser.add_argument("--method", choices=METHODS, default="wanda")
    parser.add_argument("--sparsity", type=float, required=True,
                        help="fraction of each selected row set to zero, in (0, 1)")
    parser.add_argument("--layers", default=",".join(DEFAULT_LAYERS),
                        help="comma-separated: ffn, attn, or projection names such as q_proj, up_proj")
    parser.add_argument("--text", nargs="+", default=None,
                        help="Wanda calibration text files (default: documentation on this machine)")
    parser.add_argument("--eval-text", nargs="+", default=None,
                        help="held-out text for the perplexity report (default: other shipped docs)")
    parser.add_argument("--max-tokens", type=int, default=4096, help="calibration tokens (default 4096)")
    parser.add_argument("--eval-tokens", type=int, default=2048, help="held-out tokens (default 2048)")
    parser.add_argument("--no-eval", action="store_true", help="skip the perplexity report")
    parser.add_argument("--out", required=True, help="output model folder (must not exist)")
    parser.add_argument("--verbose", action="store_true", help="show tracebacks on errors")
    args = parser.parse_args(argv)
    preload_openblas(argv)  # float32 work: OpenBLAS on Linux (blas.py)
    check_args(args.method, args.sparsity)
    out = Path(args.out).expanduser()
    if out.exists():
        raise FlashError(f"--out {out}: already exists; remove it or choose another path")
    layers = [s.strip() for s in args.layers.split(",") if s.strip()]
    if not layers:
        raise FlashError("--layers: empty")

    from .calibration.prune import default_texts, held_out_perplexity, prune, write_model_folder
    from .sources import resolve_model

    calib = args.text
    held = args.eval_text
    if not args.no_eval and held is None:
        held = default_texts()[1]
    if calib and held:
        same = {Path(f).resolve() for f in calib} & {Path(f).resolve() for f in held}
        if same:
            raise FlashError(f"--eval-text {sorted(same)[0]}: also a calibration file; held-out text "
                             "must not be the calibration text")
    src = resolve_model(args.model)
    t0 = time.perf_counter()
    say = lambda m: print(m, file=sys.stderr)  # noqa: E731
    config, weights, dense_model, paths = prune(
        src, method=args.method, sparsity=args.sparsity, layers=layers, text_files=calib,
        max_tokens=args.max_tokens, say=say)
    info = {"method": args.method, "sparsity": args.sparsity, "layers": layers,
            "linears": len(paths), "source": str(src)}
    write_model_folder(src, out, config, weights, info)
    say(f"Wrote {out} ({time.perf_counter() - t0:.0f} s)")
    if not args.no_eval:
        from .models import load_tokenizer

        tokenizer = load_tokenizer(src)
        r = held_out_perplexity(dense_model, weights, tokenizer, held, max_tokens=args.eval_tokens)
        print(f"perplexity on {r['tokens']} held-out tokens ({len(held)} file(s), e.g. {held[0]}): "
              f"dense {r['dense_ppl']:.3f} ± {r['dense_ppl_se']:.3f}, pruned ({args.method} "
              f"{args.sparsity:.0%}) {r['pruned_ppl']:.3f} ± {r['pruned_ppl_se']:.3f} "
              f"(x{r['ratio']:.3f})")
    return 0


def main(argv=None):
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
