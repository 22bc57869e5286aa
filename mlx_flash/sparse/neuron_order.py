"""Neuron order by co-activation: put neurons that fire together next to each other on disk.

A flash read covers whole aligned blocks (4 KiB for direct I/O); with ~1 KB bundles a block holds
several neurons, so a sparse set of active neurons spread evenly over a layer still touches most
blocks. Reordering the neurons (a permutation of the bundles: the FFN output is a sum over
neurons, so any order computes the same function) so that each block holds neurons that are
active on the same tokens makes the blocks a token touches fewer and fuller.

`coactivation_order` groups neurons into blocks of `per_block` greedily: a block starts from the
most frequently active neuron left and grows by the neuron that adds the fewest new tokens to the
union of the tokens its members are active on (|m_j \\ union| = |m_j| - <union, m_j>, the overlaps
updated with each addition's new tokens only); blocks are then laid out hottest (largest union) first, so hot
blocks sit together and the read planner can merge them. This is PowerInfer's observation (hot /
cold neurons) with the block-level objective of LLM in a flash's bundling (appendix D's closest-
friend pairing loaded hot neurons repeatedly; a partition cannot).

Orders are permutations `order` with order[new_position] = original neuron id.
"""

import numpy as np


def coactivation_order(active: np.ndarray, per_block: int, band_blocks: int | None = 8) -> np.ndarray:
    """int64 [n] permutation (order[new position] = original neuron) from a boolean activity
    matrix active [tokens, n] (True = neuron active on that token); per_block >= 1 neurons per
    read block. band_blocks: group only within bands of band_blocks x per_block neurons of similar
    frequency (neurons sorted by frequency, bands laid out hottest first): the read planner merges
    reads across small gaps, so the span of a token's active neurons matters as much as how many
    blocks they touch, and unbanded grouping fills hot blocks with cold neurons (which add the
    fewest new tokens). None: one band. Cost: one pass over the union's tokens per block."""
    m = np.asarray(active, bool)
    if band_blocks:
        by_freq = frequency_order(m)
        size = max(1, band_blocks * max(1, int(per_block)))
        return np.concatenate([band[coactivation_order(m[:, band], per_block, None)]
                               for band in (by_freq[s: s + size] for s in range(0, m.shape[1], size))])
    n = m.shape[1]
    per_block = max(1, int(per_block))
    counts = m.sum(axis=0).astype(np.int64)
    left = np.ones(n, bool)
    ids = np.arange(n)
    blocks, heat = [], []
    while left.any():
        seed = int(ids[left][np.argmax(counts[left])])
        block, union = [seed], m[:, seed].copy()
        overlap = m[union].sum(axis=0).astype(np.int64)  # tokens of the union each neuron is active on
        left[seed] = False
        while len(block) < per_block and left.any():
            added = np.where(left, counts - overlap, np.iinfo(np.int64).max)
            # ties (e.g. neurons never active): prefer the more active one, then the lower id
            j = int(np.lexsort((ids, -counts, added))[0])
            new_tokens = m[:, j] & ~union
            overlap += m[new_tokens].sum(axis=0)
            union |= new_tokens
            block.append(j)
            left[j] = False
        blocks.append(block)
        heat.append(int(union.sum()))
    order = np.concatenate([blocks[b] for b in np.argsort(-np.asarray(heat), kind="stable")])
    return order.astype(np.int64)


def chain_order(active: np.ndarray) -> np.ndarray:
    """int64 [n] permutation: a nearest-neighbour chain, from the most active neuron on, each next
    neuron the one left most like the last by the Jaccard similarity of the tokens they are active
    on. Neighbours on disk are then neurons that fire on the same tokens, at any block size (the
    read planner merges reads through small gaps, so runs matter more than blocks). Cost: an
    n x n float32 similarity matrix (9.4 MB at 1536 neurons) and n passes over one row of it."""
    m = np.asarray(active, bool).astype(np.float32)
    counts = m.sum(axis=0)
    inter = m.T @ m
    union = counts[:, None] + counts[None, :] - inter
    sim = np.where(union > 0, inter / np.maximum(union, 1.0), 0.0)
    left = np.ones(len(counts), bool)
    cur = int(np.argmax(counts))  # ties: the lowest id
    out = [cur]
    left[cur] = False
    for _ in range(len(counts) - 1):
        # never-active neurons (similarity 0 to all) follow by activity, then id: argmax's first
        cur = int(np.argmax(np.where(left, sim[cur] + 1e-9 * counts, -1.0)))
        out.append(cur)
        left[cur] = False
    return np.asarray(out, np.int64)


def frequency_order(active: np.ndarray) -> np.ndarray:
    """int64 [n] permutation: neurons by how often they are active, most active first (stable)."""
    return np.argsort(-np.asarray(active, bool).sum(axis=0), kind="stable").astype(np.int64)


def inverse(order: np.ndarray) -> np.ndarray:
    """position [n] of each original neuron under `order`."""
    pos = np.empty_like(order)
    pos[order] = np.arange(len(order))
    return pos


def bytes_per_token(active: np.ndarray, order: np.ndarray, stride: int, *, offset: int = 0, align: int = 4096,
                    cost=None, max_read=1 << 20) -> dict:
    """What reading each token's active neurons of one layer costs under `order`, as the flash
    loader plans it (io.planner.plan_read_arrays: aligned, merged by `cost`'s rule).

    active [tokens, n] bool; stride: bundle bytes; offset: the layer's first bundle in its file;
    cost None: only overlapping or touching blocks are read once (the loader's cost model decides
    more merging; without any, it would read every bundle's blocks separately).
    Returns {"bytes": mean bytes read per token, "reads": mean reads per token,
    "needed": mean bundle bytes actually needed per token, "seconds": mean seconds per token of
    each token's reads as one loader call priced by `cost` (budget.call_seconds: the read time
    the memory plan prices), None without a cost}.
    """
    from ..io.planner import ReadCost, plan_read_arrays
    from .budget import call_seconds

    priced, cost = cost, cost or ReadCost(0.0, 1e9)  # merge gap 0
    pos = inverse(np.asarray(order, np.int64))
    total_bytes = total_reads = needed = seconds = 0
    for row in np.asarray(active, bool):
        ids = np.flatnonzero(row)
        if len(ids) == 0:
            continue
        starts = offset + np.sort(pos[ids]) * stride
        r0, r1, _ = plan_read_arrays(starts, stride, align=align, cost=cost, max_read=max_read)
        total_bytes += int((r1 - r0).sum())
        total_reads += len(r0)
        needed += len(ids) * stride
        if priced is not None:
            seconds += call_seconds(priced, len(r0), float((r1 - r0).sum()))
    t = max(1, len(active))
    return {"bytes": total_bytes / t, "reads": total_reads / t, "needed": needed / t,
            "seconds": seconds / t if priced is not None else None}
