"""moe/store.py: expert widths of a pack and how a layer's slots split over its width banks."""

import numpy as np
import pytest
from conftest import write_tiny_moe

from mlx_flash.moe.store import expert_layers, expert_widths, split_slots, width_groups
from mlx_flash.pack import read_manifest, write_pack


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    root = tmp_path_factory.mktemp("store")
    src = write_tiny_moe(root / "src", "mixtral", experts=6, layers=2)
    bits = {0: [2, 4, 4, 8, 2, 2], 1: [3, 3, 3, 3, 3, 3]}
    return (read_manifest(write_pack(src, root / "mixed", progress=False, expert_bits=bits,
                                     group_size=32)),
            read_manifest(write_pack(src, root / "float", progress=False)), bits)


def test_expert_widths_and_groups(packs):
    mixed, dense, bits = packs
    assert expert_widths(mixed) == bits
    assert expert_widths(dense) == {0: [16] * 6, 1: [16] * 6}
    groups = width_groups(expert_layers(mixed)[0])
    assert {w: ids.tolist() for w, (_, ids) in groups.items()} == {2: [0, 4, 5], 4: [1, 2], 8: [3]}
    assert {w: key for w, (key, _) in groups.items()} == {2: (0, 2), 4: (0, 4), 8: (0, 8)}


def test_slots_split_over_widths_by_their_share_of_experts(packs):
    mixed, dense, _ = packs
    layer0 = expert_layers(mixed)[0]
    assert split_slots(layer0, 6) == {2: 3, 4: 2, 8: 1}
    assert split_slots(layer0, 2) == {2: 1, 4: 1, 8: 1}   # every width keeps one slot
    assert split_slots(expert_layers(mixed)[1], 4) == {3: 4}
    assert split_slots(expert_layers(dense)[0], 4) == {0: 4}


class GatedLoader:
    """A FlashLoader whose background (non-main-thread) reads wait for `gate`: a preload can be
    held in flight while the main thread routes."""

    def __init__(self, loader):
        import threading

        self.loader, self.gate, self.started = loader, threading.Event(), threading.Event()
        self.main = threading.get_ident()

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def read_many(self, calls):
        import threading

        if threading.get_ident() != self.main:
            self.started.set()
            assert self.gate.wait(10), "the test never opened the gate"
        return self.loader.read_many(calls)


@pytest.fixture()
def gated_store(tmp_path):
    from mlx_flash.io import FlashLoader
    from mlx_flash.moe.store import ExpertStore

    pack = write_pack(write_tiny_moe(tmp_path / "src", "mixtral", experts=6, layers=2),
                      tmp_path / "p", progress=False)
    loader = GatedLoader(FlashLoader(pack))
    store = ExpertStore(loader, expert_layers(read_manifest(pack)), {0: 4, 1: 4})
    yield store, loader
    loader.gate.set()
    store.close()
    loader.loader.close()


def _bank_holds(store, layer, expert):
    """True when the bank row of `expert` holds exactly its bytes in the pack."""
    ref = store.loader.loader.alloc(store.groups[layer][next(iter(store.groups[layer]))][0], 1)
    store.loader.loader.read(store.groups[layer][next(iter(store.groups[layer]))][0], [expert], ref)
    slot = store.cache.slot[(layer, expert)]
    return all(np.array_equal(np.array(store.bank[k][slot]), np.array(ref[k][0])) for k in ref)


def test_a_layer_waits_only_for_the_preloads_it_needs(gated_store):
    store, loader = gated_store
    for ids in ([2, 3], [4, 5]):              # layer 1's 4 slots full (LRU: 2, 3 oldest)
        store.read(1, store.assign(1, np.array([ids]))[2])
    store.preload(1, [0, 1], limit=2)         # 0 goes in flight, 1 waits in the queue
    assert loader.started.wait(10)
    # layer 1 routes to 1 and 2: the read in flight (expert 0) is not needed, so nothing waits
    # for it (its gate is still shut); 1 never started: cancelled, read on demand with 2
    lut, banks, reads = store.assign(1, np.array([[1, 2]]))
    assert store.cache.stats.preload_cancelled == 1
    assert sorted(int(e) for experts, _, _ in reads for e in experts) == [1, 2]
    assert store.io_log["preload_wait"] == {}
    # expert 0's row may still be written: no read of this call lands in it (LRU alone would
    # take it: it ties with 4 and 5 as the least recently used)
    busy = store.cache.slot[(1, 0)]
    assert busy not in {int(r) for _, rows, _ in reads for r in rows}
    store.read(1, reads)
    loader.gate.set()
    store.wait_preload()
    assert all(_bank_holds(store, 1, e) for e in (0, 1, 2))


def test_a_needed_preload_in_flight_is_waited_for_and_logged(gated_store):
    import threading

    store, loader = gated_store
    store.preload(1, [3], limit=1)
    assert loader.started.wait(10)
    threading.Timer(0.2, loader.gate.set).start()
    lut, banks, reads = store.assign(1, np.array([[3, 4]]))
    assert [int(e) for experts, _, _ in reads for e in experts] == [4]  # 3 landed while we waited
    (calls, nbytes, seconds), = store.io_log["preload_wait"].values()
    assert calls == 1 and nbytes == store.entries[1].stride and seconds > 0.05
    assert store.cache.stats.preload_hits == 1
    store.read(1, reads)
    assert _bank_holds(store, 1, 3) and _bank_holds(store, 1, 4)


def test_preload_width_is_what_the_measured_compute_window_hides(gated_store):
    store, _ = gated_store
    assert store.preload_limit() == 0                      # nothing measured yet
    store.window_s, store.expert_read_s = 0.010, 0.004    # 10 ms of compute, 4 ms per expert
    assert store.preload_limit() == 0                      # preloading measured slower: off
    store.preload_on = True
    assert store.preload_limit() == 2
    store.max_preload = 1
    assert store.preload_limit() == 1
    store.expert_read_s = 0.012                            # a read outlasts a layer: preload off
    assert store.preload_limit() == 0
    store.adaptive = False                                 # a fixed width
    assert store.preload_limit() == 1


def test_preload_is_switched_on_or_off_by_the_measured_token_time(gated_store):
    from mlx_flash.moe.store import PROBE_TOKENS, REPROBE_TOKENS

    store, _ = gated_store

    def run(token_ms, tokens):
        """Passes of the given ms per token under each setting -> the setting of each token."""
        used, t = [], 0.0
        for _ in range(tokens):
            store.pass_started(t)
            used.append(store.preload_on)
            t += token_ms[store.preload_on] / 1e3
        return used

    # prompt and first decode token untimed (off), then PROBE_TOKENS off, PROBE_TOKENS on
    used = run({False: 100, True: 60}, 40)
    assert used[:2 + 2 * PROBE_TOKENS] == [False] * (2 + PROBE_TOKENS) + [True] * PROBE_TOKENS
    assert store.token_s[True] == pytest.approx(0.060) and store.token_s[False] == pytest.approx(0.100)
    # preloading is faster: on, but for the re-timing of "off" every REPROBE_TOKENS tokens
    later = used[2 + 2 * PROBE_TOKENS:]
    assert later.count(False) == sum(  # timed token k is used[k + 2]
        1 for k in range(2 * PROBE_TOKENS, 40 - 2) if k % REPROBE_TOKENS < PROBE_TOKENS) > 0
    assert later.count(True) > 3 * later.count(False)
    # the machine changes: preloading now costs more than it saves; it is turned off
    used = run({False: 100, True: 200}, 40)
    assert used[-10:].count(True) <= PROBE_TOKENS and used[-1] is False


def test_routing_the_first_layer_times_a_pass(gated_store):
    store, _ = gated_store
    for ids in ([0, 1], [2, 3], [0, 2], [1, 3], [4, 5]):   # five passes: prompt, then tokens
        store.read(0, store.assign(0, np.array([ids]))[2])
        store.read(1, store.assign(1, np.array([ids]))[2])
    assert store.token_s[False] is not None and store.token_s[True] is None  # 2 timed, off
