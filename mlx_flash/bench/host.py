"""Where a decode token's time goes on the host: the waits for MLX's evaluations (by call site),
the waits for reads, and the host work between them, wall and main-thread CPU per token.

  taskset -c 0 python -m mlx_flash.bench host --model PACK --mode flash --memory-budget 0.65

One process, one mode: the pack is loaded, a prompt from --text prefilled, --warmup tokens
decoded, then --tokens timed decode tokens (greedy). During the timed tokens mx.eval, the AIO
loop's wait and the flash runtime's host steps are wrapped with timers (wall and
time.thread_time, the main thread's CPU); "host" is the wall time outside every eval and read
wait: Python, numpy and graph building between them; "reads in them": the read time the flash
steps counted inside evaluations (StepStats.io_eval_s: a sparse layer's decode primitive reads there). Spans nest (a layer's call holds its reads
and its evals), so rows do not add up; the first three rows do (plus host = wall). The timers
cost about a microsecond per call: compare modes and versions with this command, not with
`bench run`'s totals.
"""

import collections
import sys
import time

from ..paths import write_json_atomic


def add_arguments(parser):
    parser.add_argument("--model", required=True, help="flash pack (or any --model value for --mode dense)")
    parser.add_argument("--mode", default="flash", help="dense, naive, hybrid or flash (default flash)")
    parser.add_argument("--memory-budget", default=None, help="budget for naive/hybrid/flash (e.g. 0.65)")
    parser.add_argument("--window", type=int, default=5, help="flash window (tokens, default 5)")
    parser.add_argument("--text", nargs="+", default=None,
                        help="prompt text files (default: a fixed English sentence, repeated)")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="prompt length (default 128)")
    parser.add_argument("--warmup", type=int, default=4, help="untimed decode tokens first (default 4)")
    parser.add_argument("--tokens", type=int, default=24, help="timed decode tokens (default 24)")
    parser.add_argument("--json", default=None, help="save the figures to this file")


def _prompt_ids(tokenizer, files, n):
    from pathlib import Path

    from ..errors import FlashError

    if files:
        for f in files:
            if not Path(f).is_file():
                raise FlashError(f"--text {f}: no such file")
        text = "\n".join(Path(f).read_text(errors="replace") for f in files)
    else:
        text = "The flash loader reads bundles of neurons straight into the neuron cache. " * 64
    ids = tokenizer.encode(text)[:n]
    if len(ids) < 2:
        raise FlashError("--text: fewer than 2 tokens of prompt")
    return ids


class Spans:
    """Wall and main-thread CPU seconds and calls per label, from wrapped callables."""

    def __init__(self):
        self.wall, self.cpu, self.calls = collections.Counter(), collections.Counter(), collections.Counter()
        self.on, self._undo = False, []

    def add(self, label, wall, cpu):
        if self.on:
            self.wall[label] += wall
            self.cpu[label] += cpu
            self.calls[label] += 1

    def wrap(self, owner, name, label=None):
        """Time owner.name (a function or method) as `label`; undone by restore()."""
        real = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        label = label or f"{getattr(owner, '__name__', owner)}.{name}"

        def timed(*args, **kwargs):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return real(*args, **kwargs)
            finally:
                self.add(label, time.perf_counter() - t0, time.thread_time() - c0)

        setattr(owner, name, timed)
        self._undo.append((owner, name, real))

    def wrap_eval(self, mx):
        """Time mx.eval by its caller (function:line)."""
        real = mx.eval

        def timed(*args):
            frame = sys._getframe(1)
            label = f"mx.eval at {frame.f_code.co_name}:{frame.f_lineno}"
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return real(*args)
            finally:
                self.add(label, time.perf_counter() - t0, time.thread_time() - c0)

        mx.eval = timed
        self._undo.append((mx, "eval", real))

    def restore(self):
        for owner, name, real in reversed(self._undo):
            setattr(owner, name, real)
        self._undo = []


def _wrap_runtime(spans):
    """Wrap the AIO wait and the flash runtime's host steps (those that exist in this version)."""
    from ..io import aio, loader
    from ..sparse import ffn, neuron_cache

    # the AIO loop's blocking calls: reads in flight (read_staged, read_ids: with their checks and copy out)
    for name in ("read_all", "read_staged", "read_ids", "wait"):
        if name in getattr(aio, "AioContext", object).__dict__:
            spans.wrap(aio.AioContext, name, f"read wait (AioContext.{name})")
    # the read path's host steps (those of this version): per-call preparation, planning, checks, copies
    for name in ("read_many", "read_at_once", "plan", "start_read", "finish_read", "_prepare", "_aio_batch",
                 "_landed_crcs", "_read_staged", "_after_reads", "_scatter", "_finish"):
        if name in loader.FlashLoader.__dict__:
            spans.wrap(loader.FlashLoader, name, f"FlashLoader.{name}")
    spans.wrap(neuron_cache.NeuronCache, "update", "NeuronCache.update")
    for name in ("__call__", "_sparse", "_run_sets"):
        spans.wrap(ffn.FlashFFN, name, f"FlashFFN.{name}")


def measure(pack, mode, budget, window, files, prompt_tokens, warmup, tokens) -> dict:
    """Per decode token (ms): wall, main-thread CPU, process CPU, and per span wall / CPU / calls."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    import mlx_flash

    model, tokenizer = mlx_flash.load(pack, mode=mode, memory_budget=budget, window=window, progress=False)
    ids = _prompt_ids(tokenizer, files, prompt_tokens)
    cache = make_prompt_cache(model)
    logits = model(mx.array([ids]), cache=cache)
    y = mx.argmax(logits[:, -1, :], axis=-1)
    mx.eval(y)

    def step(y):
        y = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)
        mx.eval(y)
        return y

    for _ in range(warmup):
        y = step(y)
    spans = Spans()
    spans.wrap_eval(mx)
    if mode != "dense":
        _wrap_runtime(spans)
    stats = getattr(model, "flash_stats", None)
    first = len(stats.steps) if stats is not None else 0
    try:
        spans.on = True
        w0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        for _ in range(tokens):
            y = step(y)
        wall, cpu, proc = time.perf_counter() - w0, time.thread_time() - c0, time.process_time() - p0
        spans.on = False
        if stats is not None:
            stats.finish()  # settles what the decode primitives counted
    finally:
        spans.restore()
        rt = getattr(model, "flash_runtime", None)
        if rt is not None:
            rt.close()
    per = 1e3 / tokens
    waits = sum(v for k, v in spans.wall.items() if k.startswith(("mx.eval", "read wait")))
    in_evals = sum(s.io_eval_s for s in stats.steps[first:]) if stats is not None else 0.0
    rows = [{"span": k, "wall_ms": v * per, "cpu_ms": spans.cpu[k] * per, "calls": spans.calls[k] / tokens}
            for k, v in sorted(spans.wall.items(), key=lambda kv: -kv[1])]
    return {"mode": mode, "tokens": tokens, "wall_ms": wall * per, "main_cpu_ms": cpu * per,
            "process_cpu_ms": proc * per, "host_ms": (wall - waits) * per,
            "eval_ms": sum(v for k, v in spans.wall.items() if k.startswith("mx.eval")) * per,
            "read_wait_ms": sum(v for k, v in spans.wall.items() if k.startswith("read wait")) * per,
            "eval_read_ms": in_evals * per,  # the steps' reads inside evaluations (StepStats.io_eval_s)
            "spans": rows}


def markdown(result) -> str:
    r = result
    lines = [f"{r['mode']}: {r['wall_ms']:.1f} ms/token wall = evals {r['eval_ms']:.1f} (reads in them "
             f"{r['eval_read_ms']:.1f}) + read waits "
             f"{r['read_wait_ms']:.1f} + host {r['host_ms']:.1f}; main-thread CPU {r['main_cpu_ms']:.1f}, "
             f"process CPU {r['process_cpu_ms']:.1f} ms/token ({r['tokens']} tokens)",
             "", "| span | wall ms/token | main-thread CPU ms/token | calls/token |", "|---|---|---|---|"]
    lines += [f"| {s['span']} | {s['wall_ms']:.2f} | {s['cpu_ms']:.2f} | {s['calls']:.1f} |" for s in r["spans"]]
    return "\n".join(lines)


def run(args):
    from ..config import parse_memory_budget
    from ..errors import FlashError

    if args.mode not in ("dense", "naive", "hybrid", "flash"):
        raise FlashError(f"--mode {args.mode}: expected dense, naive, hybrid or flash")
    if args.tokens < 1 or args.warmup < 0 or args.prompt_tokens < 2:
        raise FlashError("--tokens must be >= 1, --warmup >= 0 and --prompt-tokens >= 2")
    budget = None
    if args.memory_budget is not None and args.mode != "dense":
        budget = parse_memory_budget(args.memory_budget, "--memory-budget")
    result = measure(args.model, args.mode, budget, args.window, args.text, args.prompt_tokens,
                     args.warmup, args.tokens)
    result["command"] = args.command_line
    print(f"command: {args.command_line}")
    print(markdown(result))
    if args.json:
        write_json_atomic(args.json, result)
    return 0
