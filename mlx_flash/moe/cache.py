"""Expert cache bookkeeping: which (layer, expert) sits in which slot, and whom to evict.

The slot bank itself (preallocated MLX arrays the reads land in) is `moe.store.ExpertStore`'s;
this module only decides. The same `ExpertCache` runs the live model and the offline simulation
(`simulate`) the benchmarks use, so a policy's measured hit rate is the runtime's own.

Slots are partitioned per layer (`capacity={layer: slots}`, EdgeMoE's per-layer buffer as the issue
sizes it) or pooled (`capacity=int`: one buffer for all layers, where the layer-aware policy's
distance term matters). Policies:
  lru    evict the least recently used expert
  lfu    evict the least frequently used (all-time count), ties by recency
  layer  EdgeMoE 3.3.3: evict the highest distance / frequency, distance = how many MoE layers
         from now until the expert's layer runs again (1 for the next layer, S for the current)
  belady evict the expert whose next use is farthest in a known future (the offline optimum)
"""

import bisect
from dataclasses import dataclass

POLICIES = ("lru", "lfu", "layer", "belady")


@dataclass
class CacheStats:
    """Counts of expert accesses (one per distinct expert a layer call needs)."""
    hits: int = 0
    misses: int = 0
    preloads: int = 0        # experts read ahead of their layer
    preload_hits: int = 0    # accesses served by an expert that was read ahead and not yet used
    preload_cancelled: int = 0  # preloads dropped before their read started

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0


class ExpertCache:
    """Slot assignment for the experts of the MoE layers `layers` (in execution order).

    capacity: {layer: slots} (each layer its own partition of the bank) or an int (one pool).
    policy: one of POLICIES; "belady" needs `future`, the access trace [(layer, experts)] the
      cache will see, in order.
    widths: experts of mixed bit widths, {layer: int array [experts] of each expert's width};
      then capacity is {(layer, width): slots}, one partition per layer and width (a slot of a
      width's bank holds an expert of that width only).
    Slot ids are global: partitions are consecutive ranges, in `layers` (or `capacity`) order.
    """

    def __init__(self, layers, capacity, policy="lru", future=None, widths=None):
        if policy not in POLICIES:
            raise ValueError(f"unknown eviction policy {policy!r}; choose from {', '.join(POLICIES)}")
        if policy == "belady" and future is None:
            raise ValueError("the belady policy needs the future access trace")
        self.layers = list(layers)
        self.position = {layer: i for i, layer in enumerate(self.layers)}
        self.policy = policy
        self.widths = widths
        if isinstance(capacity, int):
            self.pool_of = {layer: None for layer in self.layers}
            capacity = {None: capacity}
        elif widths is None:
            self.pool_of = {layer: layer for layer in self.layers}
            capacity = {layer: capacity[layer] for layer in self.layers}
        # pools in `capacity`'s order; each takes the next range of slot ids
        self.free, self.pool_start, start = {}, {}, 0
        for pool, n in capacity.items():
            self.free[pool] = list(range(start, start + int(n)))[::-1]
            self.pool_start[pool] = start
            start += int(n)
        self.n_slots = start
        self.slot = {}            # (layer, expert) -> slot
        self.members = {p: set() for p in self.free}  # pool -> keys in it
        self.last_use, self.count = {}, {}
        self.pinned = set()       # keys the pending computation still reads
        self.preloaded = set()    # keys read ahead and not yet accessed
        self.busy = set()         # keys whose slot a background read may still be writing
        self.clock = 0
        self.stats = CacheStats()
        self.current_layer = self.layers[0] if self.layers else None
        self.future_positions = None
        if future is not None:
            self.future_positions = {}
            for t, (layer, experts) in enumerate(future):
                for e in set(int(x) for x in experts):
                    self.future_positions.setdefault((layer, e), []).append(t)

    def pool(self, key):
        """The partition (layer, expert) `key` lives in."""
        if self.widths is None:
            return self.pool_of[key[0]]
        return (key[0], int(self.widths[key[0]][key[1]]))

    def capacity_of(self, layer, expert=0) -> int:
        """Slots of the partition holding `layer`'s `expert` (any expert with uniform widths)."""
        pool = self.pool((layer, expert))
        return len(self.free[pool]) + len(self.members[pool])

    def access(self, layer, experts):
        """Slots of `experts` (distinct ints) at `layer`, and the [(expert, slot)] to read.

        The previous access's pins are released (its computation was evaluated by the host sync
        that produced these expert ids); this access's experts are pinned until the next one.
        """
        experts = list(dict.fromkeys(int(e) for e in experts))
        need = {}
        for e in experts:
            need[self.pool((layer, e))] = need.get(self.pool((layer, e)), 0) + 1
        for pool, n in need.items():
            have = len(self.free[pool]) + len(self.members[pool])
            if n > have:
                raise ValueError(f"layer {layer} needs {n} experts at once but has {have} slots"
                                 + (f" of width {pool[1]}" if self.widths is not None else ""))
        self.pinned = {(layer, e) for e in experts}
        self.current_layer = layer
        slots, misses = [], []
        for e in experts:
            key = (layer, e)
            self.count[key] = self.count.get(key, 0) + 1
            if key in self.slot:
                self.stats.hits += 1
                if key in self.preloaded:
                    self.stats.preload_hits += 1
                    self.preloaded.discard(key)
            else:
                self.stats.misses += 1
                self._place(key)
                misses.append((e, self.slot[key]))
            self.last_use[key] = self.clock
            slots.append(self.slot[key])
        self.clock += 1
        return slots, misses

    def preload(self, layer, experts):
        """[(expert, slot)] to read ahead for `layer` (experts not cached, in priority order).

        Preloads never evict a pinned expert nor one preloaded and not yet used; they stop when no
        slot is left to take.
        """
        out = []
        for e in experts:
            key = (layer, int(e))
            if key in self.slot:
                continue
            if not self._place(key, keep=self.pinned | self.preloaded | self.busy):
                break
            self.preloaded.add(key)
            self.last_use.setdefault(key, self.clock - 1)
            self.stats.preloads += 1
            out.append((int(e), self.slot[key]))
        return out

    def cancel(self, key):
        """Drop a preloaded (layer, expert) whose read never started: its slot is free again."""
        if key not in self.slot:
            return
        self.free[self.pool(key)].append(self.slot.pop(key))
        self.members[self.pool(key)].discard(key)
        self.preloaded.discard(key)
        self.stats.preload_cancelled += 1

    def cached(self, layer):
        """{expert: slot} of `layer`'s experts in the bank."""
        return {e: s for (l, e), s in self.slot.items() if l == layer}

    def forget(self):
        """Drop every cached expert (naive mode: each layer call reads its experts again)."""
        for key, slot in self.slot.items():
            self.free[self.pool(key)].append(slot)
        self.slot.clear()
        self.preloaded.clear()
        for keys in self.members.values():
            keys.clear()

    # -- internals ------------------------------------------------------------------------------
    def _place(self, key, keep=None) -> bool:
        pool = self.pool(key)
        if self.free[pool]:
            slot = self.free[pool].pop()
        else:
            keep = self.pinned | self.busy if keep is None else keep
            candidates = [k for k in self.members[pool] if k not in keep]
            if not candidates:
                return False
            victim = self._victim(candidates)
            slot = self.slot.pop(victim)
            self.members[pool].discard(victim)
            self.preloaded.discard(victim)
        self.slot[key] = slot
        self.members[pool].add(key)
        return True

    def _victim(self, candidates):
        if self.policy == "lru":
            return min(candidates, key=lambda k: (self.last_use.get(k, -1), k))
        if self.policy == "lfu":
            return min(candidates, key=lambda k: (self.count.get(k, 0), self.last_use.get(k, -1), k))
        if self.policy == "layer":
            now, n = self.position[self.current_layer], len(self.layers)

            def score(k):
                # Layers run now+1, now+2, ..., now: the current layer's other experts are
                # next needed a whole cycle later (distance n), the next layer's first (1).
                distance = (self.position[k[0]] - now - 1) % n + 1
                return (distance / max(self.count.get(k, 0), 1), -self.last_use.get(k, -1), k)
            return max(candidates, key=score)
        return max(candidates, key=lambda k: (self._next_use(k), k))

    def _next_use(self, key):
        times = self.future_positions.get(key, ())
        i = bisect.bisect_left(times, self.clock)
        return times[i] if i < len(times) else float("inf")


def simulate(trace, layers, capacity, policy, preload=None):
    """CacheStats of replaying `trace` [(layer, experts)] through an ExpertCache (no I/O).

    preload: optional callable(step, layer, experts) -> [(layer, predicted experts)] called after
      each access, whose predictions are preloaded before the next access (prediction + preload).
    """
    cache = ExpertCache(layers, capacity, policy, future=trace if policy == "belady" else None)
    for step, (layer, experts) in enumerate(trace):
        cache.access(layer, experts)
        if preload is not None:
            for next_layer, predicted in preload(step, layer, experts):
                cache.preload(next_layer, predicted)
    return cache.stats


def hit_curves(trace, layers, policy, sizes) -> dict:
    """{layer: [hits at each slot count in `sizes`]} of replaying each layer's accesses of `trace`
    alone: per-layer partitions never interact (the layer-aware policy's distance is the same for
    every expert of one layer, so it too decides within a partition alone)."""
    curves = {}
    for layer in layers:
        mine = [a for a in trace if a[0] == layer]
        curves[layer] = [simulate(mine, [layer], {layer: n}, policy).hits for n in sizes]
    return curves


def layer_capacities(trace, layers, total_slots, policy="lfu", min_slots=1, max_slots=None) -> dict:
    """{layer: slots} summing to at most `total_slots` that maximise the hits of `trace`
    [(layer, experts)] (a calibration routing trace), each layer within min_slots..max_slots:
    layers whose routing spreads over more experts get more slots than layers that keep choosing
    a few. Exact for the replayed trace (`hit_curves`, then `split_slots_by_curves`)."""
    layers = list(layers)
    hi = max_slots or max(len(set(e for a in trace if a[0] == layer for e in a[1])) for layer in layers)
    sizes = list(range(min_slots, max(hi, min_slots) + 1))
    return split_slots_by_curves(hit_curves(trace, layers, policy, sizes), sizes, total_slots)


def split_slots_by_curves(curves, sizes, total_slots) -> dict:
    """{layer: slots} from `sizes` maximising the summed hits `curves` {layer: [hits at each size]}
    with at most `total_slots` in all (the fewest slots among equally good splits): a knapsack
    over layers by dynamic programming (layers x total_slots x sizes)."""
    layers = list(curves)
    if total_slots < sizes[0] * len(layers):
        raise ValueError(f"{total_slots} slots cannot give {len(layers)} layers {sizes[0]} each")
    budget = min(total_slots, sizes[-1] * len(layers))
    # best[j][b]: most hits of the first j layers with b slots; choice[j][b]: layer j-1's size
    neg = float("-inf")
    best = [[neg] * (budget + 1) for _ in range(len(layers) + 1)]
    choice = [[0] * (budget + 1) for _ in range(len(layers) + 1)]
    best[0][0] = 0
    for j, layer in enumerate(layers):
        for b in range(budget + 1):
            if best[j][b] == neg:
                continue
            for i, n in enumerate(sizes):
                if b + n > budget:
                    break
                v = best[j][b] + curves[layer][i]
                if v > best[j + 1][b + n]:
                    best[j + 1][b + n], choice[j + 1][b + n] = v, n
    b = max(range(budget + 1), key=lambda x: (best[-1][x], -x))
    out = {}
    for j in range(len(layers), 0, -1):
        out[layers[j - 1]] = choice[j][b]
        b -= choice[j][b]
    return {layer: out[layer] for layer in layers}
