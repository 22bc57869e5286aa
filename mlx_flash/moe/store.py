"""The expert store: a pack's expert blocks read into a preallocated slot bank of MLX arrays.

One bank serves every MoE layer of the model (all expert blocks of a model have the same
components): `bank[component]` is an mx.array [n_slots, *component shape], allocated once, and the
loader's direct reads land in its rows zero-copy. A pack with expert-wise bit widths has one bank
per width (its blocks differ in size), and each layer's slots are split over its widths. `ExpertCache` decides which (layer, expert) owns
which row; predicted experts are read by one background thread while the current layer computes.

Exactness: a slot is only overwritten when the cache chose it as a victim, and the cache never
chooses an expert the pending computation reads (it is pinned until the next host sync, which
evaluates that computation: the streamed layer evaluates the previous call's product, kept in
`last_output`, with its expert ids), so every product reads exactly the expert's bytes from the
pack.
"""

import collections
import threading
import time

import numpy as np

from ..errors import FlashError
from .cache import ExpertCache

PROBE_TOKENS = 2  # decode tokens timed per preload setting per probe
REPROBE_TOKENS = 16  # decode tokens between probes of the setting not in use


def expert_layers(manifest) -> dict:
    """{layer: Bundle} of a pack's MoE layers (kind "experts"), in layer order."""
    return {b.layer: b for b in sorted(manifest.bundles, key=lambda b: b.layer)
            if b.kind == "experts"}


def block_components(entry) -> dict:
    """{component name ("gate.weight", "down.scales", ...): Component} of an expert block."""
    return {c.name: c for c in entry.components}


def width_groups(entry) -> dict:
    """{width: (bundle key, expert ids np.ndarray)} of an MoE layer's Bundle: one group per bit
    width for an "expert-bits" layer, else one (width = the weights' bits, 0 for float) holding
    every expert under the layer's own key."""
    if entry.groups:
        return {g.bits: (g.key, np.asarray(g.experts, np.int64)) for g in entry.groups}
    return {width_of_group(entry): (entry.key, np.arange(entry.count))}


def scratch_bank_sizes(layers) -> dict:
    """{width: experts} of the scratch banks `ExpertStore.banks_for` may allocate: per width, the
    most experts of that width any of `layers` ({layer: Bundle}) has (one whole layer's)."""
    sizes = {}
    for entry in layers.values():
        for w, (_, ids) in width_groups(entry).items():
            sizes[w] = max(sizes.get(w, 0), len(ids))
    return sizes


def scratch_bank_bytes(layers) -> int:
    """Bytes of every scratch bank a prompt can make `ExpertStore` allocate (a call routed to more
    experts of a width than its layer's slots of that width): `scratch_bank_sizes` x one expert's
    bytes in a bank of that width."""
    rows = {}
    for entry in layers.values():
        for g in entry.groups or (entry,):
            rows[width_of_group(g)] = g.row_bytes
    return sum(n * rows[w] for w, n in scratch_bank_sizes(layers).items())


def width_of_group(entry) -> int:
    """The width key `width_groups` gives a Bundle or width group (0 for float experts)."""
    if entry.bits is not None:
        return entry.bits
    q = block_components(entry)["gate.weight"].quantization
    return q["bits"] if q else 0


def expert_widths(manifest) -> dict:
    """{layer: [bits of each expert]} of a pack's MoE layers (16 for float experts)."""
    out = {}
    for layer, entry in expert_layers(manifest).items():
        bits = np.zeros(entry.count, np.int64)
        for w, (_, ids) in width_groups(entry).items():
            bits[ids] = w or 16
        out[layer] = bits.tolist()
    return out


def split_slots(entry, slots) -> dict:
    """{width: slots} of a layer given `slots` expert slots: each width group gets the same
    fraction of its experts (at least one slot, at most its experts)."""
    groups = width_groups(entry)
    if len(groups) == 1:
        return {w: slots for w in groups}
    return {w: min(len(ids), max(1, round(slots * len(ids) / entry.count)))
            for w, (_, ids) in groups.items()}


class ExpertStore:
    """Experts of `layers` ({layer: Bundle}) read through `loader` into slot banks.

    capacity: slots per layer ({layer: n}) or one pool (int; uniform widths only); policy: an
    eviction policy of `moe.cache.POLICIES`; future: the access trace for "belady". cache=False
    reads every chosen expert each time into a scratch bank of one layer's experts (naive mode).
    Experts of mixed bit widths ("expert-bits" layers) get one bank per width, each layer's slots
    split over its widths (`split_slots`); `mixed` says so.
    """

    def __init__(self, loader, layers, capacity, policy="lru", future=None, cache=True):
        self.loader, self.entries = loader, dict(layers)
        self.groups = {layer: width_groups(e) for layer, e in self.entries.items()}
        widths = sorted({w for g in self.groups.values() for w in g})
        self.mixed = any(e.groups for e in self.entries.values())
        if self.mixed and isinstance(capacity, int):
            raise FlashError(f"{loader.pack}: experts of mixed widths need slots per layer")
        self.width_of, self.local_of = {}, {}
        for layer, groups in self.groups.items():
            n = self.entries[layer].count
            self.width_of[layer] = np.zeros(n, np.int64)
            self.local_of[layer] = np.zeros(n, np.int64)
            for w, (_, ids) in groups.items():
                self.width_of[layer][ids] = w
                self.local_of[layer][ids] = np.arange(len(ids))
        # components of each width, the same in every layer (one bank per width serves them all)
        self.components, first_key = {}, {}
        for layer, groups in self.groups.items():
            for w, (key, _) in groups.items():
                mine = {c.name: (c.shape, c.dtype) for c in loader.entry(key).components}
                if w not in self.components:
                    self.components[w], first_key[w] = block_components(loader.entry(key)), key
                elif mine != {n: (c.shape, c.dtype) for n, c in self.components[w].items()}:
                    raise FlashError(f"{loader.pack}: layer {layer}'s expert blocks differ from "
                                     f"layer {first_key[w]}'s (mixed expert shapes are not supported)")
        if self.mixed:
            per_layer = {layer: split_slots(self.entries[layer], capacity[layer])
                         for layer in self.entries}
            pools = {(layer, w): per_layer[layer].get(w, 0) for w in widths for layer in self.entries}
            self.cache = ExpertCache(list(self.entries), pools, policy, future, widths=self.width_of)
            self.base = {w: self.cache.pool_start[(next(iter(self.entries)), w)] for w in widths}
            n_slots = {w: sum(pools[(layer, w)] for layer in self.entries) for w in widths}
        else:
            self.cache = ExpertCache(list(self.entries), capacity, policy, future)
            self.base, n_slots = {widths[0]: 0}, {widths[0]: self.cache.n_slots}
        self.keep = cache
        self.banks = ({w: loader.alloc(first_key[w], n) for w, n in n_slots.items() if n}
                      if cache else {})
        self.bank = self.banks.get(widths[0]) if not self.mixed else None
        self.scratch = {}  # {width: bank} of one layer's experts (scratch_bank_sizes), on first use
        self._scratch_sizes = scratch_bank_sizes(self.entries)
        self.overflow_reads = 0
        self.bytes_read = 0
        self.read_seconds = 0.0
        # {kind: {reads in flight: [loader calls, device bytes, seconds]}}: "demand" reads the
        # caller blocked on, "preload" background reads, "preload_wait" waits on a preload that
        # had not landed (its bytes, the time blocked), "fill" reads at load; the bench prices
        # each depth at fio's throughput
        self.io_log = {"demand": {}, "preload": {}, "preload_wait": {}, "fill": {}}
        self.bytes_useful = 0  # expert block bytes asked for (demand and preload)
        self._log_lock = threading.Lock()
        self.host_syncs = 0
        self.last_output = ()  # the last layer call's (lazy) product, evaluated by the next sync
        # Background preloads: one expert per loader call, in priority order, so a layer waits
        # for at most the one read in flight and only when it needs that expert; queued ones are
        # cancelled when their layer routes (its misses then go out as one demand read).
        self._queue = collections.deque()  # [(layer, expert, global slot)] not started
        self._inflight = None  # (layer, expert) the worker is reading
        self._inflight_stats = None  # ReadStats of the last preload read
        self._worker_error = None
        self._cond = threading.Condition()
        self._worker = None
        self._closing = False
        # Preload width by measurement: the experts one background read per expert can land in
        # the time between a layer's preload and the next layer's routing (both EMAs, seconds).
        self.max_preload = None  # experts per layer at most (None: as many as offered)
        self.adaptive = True  # False: always max_preload (a fixed width)
        self.window_s = None  # a layer's compute: preload issued -> next layer routes
        self.expert_read_s = None  # one expert read at depth 1 (preloads; demand until then)
        self._offered_at = None
        # Preloading on or off by the measured token time (a background read also costs CPU
        # and disk time the window rule cannot see): each is timed on PROBE_TOKENS tokens, then
        # the faster runs, the other re-timed every REPROBE_TOKENS tokens (EMAs, seconds).
        self.preload_on = False
        self._first_layer = next(iter(self.entries))
        self.token_s = {False: None, True: None}
        self._passes, self._pass_started = 0, None

    def quantization(self, role, width=None):
        """{"group_size", "bits"} of a role's weight ("gate", "up", "down") in the bank of
        `width` (default: the only one), or None (float)."""
        comps = self.components[width if width is not None else next(iter(self.components))]
        return comps[f"{role}.weight"].quantization

    def n_experts(self, layer) -> int:
        return self.entries[layer].count

    def slots_for(self, layer, ids: np.ndarray):
        """(bank, slot of each expert id in `ids`) of a uniform-width pack (see `banks_for`)."""
        lut, banks = self.banks_for(layer, ids)
        (bank,) = banks.values()
        return bank, lut[ids]

    def banks_for(self, layer, ids: np.ndarray):
        """(row of each expert id [experts] in its width's bank, {width: bank}) with the missing
        experts of `ids` read first (`assign`, then `read`)."""
        lut, banks, reads = self.assign(layer, ids)
        self.read(layer, reads)
        return lut, banks

    def assign(self, layer, ids: np.ndarray):
        """(row of each expert id [experts] in its width's bank, {width: bank}, reads): slots for
        the experts of `ids`, the missing ones still to be read by `read(layer, reads)` before
        anything computes with them (reads: [(expert ids, bank rows, bank)]).

        A call needing more distinct experts of a width than the layer's slots of that width (a
        long prompt) reads them into a scratch bank of one layer's experts of that width instead
        (allocated on first use), so results stay exact at any cache size; the next layer's host
        sync has consumed it before reuse.
        """
        distinct = np.unique(ids)
        self._settle(layer, distinct)
        n = self.n_experts(layer)
        if distinct.size and (distinct[0] < 0 or distinct[-1] >= n):
            raise FlashError(f"{self.loader.pack}: layer {layer} routed to expert {int(distinct[-1])} "
                             f"but the pack has {n}")
        lut = np.zeros(n, np.uint32)
        widths = self.width_of[layer][distinct]
        banks, cached, scratch_reads = {}, [], []
        for w in np.unique(widths).tolist():
            mine = distinct[widths == w]
            if not self.keep or mine.size > self.cache.capacity_of(layer, int(mine[0])):
                if w not in self.scratch:
                    self.scratch[w] = self.loader.alloc(self.groups[layer][w][0],
                                                        self._scratch_sizes[w])
                self.overflow_reads += mine.size if self.keep else 0
                self.cache.stats.misses += mine.size
                lut[mine] = np.arange(mine.size)
                scratch_reads.append((mine, np.arange(mine.size), self.scratch[w]))
                banks[w] = self.scratch[w]
            else:
                cached.append(mine)
                banks[w] = self.banks[w]
        misses = []
        if cached:
            mine = np.concatenate(cached)
            slots, misses = self.cache.access(layer, mine.tolist())
            lut[mine] = np.asarray(slots) - self._bases(layer, mine)
        return lut, banks, scratch_reads + self._bank_requests(layer, misses)

    def _bases(self, layer, experts):
        return np.array([self.base[w] for w in self.width_of[layer][experts].tolist()], np.int64)

    def _bank_requests(self, layer, todo):
        """[(experts, bank rows, bank)] of [(expert, global slot)] to read, grouped by width."""
        if not todo:
            return []
        experts = np.array([e for e, _ in todo], np.int64)
        rows = np.array([s for _, s in todo], np.int64) - self._bases(layer, experts)
        widths = self.width_of[layer][experts]
        return [(experts[widths == w], rows[widths == w], self.banks[w]) for w in np.unique(widths).tolist()]

    def preload_limit(self) -> int:
        """Experts to preload for the next layer now: as many one-expert reads as fit in the
        measured compute window (0 when a read takes longer than a layer computes, or before
        anything is measured), at most `max_preload`."""
        if not self.adaptive:
            return self.max_preload if self.max_preload is not None else 1 << 30
        if self.window_s is None or not self.expert_read_s or not self.preload_on:
            return 0
        n = int(self.window_s / self.expert_read_s)
        return n if self.max_preload is None else min(n, self.max_preload)

    def preload(self, layer, experts, limit=None):
        """Queue background reads of the first `limit` (default `preload_limit()`) of `experts`
        (priority order) of `layer` that are not cached, into free or evictable slots; marks the
        start of the compute window the next `assign` measures."""
        self._offered_at = time.perf_counter()
        if not self.keep:
            return
        limit = self.preload_limit() if limit is None else limit
        wanted = [int(e) for e in experts if (layer, int(e)) not in self.cache.slot][:limit]
        todo = self.cache.preload(layer, wanted)
        if not todo:
            return
        with self._cond:
            self._queue.extend((layer, e, slot) for e, slot in todo)
            if self._worker is None:
                self._worker = threading.Thread(target=self._preload_worker, daemon=True,
                                                name="expert-preload")
                self._worker.start()
            self._cond.notify_all()

    def fill(self, layer, experts):
        """Read `experts` of `layer` into slots now, on this thread (a resident bank at load)."""
        self.read(layer, self._bank_requests(layer, self.cache.preload(layer, experts)), "fill")

    def wait_preload(self):
        """Block until every queued preload has landed."""
        with self._cond:
            while self._queue or self._inflight is not None:
                self._cond.wait()
        self._raise_worker_error()

    def _preload_worker(self):
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                layer, expert, slot = self._queue.popleft()
                self._inflight = (layer, expert)
            stats, error = None, None
            try:
                stats = self.read(layer, self._bank_requests(layer, [(expert, slot)]), "preload")
            except Exception as e:  # re-raised on the caller's thread at its next settle
                error = e
            with self._cond:
                self._inflight, self._inflight_stats = None, stats
                self._worker_error = self._worker_error or error
                self._cond.notify_all()

    def _raise_worker_error(self):
        if self._worker_error is not None:
            error, self._worker_error = self._worker_error, None
            raise error

    def pass_started(self, now=None):
        """The first MoE layer routes: time the last pass (a decode token; the prompt and the
        first token, cold, are skipped) under the preload setting it ran with, then choose the
        next pass's setting (`choose_preload`)."""
        now = time.perf_counter() if now is None else now
        if self._pass_started is not None and self._passes >= 3:
            s, old = now - self._pass_started, self.token_s[self.preload_on]
            self.token_s[self.preload_on] = s if old is None else 0.7 * old + 0.3 * s
        self._pass_started = now
        self._passes += 1
        self.preload_on = self.choose_preload(self._passes - 3)

    def choose_preload(self, token) -> bool:
        """Preload on for timed decode token `token` (0 = the second decode token)? Off for the first PROBE_TOKENS, on for
        the next PROBE_TOKENS, then whichever had the lower token time, except the first
        PROBE_TOKENS of every REPROBE_TOKENS, which re-time the other."""
        if token < 2 * PROBE_TOKENS:
            return token >= PROBE_TOKENS
        off, on = self.token_s[False], self.token_s[True]
        if off is None or on is None:
            return on is None
        better = on < off
        return (not better) if token % REPROBE_TOKENS < PROBE_TOKENS else better

    def _settle(self, layer, needed):
        """Before `layer` routes to `needed`: cancel the preloads not started (their slots go
        back; needed ones become this call's demand reads), wait for the one in flight only if
        this call needs it, else keep its slot from being reused until it lands; measure the
        compute window since the preload was offered."""
        now = time.perf_counter()
        if layer == self._first_layer:
            self.pass_started(now)
        if self._offered_at is not None:
            window = now - self._offered_at
            self.window_s = window if self.window_s is None else 0.8 * self.window_s + 0.2 * window
            self._offered_at = None
        with self._cond:
            queued, inflight = list(self._queue), self._inflight
            self._queue.clear()
        for l, e, _ in queued:
            self.cache.cancel((l, e))
        self.cache.busy.clear()
        if inflight is not None:
            # this call needs it, or needs every slot of the partition it is landing in
            crowded = (inflight[0] == layer and self.keep and needed.size
                       >= self.cache.capacity_of(layer, inflight[1]))
            if (inflight[0] == layer and inflight[1] in needed) or crowded:
                t0 = time.perf_counter()
                with self._cond:
                    while self._inflight == inflight:
                        self._cond.wait()
                    stats = self._inflight_stats
                if stats is not None:
                    self._log("preload_wait", stats, time.perf_counter() - t0)
            else:
                self.cache.busy.add(inflight)
        self._raise_worker_error()

    def _log(self, kind, stats, seconds):
        with self._log_lock:
            entry = self.io_log[kind].setdefault(stats.reads, [0, 0, 0.0])
            entry[0] += 1
            entry[1] += stats.bytes_read
            entry[2] += seconds
            if kind != "preload_wait":
                self.bytes_useful += stats.bytes_useful
            if kind in ("demand", "preload") and stats.bundles:  # seconds per expert read
                per = seconds / stats.bundles
                self.expert_read_s = (per if self.expert_read_s is None
                                      else 0.8 * self.expert_read_s + 0.2 * per)

    def io_snapshot(self) -> dict:
        """A copy of `io_log` plus "useful" (bytes_useful), safe while a preload is running."""
        with self._log_lock:
            return {"useful": self.bytes_useful,
                    **{kind: {d: list(v) for d, v in log.items()} for kind, log in self.io_log.items()}}

    def read(self, layer, requests, kind="demand"):
        """Read [(expert ids, rows, bank)] of `layer` in one loader call (`assign`'s reads);
        returns the loader's ReadStats (None when there was nothing to read)."""
        if not requests:
            return None
        t0 = time.perf_counter()
        calls = []
        for experts, rows, bank in requests:
            w = int(self.width_of[layer][experts[0]])
            local = self.local_of[layer][experts]
            order = np.argsort(local)
            calls.append((self.groups[layer][w][0], local[order], bank, rows[order]))
        stats = self.loader.read_many(calls)
        seconds = time.perf_counter() - t0
        self.bytes_read += stats.bytes_read
        self.read_seconds += seconds
        self._log(kind, stats, seconds)
        return stats

    def close(self):
        """Let the queued preloads land, then stop the preload thread."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._worker is not None:
            self._worker.join()
            self._worker = None
