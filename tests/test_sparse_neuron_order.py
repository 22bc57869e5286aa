"""sparse/neuron_order: co-activation order of a layer's neurons and the bytes it saves per token."""

import numpy as np
import pytest

from mlx_flash.io.planner import ReadCost
from mlx_flash.sparse import neuron_order as no


def clustered_activity(tokens=600, groups=48, size=4, seed=0):
    """[tokens, groups*size] activity: each group of `size` neurons fires together (a latent per
    group, each member dropping out 10% of the time), groups' rates 2-30%; neurons shuffled."""
    rng = np.random.default_rng(seed)
    rates = rng.uniform(0.02, 0.3, groups)
    latent = rng.random((tokens, groups)) < rates
    active = np.repeat(latent, size, axis=1) & (rng.random((tokens, groups * size)) > 0.1)
    shuffle = rng.permutation(groups * size)
    return active[:, shuffle]


def test_order_is_a_permutation_and_groups_coactive_neurons():
    active = clustered_activity()
    order = no.coactivation_order(active, per_block=4)
    assert sorted(order.tolist()) == list(range(active.shape[1]))
    assert np.array_equal(no.inverse(order)[order], np.arange(len(order)))
    fit, held = active[:400], active[400:]
    stride = 1024  # 4 bundles per 4 KiB block
    order = no.coactivation_order(fit, per_block=4096 // stride)
    base = no.bytes_per_token(held, np.arange(active.shape[1]), stride)
    ours = no.bytes_per_token(held, order, stride)
    freq = no.bytes_per_token(held, no.frequency_order(fit), stride)
    assert base["needed"] == ours["needed"]  # the same neurons
    assert base["bytes"] / ours["bytes"] > 2.0, (base, ours)
    assert ours["bytes"] < freq["bytes"] < base["bytes"] * 1.05


def test_bytes_per_token_follows_the_planner():
    active = np.zeros((2, 16), bool)
    active[0, [0, 1]] = True  # adjacent bundles: one 4 KiB block
    active[1, [0, 15]] = True  # blocks 0 and 3: two reads, one only when the gap is cheap
    r = no.bytes_per_token(active, np.arange(16), 1024)
    assert r == {"bytes": (4096 + 8192) / 2, "reads": 1.5, "needed": 2048.0, "seconds": None}
    merged = no.bytes_per_token(active, np.arange(16), 1024, cost=ReadCost(1e-3, 1e9))  # 1 MB gap is cheap
    assert merged["reads"] == 1.0 and merged["bytes"] == (4096 + 16384) / 2
    # priced as the plan prices one loader call per token: 1 ms per read + bytes at 1 GB/s
    assert merged["seconds"] == pytest.approx(1e-3 + (4096 + 16384) / 2 / 1e9)
    flipped = no.bytes_per_token(active, np.r_[np.arange(1, 15), 0, 15], 1024)  # 0 and 15 now adjacent
    assert flipped["bytes"] == (8192 + 4096) / 2 and flipped["reads"] == 1.5  # token 0 now split


def test_chain_order_puts_neurons_that_fire_together_next_to_each_other():
    active = clustered_activity(groups=24, size=6, seed=1)
    fit, held = active[:400], active[400:]
    order = no.chain_order(fit)
    assert sorted(order.tolist()) == list(range(active.shape[1]))
    # read through no gaps at all (touching blocks only), one bundle per 4 KiB block: the chain
    # keeps each group in one run, so a token reads about one run per active group
    stride = 4096
    chain = no.bytes_per_token(held, order, stride)
    freq = no.bytes_per_token(held, no.frequency_order(fit), stride)
    assert chain["bytes"] == freq["bytes"] == chain["needed"]  # the same neurons, no gaps read
    assert chain["reads"] < 0.5 * freq["reads"], (chain, freq)
