"""moe/bitwidths.py: each expert's quantization error per width and the widths under a target."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_flash.errors import FlashError
from mlx_flash.moe.bitwidths import WIDTHS, assign_widths, mean_bits, quantization_errors


def _experts(n=3, hidden=64, ffn=32, seed=0):
    mx.random.seed(seed)
    return {"gate": mx.random.normal((n, ffn, hidden)) * 0.1,
            "up": mx.random.normal((n, ffn, hidden)) * 0.1,
            "down": mx.random.normal((n, hidden, ffn)) * 0.1}


def test_errors_fall_with_width_and_unrouted_experts_cost_nothing():
    experts = _experts()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 64)).astype(np.float32)
    ids = np.where(rng.random((40, 1)) < 0.5, 0, 1)  # expert 2 is never routed to
    err = quantization_errors(x, ids, np.ones(ids.shape), experts, lambda u, g: nn.silu(g) * u, 32)
    assert err.shape == (3, len(WIDTHS)) and np.all(err[2] == 0)
    assert np.all(np.diff(err[:2], axis=1) < 0), err  # 2 > 3 > 4 > 8 bits
    # expert 0's 2-bit error written out: its tokens through the float and the 2-bit expert
    rows = np.flatnonzero(ids[:, 0] == 0)
    xe = mx.array(x[rows])

    def out(w):
        return (nn.silu(xe @ w["gate"].T) * (xe @ w["up"].T)) @ w["down"].T
    q = {r: mx.dequantize(*mx.quantize(m[0], group_size=32, bits=2), group_size=32, bits=2)
         for r, m in experts.items()}
    want = float(mx.sum((out(q) - out({r: m[0] for r, m in experts.items()})) ** 2))
    # relative to the layer's output energy: every routed token through its float expert
    energy = 0.0
    for e in (0, 1):
        xe = mx.array(x[ids[:, 0] == e])
        energy += float(mx.sum(out({r: m[e] for r, m in experts.items()}) ** 2))
    assert err[0, 0] == pytest.approx(want / energy, rel=1e-4)


def test_assignment_meets_the_target_and_widens_the_costly_experts():
    errors = {0: np.array([[100.0, 40, 10, 0.1], [1.0, 0.5, 0.2, 0.0]]),
              1: np.array([[5.0, 2, 1, 0.0], [50.0, 20, 5, 0.05]])}
    bits = assign_widths(errors, 3.0)
    assert mean_bits(bits) <= 3.0
    assert bits[0][0] > bits[0][1] and bits[1][1] > bits[1][0]
    assert assign_widths(errors, 2.0) == {0: [2, 2], 1: [2, 2]}
    assert assign_widths(errors, 8.0) == {0: [8, 8], 1: [8, 8]}
    # brute force over every assignment within the budget: greedy is as good here
    import itertools

    keys = [(0, 0), (0, 1), (1, 0), (1, 1)]
    best = min((sum(errors[k[0]][k[1], WIDTHS.index(b)] for k, b in zip(keys, c)), c)
               for c in itertools.product(WIDTHS, repeat=4) if np.mean(c) <= 3.0)
    got = sum(errors[layer][e, WIDTHS.index(b)] for layer, ws in bits.items() for e, b in enumerate(ws))
    assert got == pytest.approx(best[0])
    with pytest.raises(FlashError, match="--expert-bits 9"):
        assign_widths(errors, 9)


def test_knapsack_finds_the_wide_step_greedy_misses():
    # expert 0 gains little from 3 or 4 bits but everything from 8; greedy never gets there
    errors = {0: np.array([[10.0, 9.9, 9.8, 0.0], [5.0, 1.0, 0.5, 0.4]])}
    assert assign_widths(errors, 5.0, solver="greedy") == {0: [4, 4]}
    assert assign_widths(errors, 5.0) == {0: [8, 2]}
    # random curves: the knapsack is the brute-force optimum under the mean
    import itertools

    rng = np.random.default_rng(0)
    keys = [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]
    for target in (2.4, 3.0, 3.6, 5.0):
        errors = {0: np.sort(rng.random((2, 4)), 1)[:, ::-1] * [1, 0.8, 0.3, 0.0],
                  1: np.sort(rng.random((3, 4)), 1)[:, ::-1] * [1, 0.9, 0.5, 0.1]}
        best = min(sum(errors[k[0]][k[1], WIDTHS.index(b)] for k, b in zip(keys, c))
                   for c in itertools.product(WIDTHS, repeat=5) if np.mean(c) <= target)
        bits = assign_widths(errors, target)
        got = sum(errors[layer][e, WIDTHS.index(b)] for layer, ws in bits.items()
                  for e, b in enumerate(ws))
        assert mean_bits(bits) <= target and got == pytest.approx(best)
    with pytest.raises(FlashError, match="--expert-assign nope"):
        assign_widths(errors, 3.0, solver="nope")
