"""Relufication training speed: tokens per second of one training step, eager vs mx.compile'd,
at several batch shapes, the variants alternated step by step in one process (a loaded machine
slows them alike).

  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 OPENBLAS_NUM_THREADS=1 \
    taskset -c 1 python -m mlx_flash.bench relufy_step --cases eager@1x256,compiled+fused@2x256

Each case trains its own copy of the swapped model (CATS at 82%, the default recipe's
activation) from the same weights on the same random token batches, with the frozen original model
as the distillation teacher; a case's first steps (tracing) are not timed; the cases take turns step by step.
"""

import statistics
import time

import numpy as np

from ..paths import write_json_atomic

VARIANTS = {  # name: train_step_fn keyword arguments
    "eager": {"compiled": False, "fused_loss": False},   # the step before compilation and ce_and_kl
    "eager+fused": {"compiled": False},
    "compiled": {"compiled": True, "fused_loss": False},
    "compiled+fused": {"compiled": True},
    "compiled+fused+hidden": {"compiled": True, "hidden": 1.0},
}


def add_arguments(parser):
    parser.add_argument("--model", default=None, help="source model (default: the embedded SmolLM2-135M)")
    parser.add_argument("--cases", default="eager@1x256,compiled+fused@1x256,compiled+fused@2x256",
                        help=f"comma-separated VARIANT@BATCHxLENGTH, variants: {', '.join(VARIANTS)} "
                             "(default eager@1x256,compiled+fused@1x256,compiled+fused@2x256)")
    parser.add_argument("--distill", type=float, default=1.0, help="KL weight (0: no teacher forward)")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per case (tracing)")
    parser.add_argument("--json", default=None, help="save the results to this file")


def parse_cases(text) -> list:
    """[(variant, batch, length)] from "VARIANT@BATCHxLENGTH,..."."""
    from ..errors import FlashError

    out = []
    for part in text.split(","):
        variant, _, shape = part.partition("@")
        b, _, n = shape.partition("x")
        if variant not in VARIANTS or not (b.isdigit() and n.isdigit()) or int(b) < 1 or int(n) < 2:
            raise FlashError(f"--cases {part}: expected VARIANT@BATCHxLENGTH with VARIANT one of "
                             f"{', '.join(VARIANTS)}, e.g. compiled+fused@2x256")
        out.append((variant, int(b), int(n)))
    return out


def run(args):
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from ..calibration import relufication as R
    from ..sources import resolve_model
    from ..blas import loaded_blas

    cases = parse_cases(args.cases)
    src = resolve_model(args.model)
    teacher, config = R.load_float32(src)
    sample = np.random.default_rng(0).integers(0, config["vocab_size"], size=(4, 256))
    cfg = R.relufied_config(config, "cats", R.gate_thresholds(teacher, sample, 0.82, "cats"))
    weights = dict(tree_flatten(teacher.parameters()))
    print(f"BLAS in use: {loaded_blas()}")
    print(f"command: {args.command_line}")
    steps, seconds = [], [[] for _ in cases]
    for variant, _, _ in cases:
        model = R.build_model(cfg, weights)
        R.freeze_embeddings(model)
        model.train()
        kw = VARIANTS[variant]
        use_teacher = args.distill > 0 or kw.get("hidden", 0) > 0
        steps.append(R.train_step_fn(model, R.make_optimizer(1e-5, 0), teacher if use_teacher else None,
                                     args.distill, **kw))
    rng = np.random.default_rng(1)
    order = list(range(len(cases)))
    for i in range(args.warmup + args.repeats):
        for c in (order if i % 2 == 0 else order[::-1]):  # alternate who goes first
            _, batch, length = cases[c]
            tokens = mx.array(rng.integers(0, config["vocab_size"], size=(batch, length)).astype(np.int32))
            t0 = time.perf_counter()
            steps[c](tokens)
            if i >= args.warmup:
                seconds[c].append(time.perf_counter() - t0)
    results = []
    base = None
    for (variant, batch, length), secs in zip(cases, seconds):
        med = statistics.median(secs)
        rate = batch * length / med
        base = base or rate
        results.append({"variant": variant, "shape": f"{batch}x{length}", "median_s": med, "seconds": secs,
                        "tokens_per_s": rate, "vs_first": rate / base})
        print(f"{variant + '@' + f'{batch}x{length}':<28s} {med:7.2f} s/step (median of {len(secs)}; "
              f"{min(secs):.2f}-{max(secs):.2f})  {rate:6.1f} tokens/s  x{rate / base:.2f} tokens/s "
              f"vs the first case", flush=True)
    if args.json:
        write_json_atomic(args.json, results)
    return 0
