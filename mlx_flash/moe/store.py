"""The expert store: a pack's expert blocks read into a preallocated slot bank of MLX arrays.

One bank serves every MoE layer of the model (all expert blocks of a model have the same
components): `bank[component]` is an mx.array [n_slots, *component shape], allocated once, and the
loader's direct reads land in its rows zero-copy. `ExpertCache` decides which (layer, expert) owns
which row; predicted experts are read by one background thread while the current layer computes.

Exactness: a slot is only overwritten when the cache chose it as a victim, and the cache never
chooses an expert the pending computation reads (it is pinned until the next host sync, which
evaluates that computation), so every product reads exactly the expert's bytes from the pack.
"""

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..errors import FlashError
from .cache import ExpertCache


def expert_layers(manifest) -> dict:
    """{layer: bundle entry} of a pack's MoE layers (kind "experts"), in layer order."""
    return {b["layer"]: b for b in sorted(manifest["bundles"], key=lambda b: b["layer"])
            if b["kind"] == "experts"}


def block_components(entry) -> dict:
    """{component name ("gate.weight", "down.scales", ...): manifest component} of an expert block."""
    return {c["name"]: c for c in entry["components"]}


class ExpertStore:
    """Experts of `layers` ({layer: bundle entry}) read through `loader` into a slot bank.

    capacity: slots per layer ({layer: n}) or one pool (int); policy: an eviction policy of
    `moe.cache.POLICIES`; future: the access trace for "belady". cache=False reads every chosen
    expert each time into a scratch bank of one layer's experts (the naive mode).
    """

    def __init__(self, loader, layers, capacity, policy="lru", future=None, cache=True):
        self.loader, self.entries = loader, dict(layers)
        first = next(iter(self.entries.values()))
        shapes = {n: (c["shape"], c["dtype"]) for n, c in block_components(first).items()}
        for layer, entry in self.entries.items():
            mine = {n: (c["shape"], c["dtype"]) for n, c in block_components(entry).items()}
            if mine != shapes:
                raise FlashError(f"{loader.pack}: layer {layer}'s expert blocks differ from layer "
                                 f"{next(iter(self.entries))}'s (mixed expert shapes are not supported)")
        self.components = block_components(first)
        self.cache = ExpertCache(list(self.entries), capacity, policy, future)
        self.keep = cache
        self.bank = loader.alloc(next(iter(self.entries)), self.cache.n_slots) if cache else None
        self.scratch = None
        self.overflow_reads = 0
        self.bytes_read = 0
        self.read_seconds = 0.0
        self.host_syncs = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="expert-preload")
        self._pending = None

    def quantization(self, role):
        """{"group_size", "bits"} of a role's weight ("gate", "up", "down"), or None (float)."""
        return self.components[f"{role}.weight"].get("quantization")

    def n_experts(self, layer) -> int:
        return self.entries[layer]["count"]

    def slots_for(self, layer, ids: np.ndarray):
        """(bank, slot of each expert id in `ids`): the missing experts are read first.

        A call needing more distinct experts than the layer's slots (a long prompt) reads them
        into a scratch bank of one layer's experts instead (allocated on first use), so results
        stay exact at any cache size; the next layer's host sync has consumed it before reuse.
        """
        self.wait_preload()
        distinct = np.unique(ids)
        n = self.n_experts(layer)
        if distinct.size and (distinct[0] < 0 or distinct[-1] >= n):
            raise FlashError(f"{self.loader.pack}: layer {layer} routed to expert {int(distinct[-1])} "
                             f"but the pack has {n}")
        lut = np.zeros(n, np.uint32)
        if not self.keep or distinct.size > self.cache.capacity_of(layer):
            if self.scratch is None:
                self.scratch = self.loader.alloc(layer, n)
            self.overflow_reads += distinct.size if self.keep else 0
            self.cache.stats.misses += distinct.size
            lut[distinct] = np.arange(distinct.size)
            self._read(layer, list(zip(distinct.tolist(), range(distinct.size))), self.scratch)
            return self.scratch, lut[ids]
        slots, misses = self.cache.access(layer, distinct.tolist())
        self._read(layer, misses, self.bank)
        lut[distinct] = slots
        return self.bank, lut[ids]

    def preload(self, layer, experts):
        """Read `experts` of `layer` (priority order) into free or evictable slots, in the background."""
        if not self.keep:
            return
        todo = self.cache.preload(layer, experts)
        if todo:
            self._pending = self._pool.submit(self._read, layer, todo, self.bank)

    def wait_preload(self):
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def _read(self, layer, todo, bank):
        if not todo:
            return
        t0 = time.perf_counter()
        ids = np.array([e for e, _ in todo], np.int64)
        slots = np.array([s for _, s in todo], np.int64)
        order = np.argsort(ids)
        stats = self.loader.read(layer, ids[order], bank, slots[order])
        self.bytes_read += stats.bytes_read
        self.read_seconds += time.perf_counter() - t0

    def close(self):
        self.wait_preload()
        self._pool.shutdown()
