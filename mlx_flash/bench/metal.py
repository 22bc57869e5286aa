"""`bench kernels --metal`: the sparse FFN on the Metal kernels vs MLX's gather + matmul, on a Mac.

One FFN call of a 7B-shaped layer (hidden 4096, 11008 neurons, one token): up/gate with SiLU and
the threshold mask, then down, over 10-50% of the neurons, selected two ways: the first n rows of a
neuron cache (`n`) and gathered row ids (`ids`, sorted random rows). Ours: mlx_flash.metal.kernels'
sparse_up_metal + sparse_down_metal (the selected rows are read in place). MLX's: the MLX-op twins,
i.e. w[rows] gathers + mx.quantized_matmul / matmul. Both run on the GPU, alternated, each timed as
the median of --metal-repeats evaluations after a warm-up; the outputs are compared first.
Target: ours at least 2x faster at 10-50% of rows. Elsewhere it prints that it needs a Mac.
"""

import platform
import time

HIDDEN, NEURONS = 4096, 11008
FRACTIONS = (0.10, 0.25, 0.50)
KINDS = ("q4g64", "f16")
TARGET_SPEEDUP = 2.0


def _weights(kind, rows, cols, seed):
    import mlx.core as mx

    from ..metal.kernels import Weights

    w = (mx.random.normal((rows, cols), key=mx.random.key(seed)) * 0.02).astype(mx.float16)
    if kind == "f16":
        return Weights(w)
    q, s, b = mx.quantize(w, group_size=64, bits=4)
    return Weights(q, s, b, bits=4, group_size=64)


def _median_ms(fn, repeats):
    import mlx.core as mx

    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


def run_metal(args):
    """Prints the table (or that a Mac is needed); returns the exit code."""
    import mlx.core as mx
    import numpy as np

    from ..metal import kernels as K

    if not (platform.system() == "Darwin" and mx.metal.is_available()):
        print("bench kernels --metal: needs a Mac (Apple Silicon GPU); nothing measured on "
              f"{platform.system()} {platform.machine()}")
        return 0
    mx.set_default_device(mx.gpu)
    repeats = args.metal_repeats
    print(f"machine: {platform.platform()} ({platform.machine()}), mlx {mx.__version__}, Metal device "
          f"{mx.metal.device_info().get('device_name', '?')}")
    print(f"one FFN call, hidden {HIDDEN}, {NEURONS} neurons, 1 token; median of {repeats} runs each\n")
    print(f"{'kind':6} {'rows':>5} {'select':6} {'MLX ms':>8} {'ours ms':>8} {'speedup':>8} {'max diff':>9}")
    rows_out, met = [], 0
    for kind in KINDS:
        up, gate, down = (_weights(kind, NEURONS, HIDDEN, s) for s in (1, 2, 3))
        x = mx.random.normal((1, HIDDEN), key=mx.random.key(4)).astype(mx.float16)
        for frac in FRACTIONS:
            count = int(NEURONS * frac)
            ids = np.sort(np.random.default_rng(0).choice(NEURONS, count, replace=False)).astype(np.int32)
            for select, sel in (("n", dict(n=count)), ("ids", dict(rows=mx.array(ids)))):
                def ours():
                    h = K.sparse_up_metal(x, up, gate, threshold=0.0, **sel)
                    return K.sparse_down_metal(h, down, **sel)

                def theirs():
                    h = K.sparse_up_twin(x, up, gate, threshold=0.0, **sel)
                    return K.sparse_down_twin(h, down, **sel)

                diff = float(mx.abs(ours().astype(mx.float32) - theirs().astype(mx.float32)).max())
                for _ in range(3):  # warm-up: kernel builds, buffers
                    mx.eval(ours(), theirs())
                ours_ms, mlx_ms = [], []
                for _ in range(3):  # alternate, so both see the same conditions
                    ours_ms.append(_median_ms(ours, repeats))
                    mlx_ms.append(_median_ms(theirs, repeats))
                o, m = min(ours_ms), min(mlx_ms)
                met += m / o >= TARGET_SPEEDUP
                rows_out.append((kind, frac, select, m, o))
                print(f"{kind:6} {frac:>5.0%} {select:6} {m:>8.3f} {o:>8.3f} {m / o:>7.2f}x {diff:>9.2g}", flush=True)
    print(f"\n{met}/{len(rows_out)} cases at >= {TARGET_SPEEDUP:.0f}x MLX's gather + matmul")
    print(f"command: {args.command_line}")
    return 0
