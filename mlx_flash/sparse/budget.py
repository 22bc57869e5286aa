"""Memory-budget accounting for a flash pack (all sizes in bytes).

What stays in memory per mode:
    dense   resident tensors + every layer's FFN
    naive   resident tensors + one streaming buffer (one layer's neurons) + loader staging
    hybrid  naive + as many whole layers' FFNs as fit (no streaming buffer when all fit decoded);
            ENDOR layers count their encoded bytes: as many layers as fit are held encoded (and
            decoded into the streaming buffer each time they run), then as many of those as the
            room left allows are held decoded instead (no decode per token)
    flash   naive + predictors + one neuron cache per layer (`capacity` rows each)
The streaming buffer holds one layer's neurons while they are used (naive / hybrid layers, and in
flash mode the predicted neurons that did not fit in a layer's cache); the staging area is the
loader's page-aligned bounce buffer for the same reads.

Flash mode with a budget and calibrated predicted densities plans each layer (`plan_flash_layers`):
    resident  the whole FFN stays in memory (as in hybrid)
    sparse    predictor + neuron cache; only predicted neurons are read
    streamed  the whole FFN is read every token, prefetched by a background reader into a ring of
              two streaming buffers while the previous layers compute (no predictor held)
choosing for every layer the option that minimises the expected read time per token (the loader's
cost model on the bytes and requests each option issues) within the budget. A predictor that marks
most neurons active saves no reads (bundles of ~1 KB merge into whole-layer reads), so such layers
are streamed or kept resident and the plan is never worse than hybrid's whole-layer choice.
"""

import math
from dataclasses import dataclass, field
from types import SimpleNamespace

import mlx.core as mx
import numpy as np

from ..config import MemoryBudget, param_named
from ..errors import FlashError
from ..io.files import huge_page_bytes
from ..io.planner import DEFAULT_MAX_READ, ReadPlan, plan_read_arrays
from .neuron_cache import NeuronCache


def row_bytes(entry) -> int:
    """In-memory bytes of one neuron of a layer (all its bundle components)."""
    return sum(c.length for c in entry.components)


def layer_bytes(entry) -> int:
    """In-memory bytes of one layer's whole FFN."""
    return entry.count * row_bytes(entry)


def encoded_bytes(entry, alignment=4096) -> int:
    """In-memory bytes of one layer's whole FFN held as stored (ENDOR: the `alignment`-rounded
    range of its encoded bundles that FlashLoader.read_encoded reads, in a buffer allocated one
    `alignment` larger to start aligned, plus their int64 offsets); a dense layer's decoded bytes."""
    if entry.encoding != "endor":
        return layer_bytes(entry)
    r0 = entry.offset // alignment * alignment
    r1 = -(-(entry.offset + entry.length) // alignment) * alignment
    return r1 - r0 + alignment + 8 * (entry.count + 1)


def resident_bytes(manifest) -> int:
    """In-memory bytes of the resident tensors (ENDOR-encoded ones count decoded)."""
    res = manifest.resident
    return res.memory_length if res.memory_length is not None else res.length


def pack_bytes(manifest) -> int:
    """Bytes of the model's weights in the pack: resident file + every layer's bundles."""
    return manifest.resident.length + sum(b.count * b.stride for b in manifest.bundles)


def stream_bytes(manifest) -> int:
    """Streaming buffer (largest layer) + loader staging for reading it whole (its buffer's
    whole huge pages: io.files.huge_page_bytes)."""
    return max((layer_bytes(b) + huge_page_bytes(b.count * b.stride) for b in manifest.bundles), default=0)


def overflow_sizes(manifest, overflow_rows: int) -> tuple:
    """(buffer rows, staged bytes per read call) of a streaming buffer for sparse overflow only:
    `overflow_rows` rows (at most a layer's count) and loader calls staging at most those rows'
    bytes, or one largest planned read (max_read + alignment on both sides) when that is more."""
    rows = max(1, int(overflow_rows))
    stage = max((min(rows, b.count) * b.stride for b in manifest.bundles), default=0)
    return rows, max(stage, DEFAULT_MAX_READ + 2 * manifest.alignment)


def overflow_bytes(manifest, overflow_rows: int) -> int:
    """Streaming buffer of `overflow_rows` rows (largest row size) + the staging its reads use
    (overflow_sizes): what a plan whose non-resident layers are all sparse holds for overflow."""
    rows, stage = overflow_sizes(manifest, overflow_rows)
    return max((min(rows, b.count) * row_bytes(b) for b in manifest.bundles), default=0) + huge_page_bytes(stage)


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
    encoded_layers: list = field(default_factory=list)  # hybrid: whole FFNs held ENDOR-encoded
    capacity: dict = field(default_factory=dict)
    streamed_layers: list = field(default_factory=list)  # flash: whole layers, prefetched
    expected_read_s: float | None = None  # flash plans: the cost model's read seconds per token
    layer_read_s: dict = field(default_factory=dict)  # flash plans: {layer: its option's read seconds per token}
    prefetch: bool = False  # flash: streamed layers are read ahead into a ring of two buffers
    # flash, every non-resident layer sparse or prefetched: the streaming buffer holds this many
    # rows (sparse overflow) and main-thread reads stage at most overflow_stage bytes per call;
    # None: a whole layer (stream_bytes)
    overflow_rows: int | None = None
    overflow_stage: int | None = None
    layer_bytes: dict = field(default_factory=dict)
    encoded_bytes: dict = field(default_factory=dict)
    row_bytes: dict = field(default_factory=dict)
    budget_param: str = "budget"  # what the caller called the budget (errors name it)
    lookahead: int = 0  # flash: bytes of the lookahead buffers and their reader's staging

    def budget_named(self) -> str:
        """`--memory-budget 1.2 MB` / `memory_budget='1.2 MB'`: the budget as errors show it."""
        return param_named(self.budget_param, fmt_bytes(self.budget))

    @property
    def weights(self) -> int:
        """Bytes of weights held in memory under this plan."""
        return (self.resident + self.predictors + self.stream + self.lookahead
                + sum(self.layer_bytes[i] for i in self.resident_layers)
                + sum(self.encoded_bytes[i] for i in self.encoded_layers)
                + sum(self.capacity[i] * self.row_bytes[i] for i in self.capacity))

    def describe(self) -> str:
        parts = [f"resident {fmt_bytes(self.resident)}"]
        if self.predictors:
            parts.append(f"predictors {fmt_bytes(self.predictors)}")
        if self.stream:
            parts.append(f"streaming buffer {fmt_bytes(self.stream)}")
        if self.lookahead:
            parts.append(f"lookahead buffers {fmt_bytes(self.lookahead)}")
        if self.resident_layers or self.encoded_layers:
            held = len(self.resident_layers) + len(self.encoded_layers)
            parts.append(f"{held}/{len(self.layer_bytes)} layer FFNs resident"
                         + (f" ({len(self.encoded_layers)} ENDOR-encoded)" if self.encoded_layers else ""))
        if self.streamed_layers:
            parts.append(f"{len(self.streamed_layers)} streamed whole"
                         + (" with prefetch" if self.prefetch else ""))
        if self.mode == "flash" and (self.resident_layers or self.streamed_layers):
            parts.append(f"{len(self.capacity)} sparse (predictor + neuron cache)")
        if self.capacity:
            frac = sum(self.capacity.values()) / max(1, sum(
                self.layer_bytes[i] // self.row_bytes[i] for i in self.capacity))
            parts.append(f"neuron caches {100 * frac:.1f}% of FFN rows")
        budget = fmt_bytes(self.budget) if self.budget else "none"
        return f"mode {self.mode}, budget {budget} of pack {fmt_bytes(self.pack)}: " + ", ".join(parts)


def resolve_budget(budget: MemoryBudget | int | None, manifest) -> int | None:
    """A MemoryBudget (fraction of the pack or size) or bytes -> bytes, None for no limit."""
    if isinstance(budget, MemoryBudget):
        return budget.bytes_for(pack_bytes(manifest))
    return budget


def budget_param(budget) -> str:
    """What the caller called the budget, for errors: --memory-budget, memory_budget= or budget."""
    return budget.param if isinstance(budget, MemoryBudget) else "budget"


def planned_read_sizes(loader, layer: int, ids) -> np.ndarray:
    """Bytes of each read the loader issues for the neurons `ids` (sorted neuron indices in the
    pack's order) of `layer` in one call: its planner's merged, aligned reads."""
    entry = loader.entry(layer)
    ids = np.asarray(ids, np.int64)
    if len(ids) == 0:
        return np.zeros(0, np.int64)
    r0, r1, _ = plan_read_arrays(entry.offset + ids * entry.stride, entry.stride, align=loader.alignment,
                                 cost=_plan_cost(loader), max_read=loader.max_read)
    return np.asarray(r1 - r0, np.int64)


def call_seconds(cost, reads: float, nbytes: float) -> float:
    """Seconds one loader call of `reads` reads of `nbytes` bytes in all takes by the cost model:
    a measured curve (io.read_cost.ReadCostCurve) priced at the reads that call has in flight,
    min(reads, the loader's depth), at their mean size (a whole 3.5 MB layer is 4 reads of 1 MiB:
    at depth 4 the curve's 1 MiB read costs 1.3x its depth-32 price on this disk); a straight line
    (planner.ReadCost) per read; none: bytes / 1 GB/s."""
    if reads <= 0:
        return 0.0
    if cost is None:
        return float(nbytes) / 1e9
    size = float(nbytes) / reads
    if hasattr(cost, "at_depth"):
        depth = max(1, min(int(round(reads)), int(cost.depth)))
        return float(reads * _curve_at(cost, depth).seconds(size))
    return float(reads * cost.seconds(size))


def _curve_at(cost, depth: int):
    """cost.at_depth(depth), kept per curve and depth (each builds an interpolated row)."""
    cache = cost.__dict__.setdefault("_at_depth", {}) if hasattr(cost, "__dict__") else {}
    if depth not in cache:
        cache[depth] = cost if depth == cost.depth else cost.at_depth(depth)
    return cache[depth]


def set_read_seconds(loader, layer: int, ids) -> float:
    """Seconds to read the neurons `ids` (sorted neuron indices in the pack's order) of `layer` in
    one loader call: its planner's merged, aligned reads, priced by call_seconds (the cost model
    at that call's reads in flight; without one: bytes / 1 GB/s)."""
    sizes = planned_read_sizes(loader, layer, ids)
    return call_seconds(_plan_cost(loader), len(sizes), float(np.sum(sizes)))


def measured_read_seconds(loader, layer: int, predicted: np.ndarray, max_window: int,
                          tokens: int = 64) -> dict:
    """What a sparse layer reads per token, priced on real predictions: `predicted` bool
    [consecutive tokens, n_neurons] (the predictor's masks in the pack's order, e.g. calibration's
    held-out tokens). With a neuron cache of window w, token t reads the neurons predicted for t
    and for none of the w - 1 tokens before it. Returns {"window_s": [mean seconds per token for
    w = 1..max_window over the last `tokens` tokens], "whole_s": seconds to read the whole layer,
    "window_reads": [[mean reads, mean bytes] per token for each w]}: seconds from
    set_read_seconds (the same planner and cost model); the reads and bytes are the planner's
    real read sizes, which the memory plan prices again with the machine's current cost model."""
    predicted = np.asarray(predicted, bool)
    n_tok = len(predicted)
    first = max(0, n_tok - tokens)
    window_s, window_reads = [], []
    for w in range(1, max_window + 1):
        secs, reads = [], []
        for t in range(first, n_tok):
            seen = predicted[max(0, t - w + 1): t].any(axis=0)
            sizes = planned_read_sizes(loader, layer, np.flatnonzero(predicted[t] & ~seen))
            secs.append(call_seconds(_plan_cost(loader), len(sizes), float(sizes.sum())))
            reads.append((len(sizes), float(sizes.sum())))
        window_s.append(float(np.mean(secs)) if secs else 0.0)
        window_reads.append(_mean_call(reads))
    whole = set_read_seconds(loader, layer, np.arange(loader.entry(layer).count))
    return {"window_s": window_s, "whole_s": whole, "window_reads": window_reads}


def _plan_cost(loader):
    """The cost model the loader's planner merges reads by (None when it does not plan)."""
    return loader.cost if getattr(loader, "plan", True) else None


def _mean_call(calls) -> list:
    """[mean reads, mean bytes] of per-token (reads, bytes) pairs ([0, 0] for none)."""
    if not calls:
        return [0.0, 0.0]
    arr = np.asarray(calls, np.float64)
    return [round(float(arr[:, 0].mean()), 3), round(float(arr[:, 1].mean()), 1)]


CACHE_FRACTIONS = (1 / 16, 1 / 8, 3 / 16, 1 / 4, 3 / 8, 1 / 2)  # cache sizes calibration prices


class _UnreadLoader:
    """Stands in for a FlashLoader in a neuron cache that only keeps its bookkeeping: one byte per
    row, nothing read; the ids each `read` asked for are kept in `last`."""

    def __init__(self, loader, layer):
        self._entry = loader.entry(layer)
        self.last = np.zeros(0, np.int64)

    def entry(self, layer):
        return self._entry

    def alloc(self, layer, rows):
        return {"ids": mx.zeros((rows, 1), mx.uint8)}

    def plan(self, layer, ids):
        """A ReadPlan of `ids` with no reads (the cache hands it back to `read`)."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        index = np.argsort(ids, kind="stable")
        none = np.zeros(0, np.int64)
        return ReadPlan(layer, ids[index], index, none, none, none, none, none, 1)

    def read(self, layer, ids, rows, slots=None):
        self.last = np.asarray(getattr(ids, "ids", ids), np.int64)  # a plan's ids, or ids
        return SimpleNamespace(bytes_read=0, decode_seconds=0.0)


def measured_cache_read_seconds(loader, layer: int, predicted: np.ndarray, window: int,
                                fractions=CACHE_FRACTIONS, tokens=64) -> dict:
    """What a sparse layer reads per token with a neuron cache smaller than its window's union,
    priced on real predictions: `predicted` bool [consecutive tokens, n_neurons] runs through the
    runtime's own NeuronCache (neurons expire after `window` tokens, then the least recently
    active leave; neurons that do not fit are read for the token only) at `fractions` of the
    layer's neurons; each token's cache fill and overflow reads are priced as the one loader call
    the runtime issues for them (call_seconds), mean over the last `tokens` tokens (cache warm).
    Returns {"window": window, "rows": [capacity], "seconds": [mean seconds per token],
    "reads": [[mean reads, mean bytes] per token]}."""
    predicted = np.asarray(predicted, bool)
    n = predicted.shape[1]
    first = max(0, len(predicted) - tokens)
    cost = _plan_cost(loader)
    rows, seconds, reads = [], [], []
    for f in fractions:
        cap = max(1, int(round(f * n)))
        stub = _UnreadLoader(loader, layer)
        cache = NeuronCache(stub, layer, cap)
        secs, calls = [], []
        for t in range(len(predicted)):
            stub.last = np.zeros(0, np.int64)
            upd = cache.update(np.flatnonzero(predicted[t]), t, window)
            if t >= first:
                sizes = np.concatenate([planned_read_sizes(loader, layer, np.sort(stub.last)),
                                        planned_read_sizes(loader, layer, np.sort(upd.overflow))])
                secs.append(call_seconds(cost, len(sizes), float(sizes.sum())))
                calls.append((len(sizes), float(sizes.sum())))
        rows.append(cap)
        seconds.append(float(np.mean(secs)) if secs else 0.0)
        reads.append(_mean_call(calls))
    return {"window": int(window), "rows": rows, "seconds": seconds, "reads": reads}


def expected_read_seconds(loader, layer: int, neurons: int, draws=3, seed=0) -> float:
    """Expected seconds to read `neurons` random neurons of `layer` in one loader call
    (set_read_seconds: its read planner's merged, aligned requests priced by its cost model at
    that call's reads in flight); mean of `draws` random neuron sets. Without a cost model:
    bytes / 1 GB/s."""
    n = loader.entry(layer).count
    if neurons <= 0:
        return 0.0
    if neurons >= n:
        return set_read_seconds(loader, layer, np.arange(n))
    rng = np.random.default_rng(seed)
    return float(np.mean([set_read_seconds(loader, layer, np.sort(rng.choice(n, neurons, replace=False)))
                          for _ in range(draws)]))


def priced_read_fractions(loader, calls: dict):
    """(sparse_read_fraction, cache_read_fraction) for plan_memory from calibration's measured
    reads, priced now with the loader's cost model (call_seconds) against reading each layer
    whole the same way: prices stored as seconds at calibration time go stale when the machine's
    read-cost curve is measured again (a curve measured under load priced the relufied SmolLM2's
    sparse reads of layers 1-12 above their whole reads, so the plan streamed them whole).
    calls: {layer: {"window": [reads, bytes], "uncached": [reads, bytes], "cache": [(rows, reads,
    bytes)]}} (sparse.predictor.sparse_read_calls). Either dict is None when empty."""
    cost = _plan_cost(loader)
    by_window, by_rows = {}, {}
    for layer, c in calls.items():
        whole = set_read_seconds(loader, layer, np.arange(loader.entry(layer).count))
        if whole <= 0:
            continue
        by_window[layer] = (call_seconds(cost, *c["window"]) / whole, call_seconds(cost, *c["uncached"]) / whole)
        if c.get("cache"):
            by_rows[layer] = [(int(rows), call_seconds(cost, r, b) / whole) for rows, r, b in c["cache"]]
    return by_window or None, by_rows or None


def prefetch_bytes(manifest) -> int:
    """Flash's prefetch ring: two streaming buffers (largest layer) + the background reader's
    staging for one whole layer (its buffer's whole huge pages)."""
    return max((2 * layer_bytes(b) + huge_page_bytes(b.count * b.stride) for b in manifest.bundles), default=0)


def plan_memory(manifest, mode: str, budget, *, predictor_bytes=0, requested_capacity=None,
                density=None, read_cost=None, prefetch=True, sparse_read_fraction=None,
                cache_read_fraction=None, overflow_rows=None) -> MemoryPlan:
    """Split `budget` (MemoryBudget, bytes or None) for `mode`; FlashError if it is below the minimum.

    requested_capacity: {layer: rows} for flash (calibrated Req_i for the window); without it the
    budget left after the fixed parts is spread evenly over the layers.
    Flash with a budget, `density` ({layer: predicted fraction of neurons per token}) and
    `read_cost` (callable(layer, neurons per token) -> expected read seconds) plans each layer
    (module docstring); predictor_bytes is then {layer: bytes}. sparse_read_fraction: {layer:
    (with, without a neuron cache): measured seconds a sparse layer reads per token / seconds to
    read it whole} (calibration's measured_read_seconds on real predictions; "with" holds for a
    cache of requested_capacity rows, the window's); where given, a layer can run sparse with its
    cache (the option's memory counts the rows) or without (a token reads all its predictions),
    each priced at its fraction of read_cost(layer, all neurons), instead of read_cost of
    `density` random neurons. cache_read_fraction: {layer: [(cache rows, measured seconds per
    token / seconds to read the layer whole)]} (calibration's measured_cache_read_seconds at this
    window): more sparse options, a cache of that many rows at that price. overflow_rows: rows
    of the largest overflow a sparse layer reads per token (calibration's Req_1, the 99th
    percentile of one token's predicted neurons, over the layers); with it a plan that streams no
    layer through the shared buffer holds that many rows instead of a whole layer (overflow_bytes;
    larger overflows, e.g. prompts, are read and computed in pieces).
    """
    limit = resolve_budget(budget, manifest)
    if mode == "flash" and density is not None and read_cost is not None and limit is not None \
            and limit < resident_bytes(manifest) + sum(layer_bytes(b) for b in manifest.bundles):
        return plan_flash_layers(manifest, budget, predictor_bytes, density, read_cost,
                                 requested_capacity, prefetch=prefetch,
                                 sparse_read_fraction=sparse_read_fraction,
                                 cache_read_fraction=cache_read_fraction, overflow_rows=overflow_rows)
    # without a budget, or one that holds every FFN, flash runs every layer sparse (its caches
    # then hold the calibrated Req_i rows): the paper's setting; dense mode keeps everything
    if isinstance(predictor_bytes, dict):
        predictor_bytes = sum(predictor_bytes.values())
    bundles = {b.layer: b for b in manifest.bundles}
    plan = MemoryPlan(mode, resolve_budget(budget, manifest), pack_bytes(manifest),
                      resident_bytes(manifest), budget_param=budget_param(budget),
                      layer_bytes={i: layer_bytes(b) for i, b in bundles.items()},
                      encoded_bytes={i: encoded_bytes(b, manifest.alignment) for i, b in bundles.items()},
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
        held = []  # as many layers as fit in their smallest in-memory form (ENDOR: encoded)
        for i in sorted(bundles):
            if plan.encoded_bytes[i] > room:
                break
            held.append(i)
            room -= plan.encoded_bytes[i]
        for i in held:  # then decoded, while the room left allows: no decode per token
            extra = plan.layer_bytes[i] - plan.encoded_bytes[i]
            if extra <= room:
                plan.resident_layers.append(i)
                room -= extra
            else:
                plan.encoded_layers.append(i)
    elif mode == "flash":
        full = {i: b.count for i, b in bundles.items()}
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


# A sparse option must be priced at least this share below streaming its layer whole: a tie saves
# no reads and costs the predictor and the sparse path (the embedded SmolLM2 at 65%: a layer needing
# 1511 of its 1536 neurons, priced as streaming it, took 5.3 ms a call against 4.4 streamed).
SPARSE_MIN_SAVING = 0.05


def plan_flash_layers(manifest, budget, predictor_bytes: dict, density: dict, read_cost,
                      requested_capacity=None, units=4096, prefetch=True,
                      sparse_read_fraction=None, cache_read_fraction=None, overflow_rows=None) -> MemoryPlan:
    """The per-layer flash plan (module docstring): a multiple-choice knapsack over the layers
    (options resident / sparse / streamed, memory in `units` steps) minimising expected read
    seconds per token; the budget left over becomes neuron-cache rows for the sparse layers.
    The fixed part: the prefetch ring when a layer streams, the streaming buffer (overflow of the
    neuron caches) when a layer is sparse: a whole layer when layers may stream through it, or,
    given `overflow_rows`, a plan where none does: a buffer of that many rows (overflow_bytes), the
    knapsack choosing with the bytes that frees. FlashError when even the smallest plan does not fit."""
    bundles = {b.layer: b for b in manifest.bundles}
    layers = sorted(bundles)
    base = MemoryPlan("flash", resolve_budget(budget, manifest), pack_bytes(manifest),
                      resident_bytes(manifest), budget_param=budget_param(budget),
                      layer_bytes={i: layer_bytes(b) for i, b in bundles.items()},
                      row_bytes={i: row_bytes(b) for i, b in bundles.items()})
    everything = base.resident + sum(base.layer_bytes.values())
    if base.budget >= everything:
        base.resident_layers = layers
        base.expected_read_s = 0.0
        return base
    full = {i: b.count for i, b in bundles.items()}
    measured = sparse_read_fraction or {}
    want = {i: min(full[i], int((requested_capacity or full).get(i, full[i]))) for i in layers}
    cost = {i: {"streamed": float(read_cost(i, full[i]))} for i in layers}
    cache_rows = {}  # (layer, option name) -> neuron-cache rows the option pays for
    for i in layers:
        if i in measured:  # (with a neuron cache of want[i] rows, without one)
            cost[i]["sparse"], cost[i]["sparse-uncached"] = (float(f) * cost[i]["streamed"] for f in measured[i])
            cache_rows[i, "sparse"] = want[i]
        else:
            cost[i]["sparse"] = float(read_cost(i, min(full[i], max(0, round(density[i] * full[i])))))
        for rows, f in (cache_read_fraction or {}).get(i, ()):
            if 0 < rows < want[i]:  # smaller caches than the window's: LRU within the window
                cost[i][f"sparse:{int(rows)}"] = float(f) * cost[i]["streamed"]
                cache_rows[i, f"sparse:{int(rows)}"] = int(rows)
    found = []
    # (prefetch ring, sparse layers allowed, fixed bytes): with the ring, streamed layers are read
    # ahead and sparse layers need their own streaming buffer; without it (also the fallback when
    # the ring does not fit) streamed and sparse layers share one buffer, read in turn as hybrid's
    cases = [(True, False, prefetch_bytes(manifest)),
             (True, True, prefetch_bytes(manifest) + stream_bytes(manifest))] if prefetch else []
    cases.append((False, True, stream_bytes(manifest)))
    # no layer streamed whole: the shared buffer holds only the largest overflow, and the knapsack
    # spends the bytes that frees where the recorded reads say they save the most read time
    small = overflow_bytes(manifest, overflow_rows) if overflow_rows is not None else None
    if small is not None and small < stream_bytes(manifest):
        cases.append((False, True, small))
    for ring, allow_sparse, fixed in cases:
        no_streamed = fixed == small and not ring
        room = base.budget - base.resident - fixed
        if room < 0:
            continue
        unit = max(1, -(-room // units))
        options = {}
        for i in layers:
            opts = [("resident", -(-base.layer_bytes[i] // unit), 0.0)]
            if not no_streamed:
                opts.append(("streamed", 0, cost[i]["streamed"]))
            pred = int(predictor_bytes.get(i, 0))
            # a measured price holds with the window's cache rows, so the option pays for them;
            # without a cache a sparse layer reads each token's predictions whole
            sparse_opts = [(name, pred + cache_rows.get((i, name), 0) * base.row_bytes[i])
                           for name in cost[i] if name.startswith("sparse")]
            for name, nbytes in sparse_opts:
                if allow_sparse and cost[i][name] < (1 - SPARSE_MIN_SAVING) * cost[i]["streamed"]:
                    opts.append((name, -(-nbytes // unit), cost[i][name]))
            options[i] = opts
        choice = _knapsack(options, room // unit, np)
        if choice is None:
            continue
        total = sum(c for _, _, c in (next(o for o in options[i] if o[0] == choice[i]) for i in layers))
        if ring and "streamed" not in choice.values():
            continue  # nothing to prefetch: the ring would be wasted memory
        found.append((total, choice, fixed, room, ring))
    sync = [f for f in found if not f[4]]
    ahead = [f for f in found if f[4]]
    best = min(sync, key=lambda f: f[0]) if sync else None
    if ahead:
        # the ring costs about one more layer read than the sync plan, which the overlap of reads
        # with compute is meant to hide: use it unless it costs more than that
        ring_best = min(ahead, key=lambda f: f[0])
        one_layer = max(cost[i]["streamed"] for i in layers)
        if best is None or ring_best[0] <= best[0] + one_layer + 1e-12:
            best = ring_best
    if best is None:
        base.stream = stream_bytes(manifest)
        _check_minimum(base, "streaming or predicting every layer")
        raise FlashError(f"{base.budget_named()}: no flash plan fits")  # unreachable
    total, choice, fixed, room, ring = best
    # interchangeable layers (same sizes and costs) take resident, sparse, streamed in layer
    # order: resident layers first compute while the prefetcher reads the first streamed ones
    groups = {}
    for i in layers:
        sig = (base.layer_bytes[i], int(predictor_bytes.get(i, 0)),
               tuple(sorted((k, round(v, 9)) for k, v in cost[i].items())))
        groups.setdefault(sig, []).append(i)
    rank = {"resident": (0, 0), "sparse": (1, 0), "sparse-uncached": (3, 0), "streamed": (4, 0)}
    order = lambda name: rank.get(name) or (2, -int(name.split(":")[1]))  # noqa: E731  sparse:ROWS
    for members in groups.values():
        for i, name in zip(members, sorted((choice[i] for i in members), key=order)):
            choice[i] = name
    plan = base
    # the shared buffer only takes sparse overflow (no layer streams through it): it holds the
    # largest overflow instead of a whole layer, and the bytes freed go to neuron caches below
    shared_by_streamed = not ring and "streamed" in choice.values()
    if fixed == small and not ring:
        plan.overflow_rows, plan.overflow_stage = overflow_sizes(manifest, overflow_rows)
    elif overflow_rows is not None and not shared_by_streamed \
            and any(c.startswith("sparse") for c in choice.values()) \
            and overflow_bytes(manifest, overflow_rows) < stream_bytes(manifest):
        fixed += overflow_bytes(manifest, overflow_rows) - stream_bytes(manifest)
        plan.overflow_rows, plan.overflow_stage = overflow_sizes(manifest, overflow_rows)
    plan.stream = fixed
    plan.prefetch = ring
    plan.expected_read_s = total
    plan.layer_read_s = {i: 0.0 if choice[i] == "resident" else cost[i][choice[i]] for i in layers}
    plan.resident_layers = [i for i in layers if choice[i] == "resident"]
    plan.streamed_layers = [i for i in layers if choice[i] == "streamed"]
    sparse = [i for i in layers if choice[i].startswith("sparse")]
    plan.predictors = sum(int(predictor_bytes.get(i, 0)) for i in sparse)
    # layers whose option paid for their cache rows get them; the rest share what is left
    paid = {i: cache_rows[i, choice[i]] for i in sparse if (i, choice[i]) in cache_rows}
    rest = {i: want[i] for i in sparse if i not in paid}
    left = plan.budget - plan.weights - sum(paid[i] * plan.row_bytes[i] for i in paid)
    rest_bytes = sum(rest[i] * plan.row_bytes[i] for i in rest)
    if rest_bytes > left:
        scale = max(0.0, left / rest_bytes)
        rest = {i: int(rest[i] * scale) for i in rest}
    want = {**paid, **rest}
    plan.capacity = want
    _check_minimum(plan, "per-layer flash plan")
    return plan


def _knapsack(options: dict, capacity: int, np):
    """{layer: option name} minimising the summed cost with summed units <= capacity, or None.
    options: {layer: [(name, units, cost)]}."""
    capacity = int(capacity)
    inf = float("inf")
    best = np.zeros(capacity + 1)  # best[u]: least cost of the layers so far within u units
    picks = []
    for i, opts in options.items():
        new = np.full(capacity + 1, inf)
        pick = np.full(capacity + 1, -1, np.int64)
        for k, (_, units, c) in enumerate(opts):
            if units > capacity:
                continue
            cand = np.full(capacity + 1, inf)
            cand[units:] = best[: capacity + 1 - units] + c
            better = cand < new - 1e-15
            new[better], pick[better] = cand[better], k
        best = new
        picks.append((i, pick))
    if not np.isfinite(best[capacity]):
        return None
    choice, u = {}, capacity
    for i, pick in reversed(picks):
        k = int(pick[u])
        name, units, _ = options[i][k]
        choice[i] = name
        u -= units
    return choice


def _check_minimum(plan: MemoryPlan, what: str):
    if plan.budget is not None and plan.budget < plan.weights:
        raise FlashError(f"{plan.budget_named()}: below the minimum resident set "
                         f"of mode {plan.mode}, {fmt_bytes(plan.weights)} ({what}: {plan.describe()}); "
                         f"give at least {math.ceil(100 * plan.weights / plan.pack) / 100:.2f} of the pack or "
                         f"{fmt_bytes(plan.weights)}")
