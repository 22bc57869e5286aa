"""Effective weight bandwidth of the CPU matvec kernels vs MLX's own ops, and generation tokens/s.

Memory bandwidth is measured first: the best of several runs of numpy's float32 `max` and uint64
`bitwise_or` reductions over a 512 MiB buffer, split across 1 and all cores (numpy releases the
GIL), i.e. a pure streaming read.
Each kernel is then timed on cold weights: enough copies of the matrix to exceed the last-level
cache (--working-set MiB), one op per copy, evaluated in batches of 32 built beforehand (only the
evaluation is timed: kernel + MLX's dispatch, not Python's op building); effective bandwidth =
bytes of packed weights + scales + biases actually read (selected rows only for gathers) / seconds.
--warm adds each kernel on one copy called over and over (cache-resident where it fits): its
compute ceiling, which says whether a case that misses the bandwidth target is compute-bound.

Generation (--generate): decode tokens/s of the dense `python -m mlx_flash.generate` path with our
kernels vs MLX's own CPU ops (kernels off), and llama.cpp (llama-cpp-python) on the same GGUF and
thread count, greedy, the same chat-templated prompt ids; and prompt processing: --prompt-tokens
ids (the prompt's text repeated) / time to the first token, for the same engines.

  python -m mlx_flash.bench kernels [--json out.json] [--warm] [--generate [MODEL]] [--no-kernels]
  python -m mlx_flash.bench kernels --metal      (the Metal sparse FFN kernels: bench/metal.py)
"""

import io
import os
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from ..api import encode_prompt, load, stream_generate
from ..cpu import ops
from ..cpu import patch as kl
from ..errors import FlashError
from ..paths import write_json_atomic
from ..sources import default_gguf_path
from .report import machine_info, package_versions

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
    parser.add_argument("--bandwidth-mib", type=int, default=512,
                        help="MiB streamed to measure memory bandwidth (default 512)")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per case (best is kept)")
    parser.add_argument("--only", default=None, help="run only cases whose name or kind contains this")
    parser.add_argument("--no-mlx", action="store_true", help="skip timing MLX's own ops")
    parser.add_argument("--warm", action="store_true",
                        help="also time each kernel on one copy of its weights, called over and over "
                        "(cache-resident where it fits: the kernel's compute ceiling, not memory's)")
    parser.add_argument("--generate", metavar="MODEL", nargs="?", const="", default=None,
                        help="also time generation as `python -m mlx_flash.generate` runs it (MODEL: "
                        "anything --model accepts; none = the embedded default) with our kernels, "
                        "with MLX's own ops, and with llama.cpp on the same GGUF when installed")
    parser.add_argument("--breakdown", action="store_true",
                        help="also split one decode step of the --generate model (default: embedded) "
                        "into kernel matvecs and everything else")
    parser.add_argument("--no-kernels", action="store_true",
                        help="skip the per-kernel table (only with --generate or --breakdown)")
    parser.add_argument("--q8-activations", action="store_true",
                        help="time the quantized cases with int8 activations (the opt-in integer-dot kernels)")
    parser.add_argument("--metal", action="store_true",
                        help="instead: the sparse FFN on the Metal kernels vs MLX's gather + matmul (needs a Mac)")
    parser.add_argument("--metal-repeats", type=int, default=50, help="with --metal: runs per timing")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per generation run")
    parser.add_argument("--gen-repeats", type=int, default=3, help="generation runs per engine (best kept)")
    parser.add_argument("--threads", type=int, default=None,
                        help="llama.cpp threads (default: the kernels' thread count)")
    parser.add_argument("--prompt", default="Write a short story about a robot who learns to paint.")
    parser.add_argument("--prompt-tokens", type=int, default=256,
                        help="with --generate: also time processing a prompt of this many tokens (the "
                        "prompt's text repeated) as tokens / time to the first token; 0: skip")


def measure_bandwidth(mib=512, repeats=5):
    """Streaming read bandwidth in GB/s over `mib` MiB, on 1 thread and on all cores (numpy
    releases the GIL): the best of numpy float32 `max` and uint64 `bitwise_or` reductions, the
    latter being cheap enough per byte to stay memory-bound where `max` is not."""


    buf = np.ones(mib * (1 << 20) // 4, dtype=np.float32)
    result = {}
    for threads in sorted({1, os.cpu_count() or 1}):
        best = float("inf")
        with ThreadPoolExecutor(threads) as pool:
            for data, reduce in ((buf, np.max), (buf.view(np.uint64), np.bitwise_or.reduce)):
                parts = np.array_split(data, threads)
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    list(pool.map(reduce, parts))
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
    """A list of zero-argument callables, each returning one lazy result on distinct weight bytes:
    one per weight copy, and for gathers one per disjoint row selection of each copy (a 25% gather
    reads a different quarter of the rows in each of 4 calls), so no call finds its rows cached."""


    w, s, b, bits, group = case["w"], case["scales"], case["biases"], case["bits"], case["group"]
    xdtype = mx.float32 if bits is not None else w.dtype  # as in mlx-lm models of each kind
    gather = opts.get("gather")
    nsel = max(1, int(n * opts.get("frac", 1.0)))
    parts = max(1, n // nsel) if gather else 1
    order = np.random.default_rng(0).permutation(n)
    sels = [mx.array(np.sort(order[j * nsel:(j + 1) * nsel]).astype(np.int32)) for j in range(parts)]
    x = mx.random.normal((m, k)).astype(xdtype)
    h = mx.random.normal((m, nsel)).astype(xdtype)
    mx.eval(x, h, *sels)
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
            fns.append(f)
            continue
        fn = ops.gather_matvec_t if gather == "rows_t" else ops.gather_matvec
        inp = h if gather == "rows_t" else x
        for j in range(parts):
            if gather == "prefix":  # the first nsel rows of a cache that starts at row j*nsel
                views = [a[j * nsel:] if a is not None else None for a in (wc, sc, bc)]
                mx.eval([a for a in views if a is not None])
                rows, count = None, nsel
            else:
                views, rows, count = (wc, sc, bc), sels[j], None

            def f(v=views, fn=fn, inp=inp, rows=rows, count=count):
                return fn(inp, v[0], rows=rows, n=count, scales=v[1], biases=v[2], group_size=group, bits=bits)
            fns.append(f)
    return fns, nsel


def _time_pass(fns, batch=32):
    """Seconds to evaluate one lazy op per callable: the ops (graph nodes) are built in Python first,
    untimed, so the time is the kernels' (and MLX's dispatch of each op), not Python's op building,
    which generation overlaps with compute (mlx-lm builds the next token's graph during this one)."""
    total = 0.0
    for i in range(0, len(fns), batch):
        outs = [f() for f in fns[i:i + batch]]
        t0 = time.perf_counter()
        mx.eval(outs)
        total += time.perf_counter() - t0
    return total


def _bench_case(name, kind, n, k, m, opts, args, bandwidth):


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
    calls = len(fns)
    row.update(calls_per_pass=calls, bytes_per_call=bytes_read, ours_us=best / calls * 1e6,
               ours_gbs=bytes_read * calls / best / 1e9)
    row["ours_fraction"] = row["ours_gbs"] / bandwidth
    if args.warm:  # the same op on the first copy only: its bytes stay in cache between calls
        warm = [fns[0]] * 32
        wbest = min(_time_pass(warm) for _ in range(max(3, args.repeats)))
        row.update(warm_us=wbest / len(warm) * 1e6, warm_gbs=bytes_read * len(warm) / wbest / 1e9)

    if not args.no_mlx:
        # MLX's op: the plain op for dense cases, the gather-then-matmul fallback for gathers.
        ops.set_kernels_enabled(False)
        mfns, _ = _build_ops(case, n, k, m, opts, copies, use_kernel=False)
        t_one = _time_pass(mfns[:2]) / 2
        take = max(2, min(len(mfns), int(1.0 / max(t_one, 1e-6))))  # ~1 s per pass
        mbest = min(_time_pass(mfns[:take]) for _ in range(max(1, args.repeats - 1)))
        row.update(mlx_us=mbest / take * 1e6, mlx_gbs=bytes_read * take / mbest / 1e9,
                   mlx_cold=take * bytes_read > 32 * (1 << 20))
        ops.set_kernels_enabled(True)
    del case
    mx.clear_cache()
    return row


def _decode_rate(stamps):
    """Generation tokens/s from the wall-clock times at which tokens 1..n arrived: (n-1) tokens
    over the time from the first to the last (prompt processing excluded), the same rule for every
    engine."""
    if len(stamps) < 2:
        return float("nan")
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def _mlx_flash_run(model, tokenizer, ids, max_tokens):
    """One greedy generation through mlx_flash.stream_generate -> (tokens/s, tokens, mlx-lm's own
    generation_tps)."""
    stamps, tokens, last = [], [], None
    for r in stream_generate(model, tokenizer, ids, max_tokens=max_tokens, temp=0.0):
        stamps.append(time.perf_counter())
        tokens.append(r.token)
        last = r
    return _decode_rate(stamps), tokens, last.generation_tps


def _mlx_flash_ttft(model, tokenizer, ids):
    """Seconds from handing `ids` to mlx_flash.stream_generate to its first token (prompt
    processing, then one decode step)."""
    t0 = time.perf_counter()
    for _ in stream_generate(model, tokenizer, ids, max_tokens=1, temp=0.0):
        break
    return time.perf_counter() - t0


def _llama_cpp_ttft(llm, ids):
    """Seconds from handing `ids` to llama.cpp (reset cache) to its first token."""
    llm.reset()
    t0 = time.perf_counter()
    for _ in llm.generate(ids, temp=0.0, top_k=1, reset=True):
        break
    return time.perf_counter() - t0


def _long_prompt_ids(tokenizer, prompt, n):
    """n token ids: the prompt's text repeated (content does not change the work per token)."""
    one = list(tokenizer.encode(prompt + "\n"))
    return (one * (n // max(1, len(one)) + 1))[:n]


def _prompt_speeds(engines, use, tokenizer, args):
    """Prompt tokens/s (prompt tokens / time to first token) of each engine, best of --gen-repeats;
    MLX's own ops once (about 35x slower: one run of a 256-token prompt takes half a minute). The
    int8-activation engine is left out: prompts (6+ rows) run the same exact kernels."""
    ids = _long_prompt_ids(tokenizer, args.prompt, args.prompt_tokens)
    best = {}
    for rep in range(args.gen_repeats):
        for label, e in engines.items():
            if label == "mlx_flash_q8x" or (label == "mlx" and rep > 0):
                continue
            use(label)
            t = _mlx_flash_ttft(e["model"], tokenizer, ids)
            best[label] = max(len(ids) / t, best.get(label, 0.0))
    return {"tokens": len(ids), "tps": best, "ids": ids}


def llama_cpp_generation(gguf, threads, ids, max_tokens, repeats, prompt_ids=None) -> dict:
    """llama.cpp (llama-cpp-python) on `gguf`: best decode tokens/s of `repeats` greedy runs (after
    a warm-up), their tokens, and prompt tokens/s on `prompt_ids`. Called in a child process
    (mlx_flash.bench.cap.run_capped), so a llama.cpp crash (e.g. its AMX matmul on some Intel
    machines) is a failed row, not the end of the benchmark."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=2048,
                n_batch=512, verbose=False)
    _llama_cpp_run(llm, ids, min(8, max_tokens))
    best, tokens = 0.0, []
    for _ in range(repeats):
        tps, tokens = _llama_cpp_run(llm, ids, max_tokens)
        best = max(best, tps)
    out = {"generation_tps": best, "tokens": tokens}
    if prompt_ids:
        out["prompt_tps"] = max(len(prompt_ids) / _llama_cpp_ttft(llm, prompt_ids) for _ in range(repeats))
    return out


def _llama_cpp_in_child(gguf, threads, ids, args, prompt_ids) -> tuple:
    """(llama_cpp_generation's result or None, why not): llama.cpp runs in a child process."""
    import importlib.util

    from .cap import run_capped

    if importlib.util.find_spec("llama_cpp") is None:
        return None, ("not installed: `scripts/setup.sh --peers` (or pip install "
                      "'llama-cpp-python>=0.3.16'; compiles llama.cpp, ~10 min)")
    r = run_capped("mlx_flash.bench.kernels:llama_cpp_generation",
                   {"gguf": str(gguf), "threads": threads, "ids": list(ids), "max_tokens": args.max_tokens,
                    "repeats": args.gen_repeats, "prompt_ids": list(prompt_ids or [])},
                   use_cgroup=False, timeout=3600)
    if not r.ok:
        code = (r.error or "").removeprefix("exit code ")
        if code.startswith("-") and code[1:].isdigit():
            import signal

            return None, f"crashed in its child process ({signal.Signals(-int(code)).name})"
        return None, f"failed in its child process: {r.error}"
    return r.value, None


def _llama_cpp_run(llm, ids, max_tokens):
    """One greedy generation of `max_tokens` tokens with llama.cpp -> (tokens/s, tokens)."""
    stamps, tokens = [], []
    llm.reset()
    for tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
        stamps.append(time.perf_counter())
        tokens.append(tok)
        if len(tokens) >= max_tokens:
            break
    return _decode_rate(stamps), tokens


def _generate(args):
    """Decode tokens/s of the `python -m mlx_flash.generate` path (mlx_flash.load, dense) with our
    kernels and with MLX's own ops (kernels off: nothing patched), and of llama.cpp on the same GGUF
    with the same thread count. Runs are interleaved; best of --gen-repeats per engine."""


    source = args.generate or None
    gguf = default_gguf_path() if source is None else Path(source)
    gguf = gguf if gguf.suffix.lower() == ".gguf" and gguf.is_file() else None
    threads = args.threads or ops._ext.num_threads()
    engines = {}
    for label, enabled in (("mlx", False), ("mlx_flash", True)):
        ops.set_kernels_enabled(enabled)
        model, tokenizer = load(source, progress=False)
        patched = sum(type(m).__name__.startswith("Kernel") for _, m in model.named_modules())
        engines[label] = {"model": model, "patched": patched}
    # the same patched model with int8 activations in the quantized matvecs (opt-in: --q8-activations)
    engines["mlx_flash_q8x"] = dict(engines["mlx_flash"])
    ops.set_kernels_enabled(True)

    def use(label):  # kernels off for MLX's own path; int8 activations only for their engine
        ops.set_kernels_enabled(label != "mlx")
        ops.set_q8_activations(label == "mlx_flash_q8x")
    ids = list(encode_prompt(tokenizer, args.prompt))
    results = {"model": str(source or "embedded default"), "gguf": str(gguf) if gguf else None,
               "threads": threads, "kernel_threads": ops._ext.num_threads(),
               "prompt_tokens": len(ids), "max_tokens": args.max_tokens}
    best, tokens, mlx_lm_tps = {}, {}, {}
    for label, e in engines.items():  # warm-up: threads, allocator, compiled graphs
        use(label)
        _mlx_flash_run(e["model"], tokenizer, ids, min(8, args.max_tokens))
    for _ in range(args.gen_repeats):
        for label, e in engines.items():
            use(label)
            tps, toks, own = _mlx_flash_run(e["model"], tokenizer, ids, args.max_tokens)
            mlx_lm_tps[label] = max(own, mlx_lm_tps.get(label, 0.0))
            best[label] = max(tps, best.get(label, 0.0))
            tokens[label] = toks
    prompt_ids = None
    if args.prompt_tokens > 0:
        results["prompt"] = _prompt_speeds(engines, use, tokenizer, args)
        prompt_ids = results["prompt"].pop("ids")
    # llama.cpp last, in its own process (not interleaved with ours: a crash must not end the run)
    llama, why = (_llama_cpp_in_child(gguf, threads, ids, args, prompt_ids) if gguf
                  else (None, "skipped (--generate is not a .gguf file)"))
    results["llama_cpp_missing"] = why
    if llama is not None:
        best["llama.cpp"], tokens["llama.cpp"] = llama["generation_tps"], llama["tokens"]
        engines["llama.cpp"] = {}
        if "prompt_tps" in llama and "prompt" in results:
            results["prompt"]["tps"]["llama.cpp"] = llama["prompt_tps"]
    ops.set_kernels_enabled(True)
    ops.set_q8_activations(False)
    for label, e in engines.items():
        results[label] = {"generation_tps": best[label], "generated_tokens": len(tokens[label])}
        if label in mlx_lm_tps:
            results[label].update(mlx_lm_generation_tps=mlx_lm_tps[label], layers_patched=e["patched"])
    results["same_greedy_tokens_as_mlx"] = tokens["mlx_flash"] == tokens["mlx"]
    results["speedup_over_mlx"] = best["mlx_flash"] / best["mlx"]
    results["q8x_same_greedy_tokens_as_mlx"] = tokens["mlx_flash_q8x"] == tokens["mlx"]
    if "llama.cpp" in best:
        # Greedy decoding agrees until the first near-tie the two numerics break differently, and
        # is then a different text: the shared prefix says more than a count of equal positions.
        results["same_first_tokens_as_llama_cpp"] = _shared_prefix(tokens["llama.cpp"], tokens["mlx_flash"])
        results["q8x_same_first_tokens_as_llama_cpp"] = _shared_prefix(tokens["llama.cpp"], tokens["mlx_flash_q8x"])
        results["fraction_of_llama_cpp"] = best["mlx_flash"] / best["llama.cpp"]
        results["q8x_fraction_of_llama_cpp"] = best["mlx_flash_q8x"] / best["llama.cpp"]
    del engines
    mx.clear_cache()
    return results


def _shared_prefix(a, b):
    """How many tokens two greedy generations share before they first differ."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _print_generate(g):
    print(f"\ngeneration on {g['model']} (greedy, prompt {g['prompt_tokens']} tokens, up to "
          f"{g['max_tokens']} new; decode tokens/s = (n-1) / time from first to last token; best "
          f"of runs taken in turns)")
    print(f"  MLX's own CPU ops (kernels off):  {g['mlx']['generation_tps']:6.1f} tok/s "
          f"({g['mlx']['generated_tokens']} tokens)")
    print(f"  mlx-flash kernels ({g['mlx_flash']['layers_patched']} layers):     "
          f"{g['mlx_flash']['generation_tps']:6.1f} tok/s ({g['mlx_flash']['generated_tokens']} tokens), "
          f"{g['speedup_over_mlx']:.1f}x MLX; same greedy tokens as MLX: {g['same_greedy_tokens_as_mlx']}")
    q = g["mlx_flash_q8x"]
    print(f"  mlx-flash kernels, --q8-activations: {q['generation_tps']:6.1f} tok/s ({q['generated_tokens']} tokens); "
          f"same greedy tokens as MLX: {g['q8x_same_greedy_tokens_as_mlx']}"
          + (f"; {g['q8x_fraction_of_llama_cpp']:.2f}x llama.cpp" if "llama.cpp" in g else ""))
    if "llama.cpp" in g:
        print(f"  llama.cpp ({g['threads']} threads, same GGUF):  {g['llama.cpp']['generation_tps']:6.1f} "
              f"tok/s ({g['llama.cpp']['generated_tokens']} tokens); mlx-flash = "
              f"{g['fraction_of_llama_cpp']:.2f}x llama.cpp (target >= 0.6x); same first "
              f"{g['same_first_tokens_as_llama_cpp']} tokens (--q8-activations: "
              f"{g['q8x_same_first_tokens_as_llama_cpp']})")
    else:
        print(f"  llama.cpp: {g['llama_cpp_missing']}")
    if "prompt" in g:
        tps = g["prompt"]["tps"]
        print(f"prompt processing ({g['prompt']['tokens']}-token prompt; tokens/s = prompt tokens / time to "
              f"the first token; best of runs, MLX's own ops one run; --q8-activations: the same kernels)")
        print(f"  MLX's own CPU ops:  {tps['mlx']:7.1f} tok/s")
        print(f"  mlx-flash kernels:  {tps['mlx_flash']:7.1f} tok/s, {tps['mlx_flash'] / tps['mlx']:.1f}x MLX"
              + (f", {tps['mlx_flash'] / tps['llama.cpp']:.2f}x llama.cpp" if "llama.cpp" in tps else ""))
        if "llama.cpp" in tps:
            print(f"  llama.cpp:          {tps['llama.cpp']:7.1f} tok/s")


def _decode_breakdown(args):
    """Where a decode step's time goes: one step of the dense model (mlx_flash.load, kernels on)
    vs the same step's kernel matvecs alone (every patched layer once, evaluated together), in ms.
    The step runs its matvecs inside the fused blocks' primitives (3 per layer) while the matvecs
    alone are one primitive each, so step - matvecs (the rest: attention, norms, sampling, building
    the graph) is net of that dispatch difference and can come out near zero."""


    ops.set_kernels_enabled(True)
    model, _ = load(args.generate or None, progress=False)
    cache, token = make_prompt_cache(model), mx.array([[1]])
    matvec_classes = (kl.KernelQuantizedLinear, kl.KernelLinear, kl.KernelQuantizedEmbedding, kl.KernelEmbedding)
    layers = [m for _, m in model.named_modules() if isinstance(m, matvec_classes)]
    xs = [mx.random.normal((1, 1, m.weight.shape[1] * 32 // m.bits if hasattr(m, "bits") else m.weight.shape[1]))
          for m in layers]
    mx.eval(xs)

    def step():
        mx.eval(model(token, cache=cache))

    def matvecs():
        mx.eval([m.as_linear(x) if hasattr(m, "as_linear") else m(x) for m, x in zip(layers, xs)])

    def best_ms(fns, n=30, rounds=5):
        """Best ms per call of each function; their rounds alternate, so a slow spell of this shared
        machine hits both (timed one after the other, the difference could even come out negative)."""
        best = [float("inf")] * len(fns)
        for f in fns:
            f()
        for _ in range(rounds):
            for j, f in enumerate(fns):
                t0 = time.perf_counter()
                for _ in range(n):
                    f()
                best[j] = min(best[j], (time.perf_counter() - t0) / n * 1e3)
        return best

    weight_bytes = sum(sum(v.nbytes for k, v in m.parameters().items() if k != "bias") for m in layers)
    step_ms, matvecs_ms = best_ms([step, matvecs])
    out = {"step_ms": step_ms, "matvecs_ms": matvecs_ms, "matvecs": len(layers), "weight_bytes": weight_bytes,
           "build_ms": _build_ms(model, token, cache), "step_primitives": _graph_primitives(model(token, cache=cache))}
    ops.set_kernels_enabled(False)
    try:
        out["step_primitives_mlx"] = _graph_primitives(model(token, cache=cache))
    finally:
        ops.set_kernels_enabled(True)
    out["other_ms"] = out["step_ms"] - out["matvecs_ms"]
    print(f"\ndecode step breakdown ({ops._ext.num_threads()} kernel threads): step {out['step_ms']:.1f} ms; its "
          f"{out['matvecs']} kernel matvecs alone, one primitive each: {out['matvecs_ms']:.1f} ms "
          f"({weight_bytes / 1e6:.0f} MB, {weight_bytes / out['matvecs_ms'] / 1e6:.1f} GB/s); the rest, net of "
          f"the fused blocks' fewer dispatches: {out['other_ms']:.1f} ms; {out['step_primitives']} MLX primitives "
          f"in a step's graph (logits of one token), {out['step_primitives_mlx']} with MLX's own ops; building "
          f"that graph in Python: {out['build_ms']:.2f} ms")
    return out


def _build_ms(model, token, cache, n=30, rounds=5):
    """Best mean ms over rounds of n calls to build one decode step's graph (the Python side of a
    step: mlx-lm's model code and ours), each graph evaluated after its build is timed."""
    best = float("inf")
    for _ in range(rounds):
        spent = 0.0
        for _ in range(n):
            t0 = time.perf_counter()
            out = model(token, cache=cache)
            spent += time.perf_counter() - t0
            mx.eval(out)
        best = min(best, spent / n * 1e3)
    return best


def _graph_primitives(out):
    """How many primitives the graph of `out` holds (its nodes in mx.export_to_dot), None if unknown."""


    if not hasattr(mx, "export_to_dot"):
        return None
    dot = io.StringIO()
    mx.export_to_dot(dot, out)
    return dot.getvalue().count("shape=rectangle")


def run(args):


    if args.metal:
        from .metal import run_metal

        return run_metal(args)
    mx.set_default_device(mx.cpu)
    if not ops.EXTENSION_AVAILABLE:
        print(f"mlx_flash._ext is not available ({ops.EXTENSION_ERROR}); build it with `pip install .`",
              file=sys.stderr)
        return 1
    if args.no_kernels and args.generate is None and not args.breakdown:
        raise FlashError("--no-kernels: only with --generate or --breakdown (otherwise there is nothing to measure)")
    for flag, value, least in (("--max-tokens", args.max_tokens, 1), ("--gen-repeats", args.gen_repeats, 1),
                               ("--prompt-tokens", args.prompt_tokens, 0)):
        if value < least:
            raise FlashError(f"{flag}: must be at least {least}, got {value}")
    load_before = os.getloadavg()
    bw = measure_bandwidth(args.bandwidth_mib)
    bandwidth = max(bw.values())
    print(f"machine: {platform.machine()} {os.cpu_count()} cores, mlx {mx.__version__}, "
          f"kernel threads {ops._ext.num_threads()}, simd {ops._ext.simd_active()}")
    print(f"memory read bandwidth (numpy max / bitwise_or over {args.bandwidth_mib} MiB, best of 5 each): "
          + ", ".join(f"{t} thread{'s' if t > 1 else ''} {v:.1f} GB/s" for t, v in sorted(bw.items())))
    print(f"reference bandwidth: {bandwidth:.1f} GB/s; target >= {TARGET_FRACTION:.0%} of it\n")

    rows = []
    if not args.no_kernels:
        if args.q8_activations:
            print("quantized cases: int8 activations (--q8-activations)")
        ops.set_q8_activations(args.q8_activations)
        try:
            rows = _kernel_table(args, bandwidth)
        finally:
            ops.set_q8_activations(False)
    load_after = os.getloadavg()
    result = {"command": args.command_line, "machine": machine_info(), "packages": package_versions(),
              "kernel_threads": ops._ext.num_threads(),
              "bandwidth_gbs": {str(t): v for t, v in bw.items()}, "reference_bandwidth_gbs": bandwidth,
              "target_fraction": TARGET_FRACTION, "q8_activations": args.q8_activations, "cases": rows}
    if args.breakdown:
        result["decode_breakdown"] = _decode_breakdown(args)
    if args.generate is not None:
        result["generate"] = g = _generate(args)
        _print_generate(g)
        load_after = os.getloadavg()
    result["load_average_before_after"] = [load_before[0], load_after[0]]
    busy = max(load_before[0], load_after[0]) > 0.5
    print(f"\n1-min load average before/after: {load_before[0]:.2f} / {load_after[0]:.2f}"
          + (" -- other processes were using the CPU; figures are pessimistic" if busy else ""))
    print(f"command: {result['command']}")
    if args.json:
        write_json_atomic(args.json, result)
        print(f"saved {args.json}")
    return 0


def _kernel_table(args, bandwidth):
    """Time every case of CASES (filtered by --only), print the table, return the rows."""
    rows = []
    head = f"{'case':22} {'kind':6} {'N x K':>12} {'M':>2} {'KiB/call':>9} {'ours us':>8} {'GB/s':>6} {'of BW':>6}"
    head += f" {'warm GB/s':>9}" if args.warm else ""
    head += "" if args.no_mlx else f" {'MLX us':>9} {'GB/s':>6} {'speedup':>7}"
    print(head)
    for name, kind, n, k, m, opts in CASES:
        if args.only and args.only not in name and args.only not in kind:
            continue
        r = _bench_case(name, kind, n, k, m, opts, args, bandwidth)
        rows.append(r)
        line = (f"{name:22} {kind:6} {f'{n}x{k}':>12} {m:>2} {r['bytes_per_call'] / 1024:>9.1f} "
                f"{r['ours_us']:>8.1f} {r['ours_gbs']:>6.2f} {r['ours_fraction']:>6.0%}")
        if args.warm:
            line += f" {r['warm_gbs']:>9.2f}"
        if not args.no_mlx:
            line += (f" {r['mlx_us']:>9.1f} {r['mlx_gbs']:>6.2f} {r['mlx_us'] / r['ours_us']:>6.1f}x"
                     + ("" if r["mlx_cold"] else " (MLX warm cache)"))
        print(line, flush=True)
    met = sum(r["ours_fraction"] >= TARGET_FRACTION for r in rows)
    print(f"\n{met}/{len(rows)} cases at >= {TARGET_FRACTION:.0%} of measured bandwidth")
    return rows
