"""mlx_flash.cpu.patch: patch_layers re-classes a model's modules to run on the kernels."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from cpu_checks import TINY_LLAMA_VARIANTS, _f32, needs_ext
from cpu_checks import _cpu_and_enabled  # noqa: F401  (pytest fixture)

from mlx_flash.cpu import ops
from mlx_flash.cpu.patch import patch_layers


def test_fallback_when_disabled_patches_nothing():
    ops.set_kernels_enabled(False)
    model = nn.Sequential(nn.Linear(8, 8))
    model.set_dtype(mx.float16)
    assert patch_layers(model) == 0
    assert type(model.layers[0]) is nn.Linear


@needs_ext
@TINY_LLAMA_VARIANTS
def test_patch_layers_logits_match(tiny_llama, variant):
    from mlx_lm.utils import load_model

    path = tiny_llama("m", **variant)
    model, _ = load_model(path)
    tokens = mx.array([[1, 5, 9, 2, 7, 3]])
    dense = model(tokens)  # prefill shape: 6 rows -> kernels (M <= 8)
    step = model(tokens[:, :1])
    mx.eval(dense, step)
    swapped = patch_layers(model)
    # 2 layers x (7 projections + 2 RMSNorms + RoPE + the block itself, fused) + the final norm + the
    # embedding (its as_linear is the tied lm_head) [+ untied lm_head]
    assert swapped == 2 * 11 + 2 + (not variant.get("tie", True))
    assert patch_layers(model) == 0  # already patched
    patched, patched_step = model(tokens), model(tokens[:, :1])
    tol = {None: 1e-4}.get(variant.get("dtype"), 2e-2)  # half models round activations to 2^-8..2^-11
    for a, r in ((patched, dense), (patched_step, step)):
        a, r = _f32(a), _f32(r)
        assert np.max(np.abs(a - r)) <= tol * max(1.0, np.max(np.abs(r))), np.max(np.abs(a - r))
