"""python -m mlx_flash.calibrate: activation predictors for a flash pack, from calibration text.

    python -m mlx_flash.calibrate --model PACK --text FILE [FILE ...] [--kind KIND]
        [--target-sparsity T] [--rank R] [--rank-per-layer 26-29:256] [--recall 0.99]
        [--threshold 0.5] [--max-tokens N] [--reorder]

Runs the pack's model dense (float32) over the text, records every layer's FFN input x (the
normalised attention output), then per layer:
  * threshold t: for gated (SwiGLU) models the |act(gate x)| value below which --target-sparsity
    of the calibration activations lie (CATS); ReLU models use t = 0 (their natural sparsity); a
    relu_llama relufied with CATS uses its own trained per-layer thresholds; one relufied with the
    product threshold (relufy --activation product) thresholds |silu(gate x) * up x| by its own;
  * predictor (--kind), fitted on the first 90% of the tokens:
      "low-rank-gate" (gated default): B (A x) + bias, the best rank-r estimate of gate x on the
        calibration inputs (PCA of the gate pre-activations); mask = |act(estimate)| > cut, the
        cut set per layer so --recall of the thresholded model's active neurons are kept;
      "low-rank" (ReLU default, the paper's): sigmoid(B A x + bias) > --threshold, trained with
        the balanced loss (positives and negatives weighted equally);
      "quant-gate": as low-rank-gate, the estimate a --gate-bits quantized copy of the gate;
      "quant-glu" (product-threshold default): |act(g) * u| > cut, g and u --gate-bits copies
        of the gate and up (g the model's own gate x on a pack with a resident gate, convert
        --gate-bits), the cut set for --recall likewise;
      "gate-threshold" (resident gate, exact), "exact-relu" (resident up, exact), "all" (off);
  * stats on the held-out 10% like the paper's appendix B: fraction of neurons active in the
    thresholded model, predicted, both; recall = both / active; over-prediction = predicted / active;
  * capacity Req_i for windows 1..--max-window tokens (99th percentile of the predicted union).
and writes predictors.json + predictors.safetensors into the pack (sparse/predictor.py), each
atomically. --reorder first permutes each layer's neurons on disk so that neurons active on the same
calibration tokens share read blocks (calibration/reorder.py; logits unchanged), then fits. The low-rank classifier cannot express |act(g)| > t for silu/gelu (true on both lobes
of the activation), which is why gated models default to the gate estimate.
"""

import argparse
import sys

from .calibration.dense_pass import MAX_WINDOW, MIN_TOKENS, collect_inputs
from .calibration.fit import DEFAULTS, GATE_BITS, GATE_GROUP_SIZE, fit_predictors, preflight, resolve_settings
from .blas import preload_openblas
from .cli import run_cli
from .errors import FlashError
from .sparse.predictor import KINDS


def build_parser():
    parser = argparse.ArgumentParser(
        prog="python -m mlx_flash.calibrate",
        description="Calibrate activation predictors for a flash pack from text and store them in "
                    "the pack (predictors.json, predictors.safetensors).")
    parser.add_argument("--model", required=True, help="the flash pack (python -m mlx_flash.convert --out PACK)")
    parser.add_argument("--text", nargs="+", required=True, metavar="FILE",
                        help="calibration text files (UTF-8)")
    parser.add_argument("--kind", choices=KINDS, default=None,
                        help="predictor: low-rank-gate (default for gated models: rank-r estimate of "
                             "the gate, which streams with the bundle), low-rank (default otherwise: "
                             "the paper's classifier), quant-gate (a --gate-bits copy of the gate "
                             "estimates it), quant-glu (product-threshold models' default: copies of "
                             "the gate and up; of up alone beside a resident gate), gate-threshold (resident gate, exact), "
                             "exact-relu (ReLU models, resident up, exact), all (sparsity off)")
    parser.add_argument("--target-sparsity", type=float, default=None,
                        help="gated models: fraction of |act(gate x)| thresholded to zero "
                             f"(default {DEFAULTS['target_sparsity']}); ReLU and FATReLU models: their "
                             "natural sparsity (default 0); CATS models: their own thresholds (refused)")
    parser.add_argument("--rank", type=int, default=None,
                        help=f"low-rank predictor rank (default {DEFAULTS['rank']})")
    parser.add_argument("--rank-per-layer", default=None, metavar="LAYERS:RANK[,...]",
                        help="ranks for chosen layers, e.g. 26-29:256")
    parser.add_argument("--threshold", type=float, default=None,
                        help=f"low-rank sigmoid cutoff (default {DEFAULTS['threshold']}; higher "
                             "loads fewer neurons)")
    parser.add_argument("--recall", type=float, default=None,
                        help="low-rank-gate: fraction of the thresholded model's active neurons the "
                             f"predictor must keep on the calibration text (default {DEFAULTS['recall']})")
    parser.add_argument("--gate-bits", type=int, default=None, choices=GATE_BITS,
                        help="quant-gate / quant-glu: bits of the predictor's quantized gate (and up) copy, group size "
                             f"{GATE_GROUP_SIZE} (default {DEFAULTS['gate_bits']})")
    parser.add_argument("--epochs", type=int, default=None,
                        help=f"low-rank training epochs (default {DEFAULTS['epochs']})")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="use at most this many calibration tokens (default: all)")
    parser.add_argument("--max-window", type=int, default=MAX_WINDOW,
                        help=f"measure neuron-cache capacity for windows 1..N (default {MAX_WINDOW})")
    parser.add_argument("--seed", type=int, default=0, help="training seed")
    parser.add_argument("--reorder", action="store_true",
                        help="first permute each layer's neurons on disk by co-activation on the "
                             "calibration text (fewer read blocks per token; same logits)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars or table")
    parser.add_argument("--verbose", action="store_true", help="show tracebacks on errors")
    return parser


def _main(argv):
    args = build_parser().parse_args(argv)
    preload_openblas(argv)  # float32 work: OpenBLAS on Linux (blas.py)
    if args.max_tokens is not None and args.max_tokens < MIN_TOKENS:
        raise FlashError(f"--max-tokens {args.max_tokens}: need at least {MIN_TOKENS}")
    settings = dict(kind=args.kind, target_sparsity=args.target_sparsity, rank=args.rank,
                    rank_per_layer=args.rank_per_layer, threshold=args.threshold, recall=args.recall,
                    epochs=args.epochs, max_window=args.max_window, gate_bits=args.gate_bits)
    progress = not args.quiet
    preflight(args.model, args.text, **settings)  # minutes of dense pass follow: fail first
    data = collect_inputs(args.model, args.text, max_tokens=args.max_tokens, max_window=args.max_window,
                          progress=progress)
    if args.reorder:
        from .calibration.reorder import layer_orders, reorder_neurons

        orders = layer_orders(data, resolve_settings(data, **settings)["target_sparsity"], progress)
        reorder_neurons(data, orders)
        if progress:
            print(f"Reordered the neurons of {len(orders)} layers by co-activation", flush=True)
    say = (lambda *a: print(*a, flush=True)) if progress else None
    fit_predictors(data, seed=args.seed, progress=progress, say=say, **settings)
    return 0


def main(argv=None):
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
