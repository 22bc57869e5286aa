"""python -m mlx_flash.convert: any model source -> flash pack (default) or mlx-lm folder.

Sources are whatever `--model` accepts elsewhere: an mlx-lm / Hugging Face folder, a hub repo id,
or a GGUF file. Output is written to a temporary folder beside `--out` and renamed into place at the end, so an
interrupted or failed conversion leaves nothing half-written.
"""

import argparse
import sys
from pathlib import Path

import numpy as np

from .blas import preload_openblas
from .calibration.expert_bits import EXPERT_BITS_CALIB_TOKENS
from .calibration.synthetic import write_synthetic_pack
from .cli import run_cli
from .errors import FlashError
from .moe.bitwidths import SOLVERS, WIDTHS
from .moe.quantize import METHODS
from .pack import read_manifest, write_pack
from .pack.writer import check_resident_modules
from .sources import convert_gguf, default_gguf_path, is_gguf, resolve_model


def down_report(down: dict) -> str:
    """One line: how the pack stores the source's quantized down projection, and its measured error."""
    err = (f"max |dw| {down['max_abs_error']:.3g}, relative RMS error "
           f"{100 * down['relative_rms_error']:.3g}% vs the source's weights")
    if down["lossy"]:
        return (f"down projection: {down['storage']}: {err}; the pack is NOT the source model "
                f"(--down-bits 16, the default, keeps it)")
    return f"down projection: {down['storage']}: {err}"


def _calibrate_moe(model_dir, args) -> tuple:
    """({layer: [bits per expert]} or None, routing statistics, the pack writer's expert quantizer
    or None) measured on --calib-text (calibration/expert_bits.py)."""
    from collections import Counter

    from .calibration.dense_pass import text_tokens
    from .calibration.expert_bits import (fewest_bits_within, measure_errors, routing_statistics,
                                          stored_quantizer, switch_glus)
    from .models import load_model, load_tokenizer
    from .moe.bitwidths import assign_widths, mean_bits

    widths = tuple(sorted(set(args.expert_widths or WIDTHS)))
    if args.expert_bits is not None and not widths[0] <= args.expert_bits <= widths[-1]:
        raise FlashError(f"--expert-bits {args.expert_bits:g}: must be within {widths[0]}..{widths[-1]}")
    model, config = load_model(model_dir, lazy=False)
    found = switch_glus(model)
    if not found:
        raise FlashError(f"--calib-text: only for MoE models ({model_dir} has no mlx-lm SwitchGLU)")
    # tokenized once; calibration, tuning and the validation split each take their slice
    counts = (args.calib_tokens, args.expert_tune_tokens) if args.expert_tune else (args.calib_tokens,)
    all_tokens = text_tokens(args.calib_text, load_tokenizer(model_dir),
                             None if args.expert_tune_val_tokens else max(counts), flag="--calib-text")
    tokens = all_tokens[: args.calib_tokens]
    bits = quantizer = windows = None
    tolerance = args.expert_bits_tolerance
    if args.expert_tune_val_tokens:  # before the minutes of measuring: refuse too short a text now
        windows = _validation_windows(all_tokens, args)
    if args.expert_bits is not None or tolerance is not None:
        group_size = args.group_size or 64
        quantized = {}
        errors = measure_errors(model, tokens, group_size, widths, method=args.expert_quantizer,
                                quantized=quantized)
        if args.expert_importance.startswith("layer-loss"):
            errors = _layer_loss_errors(model, tokens, errors, quantized, widths, group_size, args)
        if tolerance is not None:
            found_bits = fewest_bits_within(model, tokens, errors, tolerance, group_size, widths,
                                            quantized or None, solver=args.expert_assign)
            bits = found_bits["bits"]
            print(f"--expert-bits-tolerance {tolerance:g}%: calibration perplexity "
                  f"+{found_bits['ppl_increase_pct']:.2f}% vs float experts at a mean of "
                  f"{found_bits['mean_bits']:.3f} bits", file=sys.stderr)
        else:
            bits = assign_widths(errors, args.expert_bits, widths=widths, solver=args.expert_assign)
        if args.expert_tune:
            quantized = _tune_experts(model_dir, model, quantized, bits, group_size, args,
                                      all_tokens[: args.expert_tune_tokens], windows)
        elif windows:
            _score_rounded(model_dir, quantized, bits, group_size, args, windows)
        quantizer = stored_quantizer(quantized) if quantized else None
        # scales and biases are stored in the experts' float dtype (--dtype's when given)
        itemsize = ({"float32": 4, "float16": 2, "bfloat16": 2}.get(args.dtype)
                    or next(iter(found.values()))[2].up_proj.weight.dtype.size)
        counts = Counter(b for widths_ in bits.values() for b in widths_)
        print(f"expert bits on {len(tokens)} calibration tokens ({args.expert_quantizer}): mean "
              f"{mean_bits(bits):.3f} (+{16 * itemsize / group_size:.2f} for scales and biases); "
              f"experts per width " + ", ".join(f"{b}-bit {counts[b]}" for b in sorted(counts)),
              file=sys.stderr)
    n_experts = next(iter(found.values()))[2].up_proj.weight.shape[0]
    k = config.get("num_experts_per_tok")
    if not k:
        raise FlashError(f"{model_dir}/config.json: no num_experts_per_tok")
    return bits, routing_statistics(model, tokens, int(k), n_experts), quantizer


def _layer_loss_errors(model, tokens, errors, quantized, widths, group_size, args) -> dict:
    """`errors` rescaled per layer and width to the measured loss (calibration/expert_bits.py
    layer_losses), printed per layer."""
    import time

    from .calibration.expert_bits import layer_losses, scale_by_layer_loss

    t0 = time.perf_counter()
    # the narrowest width only: one pass per layer (the loss is largest there; all widths: 4x)
    frozen = args.expert_importance == "layer-loss-frozen"
    losses = layer_losses(model, tokens[: args.expert_importance_tokens + 1], quantized or None,
                          widths[:1], group_size, frozen_routing=frozen)
    print(f"--expert-importance {args.expert_importance}: KL from the float model (nats/token) "
          f"when one layer's experts are at {widths[0]} bits"
          f"{' with routing frozen' if frozen else ''}, "
          f"{time.perf_counter() - t0:.0f} s:", file=sys.stderr)
    for layer, row in losses.items():
        print(f"  layer {layer}: " + " ".join(f"{v:.4f}" for v in row), file=sys.stderr)
    return scale_by_layer_loss(errors, losses)


def _validation_windows(tokens, args) -> list:
    """--expert-tune-val-tokens' windows: the --calib-text `tokens` (all of them) after the
    tuning range."""
    from .calibration.expert_tune import validation_windows

    return validation_windows(tokens, min(len(tokens), args.expert_tune_tokens),
                              args.expert_tune_val_tokens)


def _packed_resident(model_dir, args):
    """The model with its non-expert weights as the pack holds them (--quantize's rounding)."""
    from .calibration.expert_tune import quantize_resident
    from .models import load_model

    model, _ = load_model(model_dir, lazy=False)
    if args.quantize:
        quantize_resident(model, args.quantize, args.group_size or 64)
    return model


def _score_rounded(model_dir, quantized, bits, group_size, args, windows) -> None:
    """--expert-tune-val-tokens without --expert-tune: the rounded experts' validation
    perplexity, as --expert-tune scores its step 0."""
    from .calibration.expert_tune import windows_perplexity

    ppl = windows_perplexity(_packed_resident(model_dir, args), quantized, bits, group_size, windows)
    print(f"--expert-tune-val-tokens {args.expert_tune_val_tokens}: validation perplexity "
          f"{ppl:.3f} ({len(windows)} windows of 256 after the first {args.expert_tune_tokens} "
          f"--calib-text tokens; experts rounded, not tuned)", file=sys.stderr)


def _tune_experts(model_dir, teacher, quantized, bits, group_size, args, tokens,
                  windows=None) -> dict:
    """`quantized` with each expert's scales/biases at its width tuned end to end against the
    float model on `tokens` (the first --expert-tune-tokens of --calib-text;
    calibration/expert_tune.py); with validation `windows`, the checkpoint that scores best on
    them."""
    from .calibration.expert_tune import tune_expert_scales, tune_keeping_best

    student = _packed_resident(model_dir, args)
    kw = dict(steps=args.expert_tune, group_size=group_size, lr=args.expert_tune_lr,
              lr_by_width=args.expert_tune_lr_width, integer_lr=args.expert_tune_int_lr)
    if windows:
        judge = _packed_resident(model_dir, args)
        out = tune_keeping_best(student, teacher, judge, quantized, bits, tokens, windows,
                                checkpoint_every=args.expert_tune_every,
                                on_score=lambda n, p: print(f"--expert-tune step {n}: validation "
                                                            f"perplexity {p:.3f}", file=sys.stderr,
                                                            flush=True), **kw)
        print(f"--expert-tune-val-tokens {args.expert_tune_val_tokens}: validation perplexity "
              f"({len(windows)} windows of 256 after the first {len(tokens)} --calib-text tokens) "
              f"at steps " + ", ".join(f"{n}: {p:.3f}" for n, p in out["validation"])
              + f"; the pack keeps step {out['best_steps']}", file=sys.stderr)
    else:
        out = tune_expert_scales(student, teacher, quantized, bits, tokens, **kw)
    head, tail = (float(np.mean(out["kl"][s])) for s in (slice(0, 10), slice(-10, None)))
    rates = "".join(f", learning rate x{f:g} at {b} bits"
                    for b, f in sorted(out["lr_by_width"].items()))
    print(f"--expert-tune {args.expert_tune}: KL from the float model {head:.4f} -> {tail:.4f} "
          f"nats/token (first / last 10 steps, {len(tokens)} tokens, {out['seconds']:.0f} s"
          f"{rates})", file=sys.stderr)
    return out["quantized"]


def _width_factor(value: str) -> tuple:
    """(bits, factor) of --expert-tune-lr-width's BITS=FACTOR."""
    bits, _, factor = value.partition("=")
    try:
        out = (int(bits), float(factor))
    except ValueError:
        raise FlashError(f"--expert-tune-lr-width {value}: not BITS=FACTOR (e.g. 2=3)") from None
    if out[0] not in WIDTHS or not out[1] >= 0:
        raise FlashError(f"--expert-tune-lr-width {value}: BITS one of {' '.join(map(str, WIDTHS))}, FACTOR >= 0")
    return out


def _resident_module(value: str) -> tuple:
    """(name, (bits, group_size)) of --resident-module's NAME=BITS[:GROUP] (group default 64)."""
    name, _, rest = value.partition("=")
    bits, _, size = rest.partition(":")
    try:
        return name, (int(bits), int(size or 64))
    except ValueError:
        raise FlashError(f"--resident-module {value}: not NAME=BITS[:GROUP] (e.g. embed_tokens=8 "
                         "or q_proj=4:32)") from None


def _resident_quantizer(model_dir, args):
    """write_pack's resident_quantizer for --resident-quantizer (None: mx.quantize), with the
    float model's linear inputs on --resident-calib-text for the methods that weigh by them
    (imported only then: the quantizers load mlx-lm, ~3 s of imports a default convert skips)."""
    method = args.resident_quantizer
    if method in ("mlx", "minmax") and args.resident_calib_text:
        raise FlashError(f"--resident-calib-text: --resident-quantizer {method} uses no calibration "
                         "text (clip and the gptq ones do)")
    if method == "mlx":
        return None
    if not args.resident_bits:
        raise FlashError(f"--resident-quantizer {method}: needs --resident-bits")
    from .calibration.resident_quant import input_moments, resident_quantizer

    if not args.resident_calib_text:
        if method.startswith("gptq"):
            raise FlashError(f"--resident-quantizer {method}: needs --resident-calib-text FILES")
        return resident_quantizer(method)
    import mlx.core as mx

    from .calibration.dense_pass import text_tokens
    from .models import load_model, load_tokenizer

    model, _ = load_model(model_dir, lazy=False)
    model.set_dtype(mx.float32)
    tokens = text_tokens(args.resident_calib_text, load_tokenizer(model_dir), args.resident_calib_tokens,
                         flag="--resident-calib-text")
    return resident_quantizer(method, input_moments(model, tokens))


def _main(argv):
    parser = argparse.ArgumentParser(
        prog="python -m mlx_flash.convert",
        description="Convert a model (default: the embedded SmolLM2-135M-Instruct) into a flash pack (FFN "
                    "neurons bundled on disk for streaming), "
                    "or with --format mlx, a GGUF file into an mlx-lm folder.",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", default=None,
                        help="source: an mlx-lm / Hugging Face folder, a hub repo id, or a .gguf file "
                             "(default: the embedded SmolLM2-135M-Instruct Q4_1)")
    source.add_argument("--synthetic", metavar="ARCH",
                        help="instead of --model: random weights shaped like ARCH (opt-1.3b, "
                             "opt-6.7b, llama-2-7b, opt-125m, opt-tiny, llama-tiny) with a chosen "
                             "FFN sparsity and an exact predictor, or an MoE shape (olmoe-1b-7b, "
                             "qwen3-30b-a3b, olmoe-tiny, qwen3-moe-tiny: --quantize 4 (default) "
                             "or 8, group size 32); labelled synthetic, for speed measurements "
                             "only (default dtype float16)")
    parser.add_argument("--out", required=True, help="output folder (must not exist)")
    parser.add_argument("--format", choices=("pack", "mlx"), default="pack",
                        help="pack: a flash pack (default); mlx: an mlx-lm folder (GGUF sources)")
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None,
                        help="pack: cast float weights to this dtype")
    parser.add_argument("--quantize", type=int, choices=(4, 8), default=None,
                        help="pack: MLX affine-quantize weights to this many bits (float sources)")
    parser.add_argument("--group-size", type=int, choices=(32, 64, 128), default=None,
                        help="pack: quantization group size (with --quantize; default 64, "
                             "synthetic MoE shapes 32: llama.cpp's Q4_1 block)")
    parser.add_argument("--gate-bits", type=int, choices=(2, 3, 4, 8), default=None,
                        help="pack, gated float models: keep each FFN gate resident, quantized at "
                             "this many bits (group size 32), out of the neuron bundles: bundles "
                             "2/3 the size, the model computes with the quantized gate, and "
                             "calibrate --kind gate-threshold predicts from it exactly (docs/relufy.md)")
    parser.add_argument("--resident-bits", type=int, choices=(4, 8), default=None,
                        help="pack, float models: MLX affine-quantize the resident linears "
                             "(attention projections, the embedding / tied lm_head) at this many "
                             "bits (group size --resident-group-size), FFN bundles unchanged: a "
                             "smaller resident set (more of a memory budget for the FFN caches) and "
                             "fewer bytes per token's matvecs (docs/relufy.md)")
    parser.add_argument("--resident-group-size", type=int, choices=(32, 64, 128), default=64,
                        help="--resident-bits: quantization group size (default 64)")
    parser.add_argument("--resident-module", type=_resident_module, nargs="+", default=None,
                        metavar="NAME=BITS[:GROUP]",
                        help="--resident-bits: these resident linears at their own bits (4, 8, or "
                             "16 = kept float) and group size (default 64) instead; NAME is a "
                             "module path or its end, e.g. embed_tokens=8 q_proj=4:32 (docs/relufy.md)")
    parser.add_argument("--resident-quantizer", choices=METHODS, default="mlx",
                        help="--resident-bits: how the resident linears are rounded, always in MLX's "
                             "affine format: mlx = mx.quantize (default); minmax = each group's own "
                             "min..max grid; clip = the range shrink with the least error; gptq = "
                             "clip plus GPTQ's error-compensating rounding with each linear's inputs "
                             "on --resident-calib-text; gptq-fit = gptq, then each row's scales and "
                             "biases refit to those inputs; gptq-cd = gptq-fit, then coordinate "
                             "descent on the integers")
    parser.add_argument("--resident-calib-text", nargs="+", default=None, metavar="FILE",
                        help="--resident-quantizer clip/gptq/gptq-fit/gptq-cd: calibration text (never the "
                             "text you evaluate on)")
    parser.add_argument("--resident-calib-tokens", type=int, default=4096,
                        help="--resident-calib-text: calibration tokens (default 4096)")
    parser.add_argument("--down-bits", type=int, choices=(4, 8, 16), default=16,
                        help="pack, already quantized sources: how to store each down projection "
                             "column (its groups must run the other way): 16 = the source's values "
                             "as floats (default: the source model, bundles ~1.7x a 4-bit one); "
                             "8 or 4 = re-quantize: smaller bundles, a lossy model (on SmolLM2-135M "
                             "Q4_1: +0.12%% / +4.5%% perplexity)")
    parser.add_argument("--encoding", choices=("dense", "endor"), default="dense",
                        help="pack: endor stores pruned FFN bundles and resident linears as a bitmap "
                             "of their non-zeros plus the non-zeros (float source, e.g. from "
                             "python -m mlx_flash.prune); with --quantize only the non-zeros are "
                             "quantized, pruned zeros stay exact")
    parser.add_argument("--expert-bits", type=float, default=None, metavar="AVG",
                        help="pack, float MoE sources: quantize each expert at 2, 3, 4 or 8 bits, "
                             "chosen on --calib-text so the mean is AVG bits per expert weight "
                             "(the experts whose quantization error costs most get the wide "
                             "widths); non-expert weights follow --quantize. See docs/moe.md")
    parser.add_argument("--expert-bits-tolerance", type=float, default=None, metavar="PCT",
                        help="instead of --expert-bits: the fewest bits per expert weight whose "
                             "calibration perplexity (on --calib-text) stays within PCT percent "
                             "of the float experts' (bisection over the mean, one forward pass "
                             "each)")
    parser.add_argument("--expert-widths", type=int, nargs="+", choices=(2, 3, 4, 8), default=None,
                        metavar="BITS", help="--expert-bits: the widths an expert may get "
                                             "(default 2 3 4 8; e.g. 4 with --expert-bits 4: every "
                                             "expert at 4 bits, by --expert-quantizer)")
    parser.add_argument("--expert-importance", choices=("output", "layer-loss", "layer-loss-frozen"),
                        default="output",
                        help="--expert-bits: output = each expert's quantization error in its "
                             "layer's output (relative to the layer's output energy); layer-loss "
                             "= the same, each layer's rescaled so its total at the narrowest "
                             "width is the measured KL from the float model with that layer's "
                             "experts at that width (one forward pass per layer, EdgeMoE's loss "
                             "change; layers differ by orders of magnitude); layer-loss-frozen = "
                             "layer-loss with every later router replaying the float model's "
                             "choices (the rounding's own loss, not the routers' reaction)")
    parser.add_argument("--expert-importance-tokens", type=int, default=256,
                        help="--expert-importance layer-loss: calibration tokens per pass "
                             "(default 256)")
    parser.add_argument("--expert-assign", choices=SOLVERS, default="knapsack",
                        help="--expert-bits: how widths are chosen from the measured errors: "
                             "knapsack = the least summed error under the mean (exact, default); "
                             "greedy = the largest error drop per added bit first")
    parser.add_argument("--expert-quantizer", choices=METHODS,
                        default="gptq-fit",
                        help="--expert-bits: how each expert is rounded to its width, always in "
                             "MLX's affine format: mlx = mx.quantize; minmax = each group's own "
                             "min..max grid; clip = the range shrink with the least error on the "
                             "calibration inputs; gptq = clip plus GPTQ's error-compensating "
                             "rounding with each expert's routed inputs; gptq-fit = gptq, then "
                             "each row's scales and biases refit to the least error on those "
                             "inputs (default); gptq-cd = gptq-fit, then coordinate descent on "
                             "the integers against the same error (slower). See docs/moe.md")
    parser.add_argument("--expert-tune", type=int, default=0, metavar="STEPS",
                        help="with --expert-bits: after rounding, train each expert's scales and "
                             "biases (integers fixed) for STEPS steps of 256 --calib-text tokens "
                             "so the quantized model's next-token distribution matches the float "
                             "model's (KL); the pack format is unchanged. See docs/moe.md")
    parser.add_argument("--expert-tune-lr", type=float, default=2e-3,
                        help="--expert-tune: Adam learning rate, relative to each scale "
                             "(default 2e-3)")
    parser.add_argument("--expert-tune-lr-width", type=_width_factor, nargs="+", default=None,
                        metavar="BITS=FACTOR",
                        help="--expert-tune: the learning rate times FACTOR for the experts at "
                             "BITS (e.g. 2=3 3=2: the narrow experts' scales move further; "
                             "widths not named: 1)")
    parser.add_argument("--expert-tune-int-lr", type=float, default=0.0, metavar="LR",
                        help="--expert-tune: move the experts' integers too (straight-through "
                             "rounding of a float offset per weight, started from the float "
                             "weight's place in its rounding step); LR is the offset's Adam step "
                             "in integer steps (default 0: integers fixed). See docs/moe.md")
    parser.add_argument("--expert-tune-tokens", type=int, default=65536,
                        help="--expert-tune: --calib-text tokens it draws its windows from "
                             "(default 65536)")
    parser.add_argument("--expert-tune-val-tokens", type=int, default=0, metavar="N",
                        help="--expert-bits: score the perplexity of N --calib-text tokens after "
                             "the tuning range (--expert-tune-tokens; windows of 256 spread "
                             "evenly; never calibrated or tuned on); with --expert-tune, before "
                             "tuning and every --expert-tune-every steps, keeping the checkpoint "
                             "that scores best (step 0, untuned, included)")
    parser.add_argument("--expert-tune-every", type=int, default=20, metavar="STEPS",
                        help="--expert-tune-val-tokens: steps between checkpoints (default 20)")
    parser.add_argument("--calib-text", nargs="+", default=None, metavar="FILE",
                        help="MoE models: calibration text files (never the text you evaluate on): "
                             "the routing statistics that split --memory-budget's expert slots "
                             "over layers, and --expert-bits' measurements")
    parser.add_argument("--calib-tokens", type=int, default=None,
                        help="--calib-text: calibration tokens (default 2048; 8192 with "
                             "--expert-bits or --expert-bits-tolerance, whose per-expert rounding "
                             "statistics need them: docs/moe.md)")
    parser.add_argument("--sparsity", type=float, default=0.95,
                        help="--synthetic: fraction of FFN neurons inactive per token (default 0.95)")
    parser.add_argument("--weight-sparsity", type=float, default=0.0,
                        help="--synthetic: fraction of attention/FFN weights set to exactly zero at "
                             "random positions (unstructured pruning's shape, for ENDOR; default 0)")
    parser.add_argument("--rank", type=int, default=128,
                        help="--synthetic: rank of the up projection and its predictor (default 128)")
    parser.add_argument("--seed", type=int, default=0, help="--synthetic: random seed")
    parser.add_argument("--verbose", action="store_true", help="show tracebacks on errors")
    args = parser.parse_args(argv)
    if args.calib_text or args.resident_calib_text:  # float32 calibration: OpenBLAS on Linux (blas.py)
        preload_openblas(argv)
    if args.expert_bits is not None and args.expert_bits_tolerance is not None:
        raise FlashError("--expert-bits-tolerance: give it or --expert-bits, not both")
    if args.expert_bits_tolerance is not None and args.expert_bits_tolerance < 0:
        raise FlashError(f"--expert-bits-tolerance {args.expert_bits_tolerance:g}: must be >= 0")
    wants_bits = args.expert_bits is not None or args.expert_bits_tolerance is not None
    if args.calib_tokens is None:
        args.calib_tokens = EXPERT_BITS_CALIB_TOKENS if wants_bits else 2048
    if args.expert_tune < 0:
        raise FlashError(f"--expert-tune {args.expert_tune}: must be >= 0")
    if args.expert_tune and not wants_bits:
        raise FlashError("--expert-tune: only with --expert-bits or --expert-bits-tolerance")
    if args.expert_importance != "output" and not wants_bits:
        raise FlashError("--expert-importance: only with --expert-bits or --expert-bits-tolerance")
    if args.expert_importance_tokens < 16:
        raise FlashError(f"--expert-importance-tokens {args.expert_importance_tokens}: must be >= 16")
    if args.expert_tune_lr_width:
        if not args.expert_tune:
            raise FlashError("--expert-tune-lr-width: only with --expert-tune")
        args.expert_tune_lr_width = dict(args.expert_tune_lr_width)
    if args.expert_tune_int_lr:
        if not args.expert_tune:
            raise FlashError("--expert-tune-int-lr: only with --expert-tune")
        if not args.expert_tune_int_lr > 0:
            raise FlashError(f"--expert-tune-int-lr {args.expert_tune_int_lr:g}: must be > 0")
    if args.expert_tune_val_tokens:
        if not wants_bits:
            raise FlashError("--expert-tune-val-tokens: only with --expert-bits or "
                             "--expert-bits-tolerance")
        if args.expert_tune_val_tokens < 256:
            raise FlashError(f"--expert-tune-val-tokens {args.expert_tune_val_tokens}: must be >= 256")
    if args.expert_tune_every < 1:
        raise FlashError(f"--expert-tune-every {args.expert_tune_every}: must be >= 1")
    if args.expert_tune and args.expert_quantizer == "mlx":
        raise FlashError("--expert-tune: needs --expert-quantizer minmax, clip or a gptq one")
    if args.expert_widths and not wants_bits:
        raise FlashError("--expert-widths: only with --expert-bits or --expert-bits-tolerance")
    for flag, value in (("--expert-bits", args.expert_bits), ("--calib-text", args.calib_text),
                        ("--expert-bits-tolerance", args.expert_bits_tolerance)):
        if value is not None and (args.synthetic or args.format != "pack"):
            raise FlashError(f"{flag}: only when converting a model (--model) to a pack")
    if wants_bits and not args.calib_text:
        raise FlashError("--expert-bits: needs --calib-text FILE... (each expert's importance is "
                         "measured on text)")
    if args.calib_text:
        from .calibration.dense_pass import MIN_TOKENS  # (imports mlx-lm: only when calibrating)

        for flag, n in (("--calib-tokens", args.calib_tokens),
                        ("--expert-tune-tokens", args.expert_tune_tokens)):
            if n < MIN_TOKENS:  # the text is tokenized once and sliced: refuse a short slice here
                raise FlashError(f"{flag} {n}: must be >= {MIN_TOKENS}")
    if args.synthetic:
        if args.format != "pack":
            raise FlashError("--synthetic: only with --format pack")
        out = write_synthetic_pack(args.synthetic, Path(args.out), sparsity=args.sparsity,
                                   dtype=args.dtype or "float16", quantize=args.quantize,
                                   group_size=args.group_size, rank=args.rank, seed=args.seed,
                                   encoding=args.encoding, weight_sparsity=args.weight_sparsity)
        print(f"Wrote {out} (synthetic {args.synthetic}: random weights, for speed only)",
              file=sys.stderr)
        return 0
    out = Path(args.out).expanduser()
    if out.exists():
        raise FlashError(f"--out {out}: already exists; remove it or choose another path")
    src = default_gguf_path() if args.model is None else Path(args.model).expanduser()
    if args.format == "mlx":
        if args.dtype or args.quantize or args.resident_bits:
            raise FlashError("--dtype/--quantize/--resident-bits: only with --format pack")
        if not src.exists():
            raise FlashError(f"--model {src}: no such file or folder")
        if not (src.is_file() and is_gguf(src)):
            raise FlashError(f"--model {src}: --format mlx converts GGUF files; this is not one")
        convert_gguf(src, out)
    else:
        model_dir = resolve_model(args.model)
        expert_bits = routing = quantizer = None
        if args.calib_text:
            expert_bits, routing, quantizer = _calibrate_moe(model_dir, args)
        check_resident_modules(dict(args.resident_module or ()), args.resident_bits)  # before calibrating
        resident_quantizer = _resident_quantizer(model_dir, args)
        write_pack(model_dir, out, dtype=args.dtype, quantize=args.quantize,
                   group_size=args.group_size or 64, down_bits=args.down_bits, encoding=args.encoding,
                   expert_bits=expert_bits, moe_routing=routing, expert_quantizer=quantizer,
                   gate_bits=args.gate_bits, resident_bits=args.resident_bits,
                   resident_group_size=args.resident_group_size,
                   resident_modules=dict(args.resident_module or ()), resident_quantizer=resident_quantizer)
        down = read_manifest(out).get("down")
        if down:
            print(down_report(down), file=sys.stderr)
    print(f"Wrote {out}", file=sys.stderr)
    return 0


def main(argv=None):
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
