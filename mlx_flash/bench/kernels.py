"""Effective weight bandwidth of the CPU matvec kernels vs MLX's own ops, and generation tokens/s.

Memory bandwidth is measured first: the best of several runs of numpy's float32 `max` over a
512 MiB buffer, split across 1 and all cores (numpy releases the GIL), i.e. a pure streaming read.
Each kernel is then timed on cold weights: enough copies of the matrix to exceed the last-level
cache (--working-set MiB), one op per copy, evaluated in batches; effective bandwidth = bytes of
packed weights + scales + biases actually read (selected rows only for gathers) / seconds.

  python -m mlx_flash.bench kernels [--json out.json] [--generate MODEL_DIR]
"""

import json
import os
import platform
import sys
import time

TARGET_FRACTION = 0.70

# (name, kind, N, K, M, options). kind: q<bits>g<group>, f16, bf16. Embedded model: SmolLM2-135M.
CASES = [
    ("smollm2 q/o_proj", "q4g32", 576, 576, 1, {}),
    ("smollm2 k/v_proj", "q4g32", 192, 576, 1, {}),
    ("smollm2 gate/up", "q4g32", 1536, 576, 1, {}),
    ("smollm2 gate/up M=4", "q4g32", 1536, 576, 4, {}),
    ("smollm2 down", "q4g32", 576, 1536, 1, {}),
    ("smollm2 lm_head", "q8g32", 49152, 576, 1, {}),
    ("7B up", "q4g32", 11008, 4096, 1, {}),
    ("7B up", "q4g64", 11008, 4096, 1, {}),
    ("7B up", "q4g128", 11008, 4096, 1, {}),
    ("7B up", "q8g64", 11008, 4096, 1, {}),
    ("7B up", "f16", 11008, 4096, 1, {}),
    ("7B up", "bf16", 11008, 4096, 1, {}),
    ("7B up 25% rows", "q4g64", 11008, 4096, 1, {"gather": "rows", "frac": 0.25}),
    ("7B down^T 25% rows", "q4g64", 11008, 4096, 1, {"gather": "rows_t", "frac": 0.25}),
    ("7B up 25% prefix", "f16", 11008, 4096, 1, {"gather": "prefix", "frac": 0.25}),
    ("7B down^T 25% rows", "f16", 11008, 4096, 1, {"gather": "rows_t", "frac": 0.25}),
]


def add_arguments(parser):
    parser.add_argument("--json", default=None, help="save the results to this file")
    parser.add_argument("--working-set", type=int, default=256,
                        help="MiB of distinct weights cycled through per timing (beats the cache)")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per case (best is kept)")
    parser.add_argument("--only", default=None, help="run only cases whose name or kind contains this")
    parser.add_argument("--no-mlx", action="store_true", help="skip timing MLX's own ops")
    parser.add_argument("--generate", metavar="MODEL_DIR", default=None,
                        help="also time token generation of this mlx-lm model folder, unpatched vs patched")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per generation run")
    parser.add_argument("--prompt", default="Write a short story about a robot who learns to paint.")


def measure_bandwidth(mib=512, repeats=5):
    """Streaming read bandwidth in GB/s: numpy float32 max over `mib` MiB, 1 thread and all cores."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    buf = np.ones(mib * (1 << 20) // 4, dtype=np.float32)
    result = {}
    for threads in sorted({1, os.cpu_count() or 1}):
        parts = np.array_split(buf, threads)
        best = float("inf")
        with ThreadPoolExecutor(threads) as pool:
            for _ in range(repeats):
                t0 = time.perf_counter()
                list(pool.map(np.max, parts))
                best = min(best, time.perf_counter() - t0)
        result[threads] = buf.nbytes / best / 1e9
    return result


def _parse_kind(kind):
    if kind in ("f16", "bf16"):
        return None, None
    bits, group = kind[1:].split("g")
    return int(bits), int(group)


def _make_case(kind, n, k, copies):
    """One [copies*N, K] weight (so copies are distinct memory) and the per-copy row offset."""
    import mlx.core as mx

    bits, group = _parse_kind(kind)
    rows = copies * n
    if bits is None:
        dtype = mx.float16 if kind == "f16" else mx.bfloat16
        w = (mx.random.normal((rows, k)) * 0.05).astype(dtype)
        mx.eval(w)
        return {"w": w, "scales": None, "biases": None, "bits": None, "group": 64}
    # Random packed words are valid quantized data; scales/biases random half values.
    w = mx.random.randint(0, 2**31 - 1, (rows, k * bits // 32)).astype(mx.uint32)
    scales = (mx.random.uniform(shape=(rows, k // group)) * 0.01).astype(mx.float16)
    biases = (mx.random.normal((rows, k // group)) * 0.05).astype(mx.float16)
    mx.eval(w, scales, biases)
    return {"w": w, "scales": scales, "biases": biases, "bits": bits, "group": group}


def _row_bytes(case, k):
    if case["bits"] is None:
        return 2 * k
    return k * case["bits"] // 8 + 2 * 2 * (k // case["group"])


def _build_ops(case, n, k, m, opts, copies, use_kernel):
    """A list of zero-argument callables, one per weight copy, each returning one lazy result."""
    import mlx.core as mx
    import numpy as np

    from mlx_flash import ops

    w, s, b, bits, group = case["w"], case["scales"], case["biases"], case["bits"], case["group"]
    xdtype = mx.float32 if bits is not None else w.dtype  # as in mlx-lm models of each kind
    gather = opts.get("gather")
    nsel = max(1, int(n * opts.get("frac", 1.0)))
    rng = np.random.default_rng(0)
    sel = mx.array(np.sort(rng.choice(n, nsel, replace=False)).astype(np.int32))
    x = mx.random.normal((m, k)).astype(xdtype)
    h = mx.random.normal((m, nsel)).astype(xdtype)
    mx.eval(x, h, sel)
    fns = []
    for c in range(copies):
        lo, hi = c * n, (c + 1) * n
        wc = w[lo:hi]  # views of the big buffer, materialised before timing (no copy)
        sc = s[lo:hi] if s is not None else None
        bc = b[lo:hi] if b is not None else None
        mx.eval([a for a in (wc, sc, bc) if a is not None])
        if gather is None:
            if use_kernel:
                f = (lambda wc=wc, sc=sc, bc=bc: ops.quantized_matvec(x, wc, sc, bc, group, bits)) if bits else \
                    (lambda wc=wc: ops.half_matvec(x, wc))
            else:
                f = (lambda wc=wc, sc=sc, bc=bc: mx.quantized_matmul(
                    x, wc, sc, bc, transpose=True, group_size=group, bits=bits)) if bits else \
                    (lambda wc=wc: x @ wc.T)
        else:
            rows = None if gather == "prefix" else sel
            count = nsel if gather == "prefix" else None
            fn = ops.gather_matvec_t if gather == "rows_t" else ops.gather_matvec
            inp = h if gather == "rows_t" else x

            def f(wc=wc, sc=sc, bc=bc, fn=fn, inp=inp, rows=rows, count=count):
                return fn(inp, wc, rows=rows, n=count, scales=sc, biases=bc, group_size=group, bits=bits)
        fns.append(f)
    return fns, nsel


def _time_pass(fns, batch=32):
    import mlx.core as mx

    t0 = time.perf_counter()
    for i in range(0, len(fns), batch):
        mx.eval([f() for f in fns[i:i + batch]])
    return time.perf_counter() - t0


def _bench_case(name, kind, n, k, m, opts, args, bandwidth):
    import mlx.core as mx

    from mlx_flash import ops

    bits, _ = _parse_kind(kind)
    probe = _make_case(kind, n, k, 1)
    per_copy = _row_bytes(probe, k) * n
    copies = max(2, min(4096, -(-args.working_set * (1 << 20) // per_copy)))
    case = _make_case(kind, n, k, copies)
    del probe
    row = {"name": name, "kind": kind, "N": n, "K": k, "M": m, "gather": opts.get("gather"),
           "copies": copies}

    ops.set_kernels_enabled(True)
    fns, nsel = _build_ops(case, n, k, m, opts, copies, use_kernel=True)
    rows_read = nsel if opts.get("gather") else n
    bytes_read = _row_bytes(case, k) * rows_read
    _time_pass(fns[: min(len(fns), 64)])  # warm-up: thread pool, allocator
    best = min(_time_pass(fns) for _ in range(args.repeats))
    row.update(bytes_per_call=bytes_read, ours_us=best / copies * 1e6,
               ours_gbs=bytes_read * copies / best / 1e9)
    row["ours_fraction"] = row["ours_gbs"] / bandwidth

    if not args.no_mlx:
        # MLX's op: the plain op for dense cases, the gather-then-matmul fallback for gathers.
        ops.set_kernels_enabled(False)
        mfns, _ = _build_ops(case, n, k, m, opts, copies, use_kernel=False)
        t_one = _time_pass(mfns[:2]) / 2
        take = max(2, min(copies, int(1.0 / max(t_one, 1e-6))))  # ~1 s per pass
        mbest = min(_time_pass(mfns[:take]) for _ in range(max(1, args.repeats - 1)))
        row.update(mlx_us=mbest / take * 1e6, mlx_gbs=bytes_read * take / mbest / 1e9,
                   mlx_cold=take * per_copy > 32 * (1 << 20))
        ops.set_kernels_enabled(True)
    del case
    mx.clear_cache()
    return row


def _generate(args):
    """Tokens/s of mlx-lm generation on MODEL_DIR, before and after patch_linear_layers."""
    import mlx.core as mx
    from mlx_lm.generate import stream_generate
    from mlx_lm.utils import load

    from mlx_flash import ops

    model, tokenizer = load(args.generate)

    def one_run(max_tokens):
        last, tokens = None, []
        for r in stream_generate(model, tokenizer, args.prompt, max_tokens=max_tokens):
            last = r
            tokens.append(r.token)
        return last, tokens

    results = {}
    for label in ("mlx", "patched"):
        if label == "patched":
            results["layers_patched"] = ops.patch_linear_layers(model)
        one_run(8)  # warm-up
        last, tokens = one_run(args.max_tokens)
        results[label] = {"generation_tps": last.generation_tps, "prompt_tps": last.prompt_tps,
                          "generation_tokens": last.generation_tokens, "prompt_tokens": last.prompt_tokens,
                          "peak_memory_gb": last.peak_memory}
        results[label + "_tokens"] = tokens
    same = results.pop("mlx_tokens") == results.pop("patched_tokens")
    results["same_greedy_tokens"] = same
    results["speedup"] = results["patched"]["generation_tps"] / results["mlx"]["generation_tps"]
    mx.clear_cache()
    return results


def run(args):
    import mlx.core as mx

    from mlx_flash import ops

    mx.set_default_device(mx.cpu)
    if not ops.EXTENSION_AVAILABLE:
        print(f"mlx_flash._ext is not available ({ops.EXTENSION_ERROR}); build it with `pip install .`",
              file=sys.stderr)
        return 1
    load_before = os.getloadavg()
    bw = measure_bandwidth()
    bandwidth = max(bw.values())
    print(f"machine: {platform.machine()} {os.cpu_count()} cores, mlx {mx.__version__}, "
          f"kernel threads {ops._ext.num_threads()}, simd {ops._ext.simd_active()}")
    print("memory read bandwidth (numpy float32 max over 512 MiB, best of 5): "
          + ", ".join(f"{t} thread{'s' if t > 1 else ''} {v:.1f} GB/s" for t, v in sorted(bw.items())))
    print(f"reference bandwidth: {bandwidth:.1f} GB/s; target >= {TARGET_FRACTION:.0%} of it\n")

    rows = []
    head = f"{'case':22} {'kind':6} {'N x K':>12} {'M':>2} {'KiB/call':>9} {'ours us':>8} {'GB/s':>6} {'of BW':>6}"
    head += "" if args.no_mlx else f" {'MLX us':>9} {'GB/s':>6} {'speedup':>7}"
    print(head)
    for name, kind, n, k, m, opts in CASES:
        if args.only and args.only not in name and args.only != kind:
            continue
        r = _bench_case(name, kind, n, k, m, opts, args, bandwidth)
        rows.append(r)
        line = (f"{name:22} {kind:6} {f'{n}x{k}':>12} {m:>2} {r['bytes_per_call'] / 1024:>9.1f} "
                f"{r['ours_us']:>8.1f} {r['ours_gbs']:>6.2f} {r['ours_fraction']:>6.0%}")
        if not args.no_mlx:
            line += (f" {r['mlx_us']:>9.1f} {r['mlx_gbs']:>6.2f} {r['mlx_us'] / r['ours_us']:>6.1f}x"
                     + ("" if r["mlx_cold"] else " (MLX warm cache)"))
        print(line, flush=True)
    met = sum(r["ours_fraction"] >= TARGET_FRACTION for r in rows)
    print(f"\n{met}/{len(rows)} cases at >= {TARGET_FRACTION:.0%} of measured bandwidth")
    load_after = os.getloadavg()
    busy = max(load_before[0], load_after[0]) > 0.5
    print(f"1-min load average before/after: {load_before[0]:.2f} / {load_after[0]:.2f}"
          + (" -- other processes were using the CPU; figures are pessimistic" if busy else ""))

    result = {"command": " ".join(sys.argv), "machine": platform.platform(), "cpu_count": os.cpu_count(),
              "mlx_version": mx.__version__, "kernel_threads": ops._ext.num_threads(),
              "bandwidth_gbs": {str(t): v for t, v in bw.items()}, "reference_bandwidth_gbs": bandwidth,
              "load_average_before_after": [load_before[0], load_after[0]],
              "cases": rows}
    if args.generate:
        g = _generate(args)
        result["generate"] = g
        print(f"\ngeneration on {args.generate} ({args.max_tokens} tokens, prompt {g['mlx']['prompt_tokens']} tokens):")
        print(f"  MLX ops:            {g['mlx']['generation_tps']:.1f} tok/s (prompt {g['mlx']['prompt_tps']:.1f} tok/s)")
        print(f"  patched ({g['layers_patched']} layers): {g['patched']['generation_tps']:.1f} tok/s "
              f"(prompt {g['patched']['prompt_tps']:.1f} tok/s), {g['speedup']:.1f}x; "
              f"same greedy tokens: {g['same_greedy_tokens']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"saved {args.json}")
    return 0
