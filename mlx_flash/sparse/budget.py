"""Memory-budget accounting for a flash pack (all sizes in bytes).

What stays in memory per mode:
    dense   resident tensors + every layer's FFN
    naive   resident tensors + one streaming buffer (one layer's neurons) + loader staging
    hybrid  naive + as many whole layers' FFNs as fit (no streaming buffer when all fit)
    flash   naive + predictors + one neuron cache per layer (`capacity` rows each)
The streaming buffer holds one layer's neurons while they are used (naive / hybrid layers, and in
flash mode the predicted neurons that did not fit in a layer's cache); the staging area is the
loader's page-aligned bounce buffer for the same reads.
"""

import math
from dataclasses import dataclass, field

from ..errors import FlashError
from ..flash_config import parse_memory_budget


def row_bytes(entry) -> int:
    """In-memory bytes of one neuron of a layer (all its bundle components)."""
    return sum(c["length"] for c in entry["components"])


def layer_bytes(entry) -> int:
    """In-memory bytes of one layer's whole FFN."""
    return entry["count"] * row_bytes(entry)


def pack_bytes(manifest) -> int:
    """Bytes of the model's weights in the pack: resident file + every layer's bundles."""
    return manifest["resident"]["length"] + sum(b["count"] * b["stride"] for b in manifest["bundles"])


def stream_bytes(manifest) -> int:
    """Streaming buffer (largest layer) + loader staging for reading it whole."""
    return max((layer_bytes(b) + b["count"] * b["stride"] for b in manifest["bundles"]), default=0)


def fmt_bytes(n) -> str:
    """Human-readable size (decimal units, as --memory-budget reads them)."""
    if n >= 1e9:
        return f"{n / 1e9:.2f} GB"
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


@dataclass
class MemoryPlan:
    """How the budget is spent. `resident_layers`: layers whose whole FFN stays in memory;
    `capacity`: neuron-cache rows per layer (flash); `streaming`: a streaming buffer is needed."""
    mode: str
    budget: int | None
    pack: int
    resident: int
    predictors: int = 0
    stream: int = 0
    resident_layers: list = field(default_factory=list)
    capacity: dict = field(default_factory=dict)
    layer_bytes: dict = field(default_factory=dict)
    row_bytes: dict = field(default_factory=dict)

    @property
    def weights(self) -> int:
        """Bytes of weights held in memory under this plan."""
        return (self.resident + self.predictors + self.stream
                + sum(self.layer_bytes[i] for i in self.resident_layers)
                + sum(self.capacity[i] * self.row_bytes[i] for i in self.capacity))

    def describe(self) -> str:
        parts = [f"resident {fmt_bytes(self.resident)}"]
        if self.predictors:
            parts.append(f"predictors {fmt_bytes(self.predictors)}")
        if self.stream:
            parts.append(f"streaming buffer {fmt_bytes(self.stream)}")
        if self.resident_layers:
            parts.append(f"{len(self.resident_layers)}/{len(self.layer_bytes)} layer FFNs resident")
        if self.capacity:
            frac = sum(self.capacity.values()) / max(1, sum(
                self.layer_bytes[i] // self.row_bytes[i] for i in self.capacity))
            parts.append(f"neuron caches {100 * frac:.1f}% of FFN rows")
        budget = fmt_bytes(self.budget) if self.budget else "none"
        return f"mode {self.mode}, budget {budget} of pack {fmt_bytes(self.pack)}: " + ", ".join(parts)


def resolve_budget(value, manifest) -> int | None:
    """--memory-budget (fraction of the pack or size) -> bytes, None for no limit."""
    parsed = parse_memory_budget(value)
    if parsed is None:
        return None
    kind, amount = parsed
    return int(amount * pack_bytes(manifest)) if kind == "fraction" else amount


def plan_memory(manifest, mode: str, budget, *, predictor_bytes=0, requested_capacity=None) -> MemoryPlan:
    """Split `budget` (--memory-budget value) for `mode`; FlashError if it is below the minimum.

    requested_capacity: {layer: rows} for flash (calibrated Req_i for the window); without it the
    budget left after the fixed parts is spread evenly over the layers.
    """
    bundles = {b["layer"]: b for b in manifest["bundles"]}
    plan = MemoryPlan(mode, resolve_budget(budget, manifest), pack_bytes(manifest),
                      manifest["resident"]["length"],
                      layer_bytes={i: layer_bytes(b) for i, b in bundles.items()},
                      row_bytes={i: row_bytes(b) for i, b in bundles.items()})
    everything = plan.resident + sum(plan.layer_bytes.values())
    if mode == "dense" or (mode == "hybrid" and (plan.budget is None or plan.budget >= everything)):
        plan.resident_layers = sorted(bundles)
        _check_minimum(plan, "every weight resident")
        return plan
    plan.stream = stream_bytes(manifest)
    if mode == "flash":
        plan.predictors = predictor_bytes
    _check_minimum(plan, "streaming one layer at a time")
    room = None if plan.budget is None else plan.budget - plan.weights
    if mode == "hybrid":
        for i in sorted(bundles):
            if plan.layer_bytes[i] > room:
                break
            plan.resident_layers.append(i)
            room -= plan.layer_bytes[i]
    elif mode == "flash":
        full = {i: b["count"] for i, b in bundles.items()}
        want = {i: min(full[i], int(requested_capacity.get(i, full[i]))) for i in full} \
            if requested_capacity else dict(full)
        want_bytes = sum(want[i] * plan.row_bytes[i] for i in want)
        if room is not None and want_bytes > room:
            if requested_capacity:
                scale = room / want_bytes
                want = {i: int(want[i] * scale) for i in want}
            else:
                per_layer = room // len(want)
                want = {i: min(full[i], per_layer // plan.row_bytes[i]) for i in want}
        plan.capacity = want
    return plan


def _check_minimum(plan: MemoryPlan, what: str):
    if plan.budget is not None and plan.budget < plan.weights:
        raise FlashError(f"--memory-budget {fmt_bytes(plan.budget)}: below the minimum resident set "
                         f"of mode {plan.mode}, {fmt_bytes(plan.weights)} ({what}: {plan.describe()}); "
                         f"give at least {math.ceil(100 * plan.weights / plan.pack) / 100:.2f} of the pack or "
                         f"{fmt_bytes(plan.weights)}")
