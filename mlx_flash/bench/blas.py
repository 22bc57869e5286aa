"""Float32 matmul / matvec speed of MLX's CPU backend, and which BLAS it is using.

On Linux, MLX's wheel bundles the reference BLAS; preloading OpenBLAS makes float32 much faster:
  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python -m mlx_flash.bench blas
"""

import time

import mlx.core as mx

from ..blas import loaded_blas
from ..paths import write_json_atomic


def add_arguments(parser):
    parser.add_argument("--size", type=int, default=1024, help="matmul size n (n x n @ n x n)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None, help="save the results to this file")


def _best_seconds(fn, repeats):

    mx.eval(fn())  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        best = min(best, time.perf_counter() - t0)
    return best


def run(args):

    n = args.size
    a, b = mx.random.normal((n, n)), mx.random.normal((n, n))
    w, x = mx.random.normal((4096, 4096)), mx.random.normal((1, 4096))
    mx.eval(a, b, w, x)
    t_mm = _best_seconds(lambda: a @ b, args.repeats)
    t_mv = _best_seconds(lambda: x @ w.T, args.repeats * 4)
    result = {
        "blas": loaded_blas(),
        "matmul_gflops": 2 * n**3 / t_mm / 1e9,
        "matvec_gb_per_s": w.nbytes / t_mv / 1e9,
        "matmul_size": n,
    }
    print(f"BLAS in use: {result['blas']}")
    print(f"float32 matmul {n}x{n}x{n}: {result['matmul_gflops']:.1f} GFLOP/s (best of {args.repeats})")
    print(f"float32 matvec 4096x4096:    {result['matvec_gb_per_s']:.2f} GB/s of weights")
    if args.json:
        write_json_atomic(args.json, result)
    return 0
