"""Routing traces and next-layer predictors."""

from pathlib import Path

import numpy as np
from conftest import write_tiny_moe

from mlx_flash.models import load_model
from mlx_flash.moe.cache import simulate
from mlx_flash.moe.predict import (RoutingProfile, RoutingTrace, predictions, preload_plan,
                                   recall_precision, record_routing)


def _chain_trace(tokens=400, layers=4, experts=8, seed=0):
    """Expert at layer j+1 = (expert at j + 3) % E, first layer's expert random: fully predictable."""
    rng = np.random.default_rng(seed)
    ex = np.zeros((tokens, layers, 1), np.int64)
    ex[:, 0, 0] = rng.integers(0, experts, tokens)
    for j in range(1, layers):
        ex[:, j, 0] = (ex[:, j - 1, 0] + 3) % experts
    return RoutingTrace(ex, np.full((tokens, layers, 1), -1), list(range(layers)))


def test_profile_learns_a_deterministic_chain_and_preload_turns_misses_into_hits():
    trace = _chain_trace()
    profile = RoutingProfile(_chain_trace(seed=1), 8)
    pred = predictions(trace, "profile", 1, profile)
    assert recall_precision(trace, pred) == (1.0, 1.0)
    plan = preload_plan(trace, pred)
    cap = {j: 2 for j in trace.layers}
    plain = simulate(trace.accesses(), trace.layers, cap, "lru")
    ahead = simulate(trace.accesses(), trace.layers, cap, "lru", preload=plan)
    assert ahead.hit_rate > 0.7 > plain.hit_rate and ahead.preload_hits > 0


def test_record_routing_matches_the_routers_choice(tmp_path):
    src = write_tiny_moe(tmp_path / "m", "qwen3_moe", experts=6, layers=3)
    model, _ = load_model(Path(src))
    tokens = np.random.default_rng(0).integers(0, 128, 40).astype(np.int32)
    trace = record_routing(model, tokens, width=2, seq_len=16)
    assert trace.experts.shape == (40, 3, 2) and trace.layers == [0, 1, 2]
    # the lookahead at layer j guesses with layer j+1's router; at the last layer nothing
    import mlx.core as mx
    x = mx.random.normal((5, 64))
    block = model.layers[1].mlp
    gates = np.array(block.gate(x))
    from mlx_flash.moe.switch import router_lookahead
    guess = np.array(router_lookahead(block, 2)(x))
    assert all(set(g) == set(np.argsort(-row)[:2]) for g, row in zip(guess, gates))
    rec, prec = recall_precision(trace, predictions(trace, "lookahead", 2))
    assert 0.0 < rec <= 1.0 and rec == prec
