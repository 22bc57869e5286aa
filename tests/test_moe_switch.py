"""StreamedSwitchGLU on both compute paths, at every cache size, policy and predictor:
MLX's ops (kernels off): logits bit-identical to mlx-lm's fully loaded MoE model;
CPU kernels (the Linux default): bit-identical to the same pack fully resident on the kernels
(dense mode), and within summation-order tolerance of mlx-lm."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import MOE_ARCHS, write_tiny_moe

from mlx_flash.config import FlashConfig
from mlx_flash.cpu import ops
from mlx_flash.models import load_model
from mlx_flash.models.moe import build_moe_model
from mlx_flash.moe.cache import POLICIES
from mlx_flash.pack import write_pack

PATHS = ["mlx", "kernels"]
KERNEL_RTOL = 1e-4  # kernel path vs mlx-lm: relative L2 error of the logits (summation order only)


def use_path(path):
    """Turn the CPU kernels on ("kernels") or off ("mlx") for what follows; skip when unbuilt."""
    if path == "kernels" and not ops.EXTENSION_AVAILABLE:
        pytest.skip("CPU kernels not built")
    ops.set_kernels_enabled(path == "kernels")


@pytest.fixture(autouse=True)
def _kernels_back_on():
    mx.set_default_device(mx.cpu)
    yield
    ops.set_kernels_enabled(True)


def _mlx_lm_logits(src):
    """mlx-lm's own model of folder `src` on MLX's ops (kernels off), then the state restored."""
    was = ops.kernels_active()
    ops.set_kernels_enabled(False)
    try:
        return _generate_logits(load_model(src)[0])
    finally:
        ops.set_kernels_enabled(was)


def _reference(path, pack, mlx_lm):
    """What every streamed run must equal bit for bit: mlx-lm's logits on the MLX path, the
    pack's dense (resident bank) model on the kernel path, checked once against mlx-lm."""
    if path == "mlx":
        return mlx_lm
    want = _generate_logits(build_moe_model(pack, FlashConfig(mode="dense")))
    assert_close_to_mlx_lm(want, mlx_lm)
    return want


def assert_close_to_mlx_lm(got, mlx_lm):
    for g, w in zip(got, mlx_lm):
        assert np.linalg.norm(g - w) <= KERNEL_RTOL * np.linalg.norm(w)

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
            made[key] = (root / "pack", _mlx_lm_logits(src))
        return made[key]
    return get


# float experts never reach the kernels (gather_mm on both paths): their kernel case is the MLX one
@pytest.mark.parametrize("path,quantize", [("mlx", None), ("mlx", (4, 32)), ("kernels", (4, 32))],
                         ids=["mlx-float", "mlx-q4", "kernels-q4"])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_streamed_experts_bit_identical_every_cache_size(packs, arch, quantize, path):
    pack, mlx_lm = packs(arch, quantize)
    use_path(path)
    want = _reference(path, pack, mlx_lm)
    for slots in range(2, E + 1):  # top-2: fewer than 2 slots cannot hold one token's experts
        for policy in ("lru", "layer"):
            model = build_moe_model(pack, FlashConfig(mode="hybrid"), capacity=slots, policy=policy)
            got = _generate_logits(model)
            for g, w in zip(got, want):
                np.testing.assert_array_equal(g, w, err_msg=f"{arch} slots={slots} {policy}")
            assert model.moe_store.cache.stats.misses > 0


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2"])
def test_modes_and_predictors_bit_identical(packs, arch, path):
    pack, mlx_lm = packs(arch, (4, 32))
    use_path(path)
    want = _reference(path, pack, mlx_lm)
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


@pytest.mark.parametrize("arch,path", [("mixtral", "mlx"), ("deepseek_v2", "mlx"),
                                       ("mixtral", "kernels")])
def test_mixed_widths_bit_identical_to_resident_model_every_cache_size(mixed_packs, arch, path):
    src, pack, bits = mixed_packs(arch)
    use_path("mlx")
    mlx_ref = _generate_logits(build_moe_model(pack, FlashConfig(mode="dense")))
    use_path(path)
    want = _reference(path, pack, mlx_ref)
    runs = [("hybrid", {"capacity": s, "policy": p}) for s in range(2, E + 1) for p in ("lru", "layer")]
    runs += [("naive", {}), ("flash", {"predictor": "lookahead", "capacity": 4})]
    for mode, kw in runs:
        model = build_moe_model(pack, FlashConfig(mode=mode), **kw)
        for g, w in zip(_generate_logits(model), want):
            np.testing.assert_array_equal(g, w, err_msg=f"{arch} {mode} {kw}")
        assert model.moe_store.mixed and model.moe_store.cache.stats.misses > 0
    if path == "kernels":
        return
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


@pytest.mark.parametrize("arch,path", [("mixtral", "mlx"), ("olmoe", "mlx"), ("olmoe", "kernels")])
def test_top1_bit_identical_at_every_cache_size_from_one(tmp_path, arch, path):
    """One slot per layer holds a decode step's expert: sizes 1..E, uniform and mixed widths."""
    src = write_tiny_moe(tmp_path / "src", arch, quantize=(4, 32), experts=E, top_k=1)
    float_src = write_tiny_moe(tmp_path / "fsrc", arch, experts=E, top_k=1)
    pack = write_pack(src, tmp_path / "pack", progress=False)
    mlx_lm = _mlx_lm_logits(src)
    use_path(path)
    cases = [(pack, _reference(path, pack, mlx_lm))]
    mixed = write_pack(float_src, tmp_path / "mixed", progress=False, group_size=32,
                       expert_bits=_mixed_bits(3, seed=1))
    cases.append((mixed, _generate_logits(build_moe_model(mixed, FlashConfig(mode="dense")))))
    for pack, want in cases:
        for slots in range(1, E + 1):
            model = build_moe_model(pack, FlashConfig(mode="hybrid"), capacity=slots, policy="lru")
            for g, w in zip(_generate_logits(model), want):
                np.testing.assert_array_equal(g, w, err_msg=f"{arch} {pack.name} slots={slots}")
            assert model.moe_store.cache.capacity_of(0) >= 1


def test_kernels_are_the_default_on_cpu_and_mlx_ops_the_switch_off(tmp_path):
    """Built kernels + CPU: the experts (decode and prompt) run on them, within KERNEL_RTOL of
    mlx-lm; the kernels' own switch turned off gives mlx-lm's logits bit for bit."""
    from mlx_flash.convert import main as convert_main
    from mlx_lm.models.cache import make_prompt_cache

    use_path("kernels")
    pack = tmp_path / "olmoe-tiny"
    assert convert_main(["--synthetic", "olmoe-tiny", "--out", str(pack)]) == 0
    prompt, tokens = [1, 2, 3, 400, 5000, 17, 9, 250], [31, 7000, 12]

    def run(mode, **kw):
        model = build_moe_model(pack, FlashConfig(mode=mode), **kw)
        cache = make_prompt_cache(model)
        out = [model(mx.array([prompt]), cache=cache)[0, -1]]
        out += [model(mx.array([[t]]), cache=cache)[0, -1] for t in tokens]
        mx.eval(out)
        return [np.array(o) for o in out]

    ops.set_kernels_enabled(False)
    mlx_lm = run("dense")  # mlx-lm's own model of the pack's weights
    assert build_moe_model(pack, FlashConfig(mode="dense")).moe_store is None
    for mode, kw in (("naive", {}), ("flash", {"capacity": 2})):
        for g, w in zip(run(mode, **kw), mlx_lm):
            np.testing.assert_array_equal(g, w)
    ops.set_kernels_enabled(True)
    dense = run("dense")  # every expert in a slot bank, on the kernels
    assert_close_to_mlx_lm(dense, mlx_lm)
    assert not any(np.array_equal(g, w) for g, w in zip(dense, mlx_lm))  # the kernels did run
    for mode, kw in (("naive", {}), ("flash", {"capacity": 2}), ("hybrid", {"capacity": 8})):
        for g, w in zip(run(mode, **kw), dense):
            np.testing.assert_array_equal(g, w, err_msg=f"{mode} {kw}")


def test_switch_glus_finds_each_moe_layers_one_switch_glu(tmp_path):
    from mlx_flash.errors import FlashError
    from mlx_flash.moe.switch import switch_glus

    model, _ = load_model(write_tiny_moe(tmp_path / "src", "deepseek_v2"))  # layer 0 stays dense
    found = switch_glus(model)
    assert sorted(found) == [1, 2]
    for i, (parent, name, switch) in found.items():
        assert parent is model.layers[i].mlp and name == "switch_mlp" and switch is parent.switch_mlp
    assert switch_glus(model, [2]) == {2: found[2]}
    with pytest.raises(FlashError, match="layer 0: expected one SwitchGLU, found 0"):
        switch_glus(model, [1, 0])
    model.layers[2].mlp.second = found[2][2]  # two under one layer: which one streams is unclear
    with pytest.raises(FlashError, match="layer 2: expected one SwitchGLU, found 2"):
        switch_glus(model)
