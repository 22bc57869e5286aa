"""Running a model step by step as generation does, for the flash-mode tests."""

import os

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

TOKENS = [[5, 17, 3, 99, 42, 7], [11], [64], [2], [120]]  # a prompt, then four decode steps


def run_steps(model):
    """Logits of a prompt then single-token steps through a KV cache, as generation runs them."""
    cache = make_prompt_cache(model)
    out = []
    for ids in TOKENS:
        y = model(mx.array([ids]), cache=cache)
        mx.eval(y)
        out.append(y)
    if hasattr(model, "flash_stats"):
        model.flash_stats.finish()
    return out


def run_steps_lazily(model):
    """run_steps' logits with each step's graph built before the last one is evaluated, as
    mlx-lm's generate does: a decode step's ids depend on the last step's logits (their values
    are TOKENS'), and nothing is evaluated until every step is built."""
    cache = make_prompt_cache(model)
    out = []
    for ids in TOKENS:
        x = mx.array([ids])
        if out:
            x = x + 0 * mx.argmax(out[-1][:, -1:, :], axis=-1).astype(x.dtype)
        out.append(model(x, cache=cache))
    mx.eval(out)
    if hasattr(model, "flash_stats"):
        model.flash_stats.finish()
    return out


def all_neurons(n):
    return lambda x: mx.ones((*x.shape[:-1], n), dtype=mx.bool_)


def assert_identical(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == y.dtype and mx.array_equal(x, y).item(), f"step {i}: max diff {mx.abs(x - y).max()}"


def open_files_under(folder) -> list[str]:
    """Paths under `folder` this process holds open (Linux: /proc/self/fd)."""
    root = os.path.realpath(folder) + os.sep
    paths = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed while listing
        if target.startswith(root):
            paths.append(target)
    return paths
