"""Per-step runtime statistics of a flash model (the paper's Table 3 split).

A step is one forward pass of the model (the prompt, then one per generated token). I/O and
memory-management times are measured where they happen (loader reads; neuron-cache deletes and
bookkeeping; inside a sparse layer's decode primitive while MLX evaluates it, counted into its
step by `settle`); compute is the rest of the step's wall time (attention, FFN matmuls,
predictors, lm_head, sampling), so io + mem + compute = wall time.
"""

import resource
import sys
import time
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ..cpu.ops import DECODE_COUNTERS


@dataclass
class StepStats:
    """One forward pass. Times in seconds, sizes in bytes, counts in neurons."""
    tokens: int
    start: float
    end: float | None = None
    io_s: float = 0.0  # waited for reads (prefetched reads: only the part not hidden by compute)
    io_read_s: float = 0.0  # loader time of this step's reads, hidden or not
    decode_s: float = 0.0  # ENDOR crc32 check + decode, inside io_s / io_read_s (not extra time)
    io_eval_s: float = 0.0  # of io_s: reads inside MLX's evaluations (the sparse-decode primitive's)
    mem_s: float = 0.0
    bytes_read: int = 0
    neurons_loaded: int = 0
    neurons_needed: int = 0
    hits: int = 0
    window: list = field(default_factory=list)  # effective window per flash layer (tokens)
    layers: dict = field(default_factory=dict)  # layer -> LayerStep: this pass's share of the counters

    @property
    def wall_s(self) -> float:
        return (self.end or time.perf_counter()) - self.start

    def counters(self) -> tuple:
        """The per-layer counters' values now (add_layer takes the difference)."""
        return tuple(getattr(self, k) for k in LAYER_COUNTERS)

    def add_layer(self, layer: int, kind: str, before: tuple, call_s: float):
        """Record one FFN call: what the counters grew by since `before` and its wall seconds."""
        grown = {k: getattr(self, k) - b for k, b in zip(LAYER_COUNTERS, before)}
        self.layers[layer] = LayerStep(kind, call_s=call_s, **grown)


LAYER_COUNTERS = ("io_s", "mem_s", "bytes_read", "neurons_loaded", "neurons_needed", "hits")


@dataclass
class LayerStep:
    """One layer's FFN call in one pass. Seconds, bytes, neurons. call_s: wall time of the call,
    which includes its reads and, for a sparse layer, its one host sync (evaluating the lazy work
    of the layers before it: their attention and FFN compute)."""
    kind: str
    io_s: float = 0.0
    mem_s: float = 0.0
    bytes_read: int = 0
    neurons_loaded: int = 0
    neurons_needed: int = 0
    hits: int = 0
    call_s: float = 0.0


class FlashStats:
    """Collects StepStats; `summary()` gives per-token means. Available as `model.flash_stats`."""

    def __init__(self, plan=None):
        self.plan = plan  # budget.MemoryPlan of the model
        self.reset()

    def reset(self):
        """Forget all steps and restart MLX's peak-memory counter."""
        self.steps: list[StepStats] = []
        self._last_layer = None
        self._deferred: list[tuple] = []  # (step index, layer, counters, then): defer's, not yet settled
        mx.reset_peak_memory()

    def defer(self, layer: int, counters, then=None) -> None:
        """Count a call of `layer` in the current step whose work runs when its graph is evaluated
        (the sparse-decode primitive): `counters` is its lazy int64 output (ops.DECODE_COUNTERS),
        added to the step and its layer by settle(), which then calls then(step index, {name:
        value}) for whoever else counts that work (the neuron cache's rows, a read log)."""
        self._deferred.append((len(self.steps) - 1, layer, counters, then))

    def settle(self, keep_last: int = 0) -> None:
        """Add the deferred counters to their steps, all but those of the last `keep_last` steps
        (still being evaluated, maybe: reading them would wait for them)."""
        keep = []
        for entry in self._deferred:
            index, layer, counters, then = entry
            if index >= len(self.steps) - keep_last:
                keep.append(entry)
                continue
            step = self.steps[index]
            v = dict(zip(DECODE_COUNTERS, np.array(counters).tolist()))
            grown = {"io_s": v["io_ns"] * 1e-9, "mem_s": v["mem_ns"] * 1e-9, "bytes_read": v["bytes"],
                     "neurons_loaded": v["loaded"], "neurons_needed": v["needed"], "hits": v["hits"]}
            for k, g in grown.items():
                setattr(step, k, getattr(step, k) + g)
            step.io_read_s += v["io_ns"] * 1e-9
            step.io_eval_s += v["io_ns"] * 1e-9
            step.window.append(v["window"])
            row = step.layers.get(layer)
            if row is not None:
                for k, g in grown.items():
                    setattr(row, k, getattr(row, k) + g)
                row.call_s += v["call_ns"] * 1e-9
            if then is not None:
                then(index, v)
        self._deferred = keep

    def enter_layer(self, layer: int, tokens: int) -> StepStats:
        """Called by each FFN module; a layer index not above the previous one starts a step."""
        if self._last_layer is None or layer <= self._last_layer:
            if len(self._deferred) > 256:  # settle as it goes, not the step in flight or the one before it
                self.settle(keep_last=2)
            now = time.perf_counter()
            if self.steps and self.steps[-1].end is None:
                self.steps[-1].end = now
            self.steps.append(StepStats(tokens=tokens, start=now))
        self._last_layer = layer
        return self.steps[-1]

    def finish(self):
        """Close the current step (call after the last token is evaluated)."""
        if self.steps and self.steps[-1].end is None:
            self.steps[-1].end = time.perf_counter()
        self._last_layer = None
        self.settle()

    def summary(self) -> dict:
        """Per-token means over single-token (decode) steps, the prompt step(s) separately.

        Keys: tokens, io_ms, decode_ms (ENDOR check + decode, part of io_ms), mem_ms, compute_ms,
        total_ms, bytes_read, neurons_loaded, hit_rate,
        window (mean effective window, flash only), prompt_tokens, prompt_ms, prompt_bytes_read,
        peak_memory (bytes, MLX allocator), peak_rss (bytes, whole process), budget, weights_bytes,
        layers (layer_summary: the same per layer).
        """
        self.settle()
        decode = [s for s in self.steps if s.tokens == 1 and s.end is not None]
        prompt = [s for s in self.steps if s.tokens > 1 and s.end is not None]
        n = max(1, len(decode))

        def mean(f):
            return sum(f(s) for s in decode) / n

        needed = sum(s.neurons_needed for s in decode)
        windows = [w for s in decode for w in s.window]
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out = {
            "tokens": len(decode),
            "io_ms": 1e3 * mean(lambda s: s.io_s),
            "io_read_ms": 1e3 * mean(lambda s: s.io_read_s),
            "decode_ms": 1e3 * mean(lambda s: s.decode_s),
            "mem_ms": 1e3 * mean(lambda s: s.mem_s),
            "compute_ms": 1e3 * mean(lambda s: s.wall_s - s.io_s - s.mem_s),
            "total_ms": 1e3 * mean(lambda s: s.wall_s),
            "bytes_read": mean(lambda s: s.bytes_read),
            "neurons_loaded": mean(lambda s: s.neurons_loaded),
            "hit_rate": sum(s.hits for s in decode) / needed if needed else None,
            "window": sum(windows) / len(windows) if windows else None,
            "prompt_tokens": sum(s.tokens for s in prompt),
            "prompt_ms": 1e3 * sum(s.wall_s for s in prompt),
            "prompt_bytes_read": sum(s.bytes_read for s in prompt),
            "peak_memory": mx.get_peak_memory(),
            "peak_rss": rss if sys.platform == "darwin" else rss * 1024,
            "budget": self.plan.budget if self.plan else None,
            "weights_bytes": self.plan.weights if self.plan else None,
            "layers": self.layer_summary(),
        }
        return out

    def layer_summary(self) -> dict:
        """{layer: per-token means over the decode steps}: kind, cache_rows (the plan's, sparse
        layers), needed (neurons), hit_rate, loaded (neurons read), mb_read, io_ms, mem_ms,
        call_ms (LayerStep.call_s), plan_io_ms (the read ms per token the flash plan priced for
        the layer's option; None without a per-layer plan)."""
        self.settle()
        decode = [s for s in self.steps if s.tokens == 1 and s.end is not None]
        out = {}
        for layer in sorted({i for s in decode for i in s.layers}):
            rows = [s.layers[layer] for s in decode if layer in s.layers]
            n, needed = len(rows), sum(r.neurons_needed for r in rows)
            rows_held = self.plan.capacity.get(layer) if self.plan is not None else None
            priced = (self.plan.layer_read_s or {}).get(layer) if self.plan is not None else None
            out[layer] = {"kind": rows[-1].kind, "cache_rows": rows_held, "needed": needed / n,
                          "hit_rate": sum(r.hits for r in rows) / needed if needed else None,
                          "loaded": sum(r.neurons_loaded for r in rows) / n,
                          "mb_read": sum(r.bytes_read for r in rows) / n / 1e6,
                          "io_ms": 1e3 * sum(r.io_s for r in rows) / n,
                          "mem_ms": 1e3 * sum(r.mem_s for r in rows) / n,
                          "call_ms": 1e3 * sum(r.call_s for r in rows) / n,
                          "plan_io_ms": None if priced is None else 1e3 * priced}
        return out

    def format(self) -> str:
        """The --stats lines."""
        s = self.summary()
        gb = 1e9
        lines = [f"Per token ({s['tokens']} tokens): I/O {s['io_ms']:.2f} ms, memory management "
                 f"{s['mem_ms']:.2f} ms, compute {s['compute_ms']:.2f} ms, total {s['total_ms']:.2f} ms",
                 f"Per token: {s['bytes_read'] / 1e6:.3f} MB read, {s['neurons_loaded']:.0f} neurons "
                 f"loaded, cache hit rate "
                 + ("n/a" if s["hit_rate"] is None else f"{100 * s['hit_rate']:.1f}%")
                 + ("" if s["window"] is None else f", mean effective window {s['window']:.2f} tokens"),
                 f"Prompt: {s['prompt_tokens']} tokens in {s['prompt_ms']:.1f} ms, "
                 f"{s['prompt_bytes_read'] / 1e6:.2f} MB read",
                 f"Peak memory: {s['peak_memory'] / gb:.3f} GB (MLX), {s['peak_rss'] / gb:.3f} GB "
                 f"(process RSS)"]
        if self.plan is not None:
            lines.append(f"Memory plan: {self.plan.describe()}; weights held "
                         f"{s['weights_bytes'] / gb:.3f} GB")
        return "\n".join(lines)
