"""Per-layer neuron cache of "LLM in a flash" section 3.3.

One preallocated matrix per bundle component (`rows`, `capacity` rows each; row r of every
component belongs to the same neuron), a pointer vector `ids` (neuron id held by each row, -1 when
unused), `num_used` (rows 0..num_used-1 are live), and `last_active` (the step at which the neuron
in each row was last predicted active: the last-k-active bookkeeping of the sliding window).

Rows are written only three ways: swap-delete (a row that leaves is overwritten by one of the last
live rows, so live rows stay contiguous), loader fills (new neurons are read straight from flash
into rows num_used..) and `copy_rows` (claimed rows copied from rows another read brought in: the
lookahead's buffer). The projections then run on `[:num_used]` of each matrix.
"""

import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..cpu.ops import extension
from ..io import host_bytes
from ..io.planner import ReadPlan


def cache_update_kernel():
    """The kernels' cache_update (NeuronCache.update(read=False) in one call), or None when the
    extension is missing or older."""
    return getattr(extension(), "cache_update", None)


@dataclass
class CacheUpdate:
    """What one `update` did. Times are wall seconds."""
    needed: int = 0  # neurons predicted active this step
    hits: int = 0  # of those, already in the cache
    loaded: int = 0  # read from flash into the cache
    evicted: int = 0
    rows_moved: int = 0  # rows copied by swap-delete
    overflow: np.ndarray = None  # needed neurons that did not fit (the caller streams them)
    fill: np.ndarray = None  # update(read=False): neurons given rows `fill_slots`, still to be read
    fill_slots: np.ndarray = None
    window: int = 0  # effective window after the update (tokens)
    io_s: float = 0.0
    decode_s: float = 0.0  # ENDOR: check + decode of the loaded bundles (part of io_s)
    mem_s: float = 0.0
    bytes_read: int = 0


def plan_chunks(loader, layer: int, ids, max_bytes=None, max_rows=None) -> list:
    """The loader's plan of bundles `ids` of `layer` (loader.plan: sorted, merged, aligned),
    split into ReadPlan pieces whose reads stage at most `max_bytes` bytes and hold at most
    `max_rows` bundles. A plan over `max_bytes` only by reading through gaps (its bundles' own
    reads fit) stays one piece with some merges undone (fit_merges); else pieces break at read
    boundaries. Pass each piece to loader.read in place
    of its ids: the reads are planned once. A single planned read is at most the loader's
    max_read (or one bundle): `max_bytes` below that still gets one read per piece. None: no
    limit. piece.index: the positions of its bundles in `ids`."""
    plan = loader.plan(layer, ids)
    if ((max_bytes is None or plan.read_bytes <= max_bytes) and (max_rows is None or len(plan) <= max_rows)) \
            or len(plan) == 0 or loader.entry(layer).encoding == "endor":
        return [plan]  # within the limits (a decode token's overflow, mostly): no split, no copy
    if max_rows is None or len(plan) <= max_rows:
        fitted = fit_merges(plan, max_bytes)
        if fitted is not None:  # fewer gap bytes in one call instead of two calls
            return [fitted]
    sizes, ends = (plan.r1 - plan.r0).tolist(), np.append(plan.first[1:], len(plan)).tolist()
    max_bytes = float("inf") if max_bytes is None else max_bytes
    max_rows = len(plan) if max_rows is None else max(1, int(max_rows))
    pieces, lo, staged = [], 0, 0
    for k, (a, b) in enumerate(zip(plan.first.tolist(), ends)):
        if a > lo and (staged + sizes[k] > max_bytes or b - lo > max_rows):
            pieces.append(plan.take(lo, a))
            lo, staged = a, 0
        while b - lo > max_rows:  # one read of more bundles than a piece holds: split it
            pieces.append(plan.take(lo, lo + max_rows))
            lo, staged = lo + max_rows, 0
        staged += sizes[k]
    pieces.append(plan.take(lo, len(plan)))
    return pieces


def fit_merges(plan, max_bytes):
    """`plan` with some of its merges undone so that its reads stage at most `max_bytes` bytes,
    or None when even its bundles' own reads stage more. A merge reads through the gap between
    two bundles to save a read; the merges kept are the plan's own with the smallest gaps (the
    most reads saved per staged byte); merges whose aligned reads touch (gap <= 0) always stay.
    The same bundles in the same order: only the reads' bounds change (each within one of
    `plan`'s reads, so within the loader's max_read)."""
    n = len(plan)
    a0 = plan.starts // plan.align * plan.align
    a1 = -(-(plan.starts + plan.lengths) // plan.align) * plan.align
    gaps = a0[1:] - a1[:-1]  # bytes merge j (bundle j with j + 1) stages beyond the two reads
    merged = np.ones(max(n - 1, 0), bool)
    merged[plan.first[1:] - 1] = False  # the plan's own read boundaries stay boundaries
    joins = np.flatnonzero(merged)
    order = joins[np.argsort(gaps[joins], kind="stable")]
    free = int(np.count_nonzero(gaps[order] <= 0))  # merges that stage nothing more: first
    base = int((a1 - a0).sum()) + int(gaps[order[:free]].sum())
    if base > max_bytes:
        return None
    staged = base + np.cumsum(gaps[order[free:]])  # after keeping merges order[free:][:k + 1]
    keep = np.zeros(max(n - 1, 0), bool)
    keep[order[:free + int(np.searchsorted(staged, max_bytes, side="right"))]] = True
    first = np.append(0, np.flatnonzero(~keep) + 1).astype(np.int64)
    last = np.append(first[1:], n) - 1
    return ReadPlan(plan.layer, plan.ids, plan.index, plan.starts, plan.lengths, a0[first], a1[last],
                    first, plan.align)


def read_in_chunks(loader, layer: int, ids, dest, slots, max_bytes=None):
    """loader.read of `ids` into rows `slots` of `dest`, in plan_chunks pieces of at most
    `max_bytes` staged bytes (the loader's staging buffer grows to its largest call); ReadStats."""
    slots = np.asarray(slots, np.int64)
    stats = None
    for piece in plan_chunks(loader, layer, ids, max_bytes):
        part = loader.read(layer, piece, dest, slots[piece.index])
        stats = part if stats is None else (stats.add(part) or stats)
    return stats


class NeuronCache:
    """Neuron cache of one layer: `capacity` preallocated rows filled by `loader`.
    max_read_bytes: stage at most this many bytes per loader call (read_in_chunks; None: any)."""

    def __init__(self, loader, layer: int, capacity: int, max_read_bytes=None):
        self.loader, self.layer = loader, layer
        self.max_read_bytes = max_read_bytes
        self.n_neurons = loader.entry(layer).count
        self.capacity = int(min(capacity, self.n_neurons))
        self.rows = loader.alloc(layer, self.capacity)  # {component: mx.array [capacity, ...]}
        # uint8 views of the same memory, for swap-delete copies (no MLX graph, no reallocation);
        # a budget can leave a layer no rows at all: then every needed neuron overflows (streams)
        self._host = [host_bytes(a).reshape(self.capacity, -1) if self.capacity else
                      np.zeros((0, int(np.prod(a.shape[1:])) * a.dtype.size), np.uint8)
                      for a in self.rows.values()]
        self.ids = np.full(self.capacity, -1, np.int64)
        self.slot_of = np.full(self.n_neurons, -1, np.int64)  # neuron -> row, -1 when absent
        self.last_active = np.zeros(self.capacity, np.int64)
        self._used = np.zeros(1, np.int64)  # num_used, where the sparse-decode primitive updates it too
        self.rows_moved = 0  # lifetime counters: every row write is one of these two
        self.rows_loaded = 0
        self.update_kernel = cache_update_kernel()  # None: numpy (the reference the kernel is tested on)
        # the live rows' neuron ids as int32 for the FFN kernels (live_ids), rewritten in place
        self._ids32 = mx.zeros((max(self.capacity, 1),), mx.int32)
        self._ids32_host = host_bytes(self._ids32).view(np.int32)

    @property
    def num_used(self) -> int:
        """Rows 0..num_used-1 are live."""
        return int(self._used[0])

    @num_used.setter
    def num_used(self, n: int) -> None:
        self._used[0] = n

    @property
    def used_array(self) -> np.ndarray:
        """num_used as the int64 [1] array behind it (a kernel updates it in place)."""
        return self._used

    @property
    def host_rows(self) -> list:
        """Each component's rows as uint8 [capacity, bytes] host views of `rows` (the same memory)."""
        return self._host

    def live_ids(self):
        """mx int32 [num_used]: the neuron id of each live row, written into an array this cache
        keeps (no new MLX array per token from numpy): like the rows, its contents change at the
        next update, so whatever reads it is evaluated before then."""
        n = self.num_used
        self._ids32_host[:n] = self.ids[:n]
        return self._ids32[:n]

    @property
    def row_bytes(self) -> int:
        """Bytes of one cached neuron (all its components)."""
        return sum(h.shape[1] for h in self._host)

    def delete(self, slots) -> int:
        """Swap-delete the rows `slots`; returns the number of rows copied."""
        slots = np.unique(np.asarray(slots, np.int64))
        if not len(slots):
            return 0
        n_after = self.num_used - len(slots)
        holes = slots[slots < n_after]  # deleted rows inside the new live prefix
        gone = np.zeros(self.num_used, bool)
        gone[slots] = True
        movers = np.nonzero(~gone[n_after:])[0] + n_after  # surviving rows beyond it
        self.slot_of[self.ids[slots]] = -1
        if len(holes):
            for h in self._host:
                h[holes] = h[movers]
            self.ids[holes] = self.ids[movers]
            self.last_active[holes] = self.last_active[movers]
            self.slot_of[self.ids[holes]] = holes
        self.ids[n_after: self.num_used] = -1
        self.num_used = n_after
        self.rows_moved += len(holes)
        return len(holes)

    def _free_rows(self, count: int) -> np.ndarray:
        """Rows num_used..num_used + count - 1, the next free ones (live rows stay contiguous);
        ValueError when `count` neurons do not fit."""
        if self.num_used + count > self.capacity:
            raise ValueError(f"layer {self.layer}: {count} neurons do not fit in the neuron cache "
                             f"({self.num_used} of {self.capacity} rows used)")
        return np.arange(self.num_used, self.num_used + count)

    def load(self, neuron_ids, step: int):
        """Read `neuron_ids` (not cached, fitting) from flash into rows num_used..; ReadStats."""
        neuron_ids = np.asarray(neuron_ids, np.int64)
        slots = self._free_rows(len(neuron_ids))
        stats = read_in_chunks(self.loader, self.layer, neuron_ids, self.rows, slots, self.max_read_bytes)
        self.claim(neuron_ids, step)
        return stats

    def claim(self, neuron_ids, step: int) -> np.ndarray:
        """Give `neuron_ids` (not cached, fitting) rows num_used.. without reading them: the caller
        reads them into the returned rows before anything computes with them."""
        neuron_ids = np.asarray(neuron_ids, np.int64)
        k = len(neuron_ids)
        slots = self._free_rows(k)
        self.ids[slots] = neuron_ids
        self.slot_of[neuron_ids] = slots
        self.last_active[slots] = step
        self.num_used += k
        self.rows_loaded += k
        return slots

    def copy_rows(self, slots, source: dict, source_rows) -> None:
        """Write rows `source_rows` of `source` ({component: mx.array [rows, ...]}, the layout of
        loader.alloc(layer)) into the cache's rows `slots`, which `claim` gave their neurons
        (the neurons `source` holds there); ValueError for a row that is not live."""
        slots = np.asarray(slots, np.int64)
        if len(slots) and (slots.min() < 0 or slots.max() >= self.num_used):
            raise ValueError(f"layer {self.layer}: rows {slots.tolist()} are not all claimed "
                             f"(rows 0..{self.num_used - 1} are live)")
        source_rows = np.asarray(source_rows, np.int64)
        for name, h in zip(self.rows, self._host):
            h[slots] = host_bytes(source[name]).reshape(len(source[name]), -1)[source_rows]

    def update(self, active, step: int, window: int, read=True) -> CacheUpdate:
        """Make the cache hold the neurons `active` (sorted unique ids) at `step`.

        Neurons last active `window` or more steps ago leave; if the survivors and the new
        neurons still do not fit, the oldest survivors leave too (the window shrinks). Needed
        neurons beyond the capacity are returned in `overflow`, not cached. read=False: the neurons
        that fit get their rows (`fill`, `fill_slots`) but are not read (the caller reads them,
        e.g. in one loader call with the overflow).
        """
        t0 = time.perf_counter()
        active = np.asarray(active, np.int64)
        if not read and self.update_kernel is not None:
            return self._update_kernel(active, step, window, t0)
        out = CacheUpdate(needed=len(active))
        slots = self.slot_of[active]
        present = slots >= 0
        out.hits = int(present.sum())
        self.last_active[slots[present]] = step
        new = active[~present]
        live = self.last_active[: self.num_used]
        expired = np.nonzero(live <= step - window)[0]
        room = self.capacity - (self.num_used - len(expired))
        if len(new) > room:  # shrink the window: drop the oldest non-current survivors
            keep = np.nonzero(live > step - window)[0]
            old = keep[live[keep] < step]
            extra = old[np.argsort(live[old], kind="stable")][: len(new) - room]
            expired = np.concatenate([expired, extra])
            room += len(extra)
        out.evicted = len(expired)
        out.rows_moved = self.delete(expired)
        fit, out.overflow = new[:room], new[room:]
        t1 = time.perf_counter()
        if len(fit) and not read:
            out.fill, out.fill_slots, out.loaded = fit, self.claim(fit, step), len(fit)
        elif len(fit):
            stats = self.load(fit, step)
            out.loaded, out.bytes_read, out.decode_s = len(fit), stats.bytes_read, stats.decode_seconds
        t2 = time.perf_counter()
        live = self.last_active[: self.num_used]
        out.window = int(step - live.min() + 1) if self.num_used else 0
        out.io_s, out.mem_s = t2 - t1, t1 - t0
        return out

    def _update_kernel(self, active, step: int, window: int, t0: float) -> CacheUpdate:
        """update(read=False) by the kernels' cache_update: the same rows, ids and counters."""
        over, fill, slots = (np.empty(len(active), np.int64) for _ in range(3))
        (self.num_used, hits, evicted, moved, n_fill, n_over, win) = self.update_kernel(
            np.ascontiguousarray(active), int(step), int(window), self.ids, self.slot_of, self.last_active,
            self.num_used, self._host, over, fill, slots, np.empty(2 * self.capacity, np.int64))
        self.rows_moved += moved
        self.rows_loaded += n_fill
        out = CacheUpdate(needed=len(active), hits=hits, evicted=evicted, rows_moved=moved,
                          overflow=over[:n_over], window=win, loaded=n_fill)
        if n_fill:
            out.fill, out.fill_slots = fill[:n_fill], slots[:n_fill]
        out.mem_s = time.perf_counter() - t0
        return out

    def check(self, bundles=None):
        """Assert the invariants (tests): no duplicates, consistent pointers, num_used bound;
        with `bundles` ({component: np.ndarray [n_neurons, bytes]}), every row equals its bundle."""
        n = self.num_used
        assert 0 <= n <= self.capacity
        ids = self.ids[:n]
        assert len(np.unique(ids)) == n and (ids >= 0).all() and (self.ids[n:] == -1).all()
        assert (self.slot_of[ids] == np.arange(n)).all()
        assert (self.slot_of >= 0).sum() == n
        if bundles is not None:
            for name, h in zip(self.rows, self._host):
                assert np.array_equal(h[:n], bundles[name][ids]), f"row content of {name}"
