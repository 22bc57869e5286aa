"""ExpertCache: eviction policies and the offline Belady bound."""

import random

import pytest

from mlx_flash.moe.cache import POLICIES, ExpertCache, simulate


def test_lru_lfu_layer_choose_their_victims():
    c = ExpertCache([0], {0: 2}, "lru")
    c.access(0, [1]); c.access(0, [2]); c.access(0, [1])
    _, misses = c.access(0, [3])
    assert misses and c.cached(0).keys() == {1, 3}          # 2 was least recently used
    c = ExpertCache([0], {0: 2}, "lfu")
    c.access(0, [1]); c.access(0, [1]); c.access(0, [2])
    c.access(0, [3])
    assert c.cached(0).keys() == {1, 3}                     # 2 was used once, 1 twice
    # One pool for 3 layers: at layer 1, layer 2 runs next, then 0, then 1 again: layer 1's
    # other expert is needed last and goes, at equal frequency.
    c = ExpertCache([0, 1, 2], 3, "layer")
    c.access(0, [5]); c.access(1, [5]); c.access(2, [5])
    c.access(1, [6])
    assert (1, 5) not in c.slot and (2, 5) in c.slot and (0, 5) in c.slot
    # ... unless used more often: layer 1's expert 5 (3 uses, distance 3) outlives layer 0's
    # new expert 7 (1 use, distance 2)
    c = ExpertCache([0, 1, 2], 3, "layer")
    for _ in range(3):
        c.access(0, [5]); c.access(1, [5]); c.access(2, [5])
    c.access(0, [7])
    c.access(1, [6])
    assert (1, 5) in c.slot


def test_pinned_experts_are_never_evicted_and_over_capacity_fails():
    c = ExpertCache([0], {0: 2}, "lru")
    slots, misses = c.access(0, [0, 1])
    assert sorted(slots) == [0, 1] and len(misses) == 2
    assert c.preload(0, [2]) == []                           # both slots pinned by the pending call
    with pytest.raises(ValueError):
        c.access(0, [0, 1, 2])


def test_belady_is_the_bound_for_every_policy():
    rng = random.Random(0)
    hot = [[0, 1], [1, 2], [0, 3]]
    trace = []
    for _ in range(400):
        for layer in range(3):
            trace.append((layer, rng.choice(hot) if rng.random() < 0.7 else rng.sample(range(8), 2)))
    rates = {p: simulate(trace, [0, 1, 2], {0: 4, 1: 4, 2: 4}, p).hit_rate for p in POLICIES}
    assert all(rates["belady"] >= r for r in rates.values())
    assert rates["belady"] > rates["lru"]
    # a b c a b with 2 slots: Belady evicts b for c (next used last) and hits a; LRU hits nothing.
    t = [(0, [0]), (0, [1]), (0, [2]), (0, [0]), (0, [1])]
    assert simulate(t, [0], {0: 2}, "belady").hits == 1
    assert simulate(t, [0], {0: 2}, "lru").hits == 0


def test_layer_capacities_give_slots_where_routing_spreads():
    from mlx_flash.moe.cache import layer_capacities

    rng = random.Random(1)
    trace = []
    for _ in range(300):
        trace.append((0, [rng.choice([0, 1])]))               # layer 0 keeps choosing 2 experts
        trace.append((1, [rng.randrange(6)]))                 # layer 1 spreads over 6
        trace.append((2, rng.sample(range(4), 2)))            # layer 2 over 4, two at a time
    cap = layer_capacities(trace, [0, 1, 2], 12, "lru", min_slots=2)
    assert cap == {0: 2, 1: 6, 2: 4}
    equal = simulate(trace, [0, 1, 2], {0: 4, 1: 4, 2: 4}, "lru").hit_rate
    assert simulate(trace, [0, 1, 2], cap, "lru").hit_rate > equal + 0.08
    small = layer_capacities(trace, [0, 1, 2], 8, "lfu", min_slots=2)
    assert sum(small.values()) <= 8 and min(small.values()) >= 2
    assert simulate(trace, [0, 1, 2], small, "lfu").hits >= max(
        simulate(trace, [0, 1, 2], {0: a, 1: b, 2: 8 - a - b}, "lfu").hits
        for a in range(2, 5) for b in range(2, 5) if 8 - a - b >= 2)
