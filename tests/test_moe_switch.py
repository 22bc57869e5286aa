"""StreamedSwitchGLU: logits bit-identical to mlx-lm's fully loaded MoE model, any cache size."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import MOE_ARCHS, write_tiny_moe

from mlx_flash.config import FlashConfig
from mlx_flash.models import load_model
from mlx_flash.models.moe import build_moe_model
from mlx_flash.moe.cache import POLICIES
from mlx_flash.pack import write_pack

E = 6
PROMPT = mx.array([[3, 17, 42, 5, 99, 64, 1, 7, 12, 33, 21, 8, 90, 101, 2, 77, 45, 6, 19, 27,
                    11, 56, 4, 88, 63, 9, 30, 15, 72, 38, 49, 20]])  # 32 tokens x top-2 = 64: sorted path


def _generate_logits(model, steps=3):
    """Logits of a prompt (sorted gather path) then of greedy decode steps (unsorted path)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    out = [model(PROMPT, cache=cache)[0, -1]]
    for _ in range(steps):
        tok = mx.argmax(out[-1])[None, None]
        out.append(model(tok, cache=cache)[0, -1])
    mx.eval(out)
    return [np.array(o) for o in out]


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    made = {}

    def get(arch, quantize):
        key = (arch, quantize)
        if key not in made:
            root = tmp_path_factory.mktemp(f"{arch}{'q' if quantize else 'f'}")
            src = write_tiny_moe(root / "src", arch, quantize=quantize, experts=E)
            write_pack(src, root / "pack", progress=False)
            ref, _ = load_model(src)
            made[key] = (root / "pack", _generate_logits(ref))
        return made[key]
    return get


@pytest.mark.parametrize("quantize", [None, (4, 32)], ids=["float", "q4"])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_streamed_experts_bit_identical_every_cache_size(packs, arch, quantize):
    pack, want = packs(arch, quantize)
    for slots in range(2, E + 1):  # top-2: fewer than 2 slots cannot hold one token's experts
        for policy in ("lru", "layer"):
            model = build_moe_model(pack, FlashConfig(mode="hybrid"), capacity=slots, policy=policy)
            got = _generate_logits(model)
            for g, w in zip(got, want):
                np.testing.assert_array_equal(g, w, err_msg=f"{arch} slots={slots} {policy}")
            assert model.moe_store.cache.stats.misses > 0


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2"])
def test_modes_and_predictors_bit_identical(packs, arch):
    pack, want = packs(arch, (4, 32))
    runs = [("dense", {}), ("naive", {}), ("flash", {"predictor": "lookahead"}),
            ("flash", {"predictor": "lookahead", "preload_width": 4, "capacity": 3})]
    runs += [("hybrid", {"policy": p, "capacity": 3}) for p in POLICIES if p != "belady"]
    for mode, kw in runs:
        model = build_moe_model(pack, FlashConfig(mode=mode), **kw)
        for g, w in zip(_generate_logits(model), want):
            np.testing.assert_array_equal(g, w, err_msg=f"{mode} {kw}")
    store = model.moe_store
    assert store.host_syncs > 0 and store.bytes_read > 0
