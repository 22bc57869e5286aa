"""bench/fuzz.py in the suite: a bounded hypothesis run of every target (manifest, predictors and
GGUF readers, CPU kernels vs their float32 references): no traceback, no crash."""

import pytest

pytest.importorskip("hypothesis")

from mlx_flash.bench.fuzz import TARGETS, fuzz_target  # noqa: E402

EXAMPLES = {"manifest": 25, "manifest-endor": 25, "predictors": 40, "gguf": 60, "kernels": 150}


@pytest.mark.parametrize("target", TARGETS)
def test_fuzz_target_has_no_tracebacks(target, tmp_path):
    if target == "gguf":
        pytest.importorskip("gguf")
    out = fuzz_target(target, tmp_path, max_examples=EXAMPLES[target], seed=0)
    assert out["cases"] >= EXAMPLES[target] // 2
    assert out["tracebacks"] == [], out["tracebacks"][0]
