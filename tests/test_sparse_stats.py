"""sparse/stats.py: per-step and per-layer statistics of a flash model."""

import pytest

from mlx_flash.sparse.budget import MemoryPlan
from mlx_flash.sparse.stats import FlashStats


def _one_token(stats, layers):
    """One decode step through `layers` ({layer: (kind, bytes read, io seconds)})."""
    for layer, (kind, nbytes, io_s) in layers.items():
        step = stats.enter_layer(layer, 1)
        before = step.counters()
        step.bytes_read += nbytes
        step.io_s += io_s
        step.add_layer(layer, kind, before, call_s=2 * io_s)
    stats.finish()


def test_layer_summary_puts_the_plans_priced_read_time_beside_the_measured_one():
    plan = MemoryPlan("flash", 10, 20, 5, capacity={1: 8}, layer_read_s={0: 0.0, 1: 0.002})
    stats = FlashStats(plan)
    for _ in range(2):
        _one_token(stats, {0: ("resident", 0, 0.0), 1: ("sparse", 4096, 0.003)})
    rows = stats.layer_summary()
    assert rows[1]["plan_io_ms"] == pytest.approx(2.0) and rows[1]["io_ms"] == pytest.approx(3.0)
    assert rows[0]["plan_io_ms"] == 0.0 and rows[1]["cache_rows"] == 8
    # a plan without per-layer prices (no budget, or not flash): none shown
    bare = FlashStats(MemoryPlan("naive", None, 20, 5))
    _one_token(bare, {0: ("streamed", 4096, 0.001)})
    assert bare.layer_summary()[0]["plan_io_ms"] is None
