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


def _mixed_bits(n_layers, seed=0):
    """Widths 2/3/4/8 per (layer, expert), every width present in every layer."""
    rng = np.random.default_rng(seed)
    return {layer: rng.permutation([2, 3, 4, 8, 4, 2])[:E].tolist() for layer in range(n_layers)}


@pytest.fixture(scope="module")
def mixed_packs(tmp_path_factory):
    made = {}

    def get(arch):
        if arch not in made:
            root = tmp_path_factory.mktemp(f"{arch}mixed")
            src = write_tiny_moe(root / "src", arch, experts=E)
            bits = _mixed_bits(3)
            write_pack(src, root / "pack", progress=False, expert_bits=bits, group_size=32)
            made[arch] = (src, root / "pack", bits)
        return made[arch]
    return get


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v2"])
def test_mixed_widths_bit_identical_to_resident_model_every_cache_size(mixed_packs, arch):
    src, pack, bits = mixed_packs(arch)
    ref = build_moe_model(pack, FlashConfig(mode="dense"))
    want = _generate_logits(ref)
    runs = [("hybrid", {"capacity": s, "policy": p}) for s in range(2, E + 1) for p in ("lru", "layer")]
    runs += [("naive", {}), ("flash", {"predictor": "lookahead", "capacity": 4})]
    for mode, kw in runs:
        model = build_moe_model(pack, FlashConfig(mode=mode), **kw)
        for g, w in zip(_generate_logits(model), want):
            np.testing.assert_array_equal(g, w, err_msg=f"{arch} {mode} {kw}")
        assert model.moe_store.mixed and model.moe_store.cache.stats.misses > 0
    # the resident model holds expert e at its own width: the float model whose experts are
    # quantized-dequantized at those widths gives the same logits up to float summation order
    model, _ = load_model(src)
    for layer, widths in bits.items():
        switch = _switch_glu(model.layers[layer])
        if switch is None:
            continue
        for role in ("gate_proj", "up_proj", "down_proj"):
            lin = getattr(switch, role)
            rows = [mx.dequantize(*mx.quantize(lin.weight[e], group_size=32, bits=b),
                                  group_size=32, bits=b) for e, b in enumerate(widths)]
            lin.weight = mx.stack(rows)
    for g, w in zip(_generate_logits(model), want):
        np.testing.assert_allclose(g, w, rtol=0, atol=2e-5 * np.abs(w).max())


def _switch_glu(layer):
    from mlx_lm.models.switch_layers import SwitchGLU

    return next((m for _, m in layer.named_modules() if isinstance(m, SwitchGLU)), None)


@pytest.mark.parametrize("arch", ["mixtral", "olmoe"])
def test_top1_bit_identical_at_every_cache_size_from_one(tmp_path, arch):
    """One slot per layer holds a decode step's expert: sizes 1..E, uniform and mixed widths."""
    src = write_tiny_moe(tmp_path / "src", arch, quantize=(4, 32), experts=E, top_k=1)
    ref, _ = load_model(src)
    float_src = write_tiny_moe(tmp_path / "fsrc", arch, experts=E, top_k=1)
    cases = [(write_pack(src, tmp_path / "pack", progress=False), _generate_logits(ref))]
    mixed = write_pack(float_src, tmp_path / "mixed", progress=False, group_size=32,
                       expert_bits=_mixed_bits(3, seed=1))
    cases.append((mixed, _generate_logits(build_moe_model(mixed, FlashConfig(mode="dense")))))
    for pack, want in cases:
        for slots in range(1, E + 1):
            model = build_moe_model(pack, FlashConfig(mode="hybrid"), capacity=slots, policy="lru")
            for g, w in zip(_generate_logits(model), want):
                np.testing.assert_array_equal(g, w, err_msg=f"{arch} {pack.name} slots={slots}")
            assert model.moe_store.cache.capacity_of(0) >= 1


def test_kernel_path_matches_gather_qmm_and_is_the_same_in_every_mode(tmp_path):
    from mlx_flash.config import FlashConfig
    from mlx_flash.convert import main as convert_main
    from mlx_flash.cpu import ops
    from mlx_flash.models.moe import build_moe_model
    from mlx_lm.models.cache import make_prompt_cache

    if not ops.kernels_active():
        pytest.skip("CPU kernels not built")
    pack = tmp_path / "olmoe-tiny"
    assert convert_main(["--synthetic", "olmoe-tiny", "--out", str(pack)]) == 0
    tokens = [1, 2, 3, 400, 5000, 17]

    def decode(mode, **kw):
        model = build_moe_model(pack, FlashConfig(mode=mode), **kw)
        cache = make_prompt_cache(model)
        out = [np.array(model(mx.array([[t]]), cache=cache)[0, -1]) for t in tokens]
        return np.stack(out)

    ref = decode("dense")  # mlx-lm's SwitchGLU (gather_qmm)
    naive = decode("naive", kernels=True)
    assert np.linalg.norm(naive - ref) / np.linalg.norm(ref) < 1e-4  # summation order only
    assert not np.array_equal(naive, decode("naive"))  # the kernels did run
    for kw in ({"capacity": 2}, {"capacity": 8}):
        assert np.array_equal(decode("flash", kernels=True, **kw), naive)
