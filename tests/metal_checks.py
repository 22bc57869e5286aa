"""Shared pieces of the Metal kernel tests (test_metal_kernels, test_metal_endor): where the kernels
run (the GPU on a Mac, else the Linux emulator under each schedule), the tolerance of a 16-bit
output, and the seeded-bug factory that mutates a kernel source before the emulator builds it."""

import sys

import mlx.core as mx
import numpy as np
import pytest

from mlx_flash.metal import emulator as em

ON_MAC = sys.platform == "darwin" and mx.metal.is_available()
if ON_MAC:
    BACKENDS = ["metal"]
elif sys.platform != "darwin" and em.compiler() is not None:
    BACKENDS = list(em.SCHEDULES)
else:
    BACKENDS = []
needs_backend = pytest.mark.skipif(not BACKENDS, reason="needs Apple Silicon (Metal) or, on Linux, g++ for the "
                                                        "Metal emulator")
emulated = pytest.mark.skipif(sys.platform == "darwin" or em.compiler() is None,
                              reason="seeded bugs run in the Linux emulator (needs g++)")


def as_f64(a):
    return np.array(a.astype(mx.float32), np.float64)


def run_kernel(fn, backend, *args, metal_kernel=None, **kwargs):
    """fn (a *_metal function) on the backend: the GPU, or the emulator under a schedule."""
    if backend == "metal":
        return fn(*args, **kwargs)
    return fn(*args, metal_kernel=metal_kernel or em.metal_kernel, schedule=backend, seed=7, **kwargs)


def tolerance(dtype):
    """One rounding of the output (and x) to 16 bits; float32 outputs: float32 sums."""
    return {mx.float16: 2e-3, mx.bfloat16: 1.6e-2}.get(dtype, 1e-5)


def check_close(got, want, dtype, skip=None, scale=1.0):
    """|got - want| <= tolerance(dtype) * scale * max(1, max |want|), outside the `skip` mask."""
    got = as_f64(got)
    assert got.shape == want.shape
    if skip is not None:
        got, want = got[~skip], want[~skip]
    bound = tolerance(dtype) * scale * max(1.0, float(np.abs(want).max()) if want.size else 1.0)
    err = float(np.abs(got - want).max()) if want.size else 0.0
    assert err <= bound, f"max error {err:.3g} > {bound:.3g}"


def mutated(old, new, where="source"):
    """A metal_kernel factory that builds the emulated kernel from a source with `old` -> `new`."""

    def factory(**kw):
        assert old in kw[where], f"mutation target not found: {old!r}"
        kw[where] = kw[where].replace(old, new)
        return em.metal_kernel(**kw)

    return factory


def schedules_caught(run_under, want, dtype) -> int:
    """How many emulator schedules give a result (run_under(schedule)) that check_close rejects
    against `want`: a race shows under at least one."""
    caught = 0
    for schedule in em.SCHEDULES:
        try:
            check_close(run_under(schedule), want, dtype)
        except AssertionError:
            caught += 1
    return caught
