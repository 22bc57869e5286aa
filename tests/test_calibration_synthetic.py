"""Synthetic packs: real architecture shapes, chosen FFN sparsity, exact low-rank predictor, labels."""

import json

import mlx.core as mx
import numpy as np
import pytest

from mlx_flash.convert import main as convert_main
from mlx_flash.pack import load_pack_weights, read_manifest
from mlx_flash.calibration.synthetic import ARCHS, analytic_capacity, inverse_normal_cdf, is_synthetic


def _normalised(n, hidden, seed=0):
    x = np.random.default_rng(seed).standard_normal((n, hidden)).astype(np.float32)
    x -= x.mean(-1, keepdims=True)
    return mx.array(x / np.sqrt((x ** 2).mean(-1, keepdims=True)))


def test_inverse_normal_cdf():
    assert inverse_normal_cdf(0.5) == pytest.approx(0.0, abs=1e-9)
    assert inverse_normal_cdf(0.95) == pytest.approx(1.644853627, abs=1e-6)


def test_capacity_grows_with_window_and_is_bounded():
    caps = analytic_capacity(1000, 0.05, 8)
    assert caps == sorted(caps) and 50 < caps[0] < 100 and caps[-1] <= 1000


@pytest.mark.parametrize("arch,sparse,quantize", [("opt-tiny", "fc1", None),
                                                  ("llama-tiny", "gate_proj", 8)])
def test_synthetic_pack_sparsity_predictor_and_labels(tmp_path, arch, sparse, quantize):
    out = tmp_path / "pack"
    argv = ["--synthetic", arch, "--out", str(out), "--sparsity", "0.9", "--dtype", "float32"]
    if quantize:
        argv += ["--quantize", str(quantize), "--group-size", "32"]
    assert convert_main(argv) == 0
    manifest = read_manifest(out)
    label = manifest["synthetic"]
    assert label["arch"] == arch and label["sparsity"] == 0.9 and "speed" in label["note"]
    assert is_synthetic(out)["arch"] == arch
    assert json.loads((out / "config.json").read_text())["synthetic"]["arch"] == arch
    assert manifest["quantization"] == ({"group_size": 32, "bits": 8} if quantize else None)
    assert not list(tmp_path.glob(".*"))  # no temporary folders left
    config, weights = load_pack_weights(out)
    assert config["hidden_size"] == ARCHS[arch]["hidden_size"]

    from mlx_flash.sparse.predictor import load_predictors

    predictors = load_predictors(out)
    assert sorted(predictors) == list(range(config["num_hidden_layers"]))
    x = _normalised(2000, config["hidden_size"])
    for i, pred in predictors.items():
        assert pred.kind == "low-rank"
        prefix = f"model.decoder.layers.{i}." if arch.startswith("opt") else f"model.layers.{i}.mlp."
        w = weights[f"{prefix}{sparse}.weight"]
        if quantize:
            w = mx.dequantize(w, weights[f"{prefix}{sparse}.scales"],
                              weights[f"{prefix}{sparse}.biases"], group_size=32, bits=8)
        pre = x @ w.T + weights[f"{prefix}{sparse}.bias"]
        active = np.array(pre > 0)
        assert abs(active.mean() - 0.1) < 0.02  # the designed 90% sparsity
        agree = (np.array(pred(x)) == active).mean()
        assert agree > (0.99 if quantize else 0.999)  # exact up to rounding


def test_synthetic_model_generates(tmp_path):
    from mlx_flash.calibration.dense_pass import load_dense_model

    out = tmp_path / "pack"
    assert convert_main(["--synthetic", "opt-tiny", "--out", str(out)]) == 0
    model = load_dense_model(out)
    model = model[0] if isinstance(model, tuple) else model
    logits = model(mx.array([[1, 2, 3, 4]]))
    assert logits.shape == (1, 4, ARCHS["opt-tiny"]["vocab_size"])
    assert bool(mx.all(mx.isfinite(logits)))
    from mlx_flash.api import encode_prompt
    from mlx_flash.models import load_tokenizer

    # the embedded model's tokenizer and chat template
    chat = encode_prompt(load_tokenizer(out), "hi")
    assert chat[:1] == load_tokenizer(out).encode("<|im_start|>") and len(chat) > 5



@pytest.mark.parametrize("arch", ["llama-tiny", "olmoe-tiny"])
def test_source_folders_load_through_mlx_lm(tmp_path, arch):
    """write_source_folder / write_moe_source_folder: shards and config.json through model_folder."""
    from mlx_flash.calibration.synthetic import MOE_ARCHS, write_moe_source_folder, write_source_folder
    from mlx_flash.models import load_model

    out = tmp_path / "src"
    write = write_moe_source_folder if arch in MOE_ARCHS else write_source_folder
    made = write(arch, out, progress=False)
    assert json.loads((out / "config.json").read_text()) == made["config"]
    assert sorted(p.name for p in out.glob("model*.safetensors")) == [
        "model-layer000.safetensors", "model-layer001.safetensors", "model-top.safetensors"]
    model, _ = load_model(out)
    assert bool(mx.all(mx.isfinite(model(mx.array([[1, 2, 3]])))))

def test_bad_arguments(tmp_path, capsys):
    def error(argv):
        with pytest.raises(SystemExit) as e:
            convert_main(argv)
        assert e.value.code == 2
        return capsys.readouterr().err.strip().splitlines()[-1]

    assert "--synthetic gpt-9: unknown architecture" in error(
        ["--synthetic", "gpt-9", "--out", str(tmp_path / "a")])
    assert "--sparsity 1.5" in error(
        ["--synthetic", "opt-tiny", "--sparsity", "1.5", "--out", str(tmp_path / "b")])
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert not list(tmp_path.glob(".*"))  # no temporary folders left behind
    with pytest.raises(SystemExit):  # --model and --synthetic are exclusive
        convert_main(["--synthetic", "opt-tiny", "--model", "x", "--out", str(tmp_path / "c")])


@pytest.mark.parametrize("arch,total", [("olmoe-1b-7b", 6.92e9), ("qwen3-30b-a3b", 30.5e9)])
def test_moe_shapes_give_the_published_parameter_counts(arch, total):
    from mlx_flash.calibration.synthetic import MOE_ARCHS, moe_tensor_shapes

    # the model cards' total parameter counts (OLMoE-1B-7B: 6.92B, Qwen3-30B-A3B: 30.5B)
    n = sum(int(np.prod(shape)) for shape, _ in moe_tensor_shapes(MOE_ARCHS[arch]).values())
    assert abs(n / total - 1) < 0.01


@pytest.mark.parametrize("arch", ["olmoe-tiny", "qwen3-moe-tiny"])
def test_synthetic_moe_pack_is_quantized_labelled_and_runs(tmp_path, arch):
    from mlx_flash.calibration.synthetic import MOE_ARCHS
    from mlx_flash.config import FlashConfig
    from mlx_flash.models.moe import build_moe_model

    out = tmp_path / "pack"
    assert convert_main(["--synthetic", arch, "--out", str(out)]) == 0
    manifest = read_manifest(out)
    shape = MOE_ARCHS[arch]
    assert manifest["synthetic"]["arch"] == arch and "speed" in manifest["synthetic"]["note"]
    assert json.loads((out / "config.json").read_text())["synthetic"]["arch"] == arch
    assert manifest["quantization"] == {"group_size": 32, "bits": 4}
    experts = [b for b in manifest["bundles"] if b["kind"] == "experts"]
    assert len(experts) == shape["num_hidden_layers"]
    assert all(b["count"] == shape["num_experts"] and b["stride"] % 4096 == 0 for b in experts)
    assert not list(tmp_path.glob(".*")) and not (out / "source").exists()
    config, weights = load_pack_weights(out)
    hidden = shape["hidden_size"]
    p = "model.layers.1.mlp.switch_mlp.down_proj"
    inter = shape.get("moe_intermediate_size") or shape["intermediate_size"]
    w = mx.dequantize(weights[f"{p}.weight"], weights[f"{p}.scales"], weights[f"{p}.biases"],
                      group_size=32, bits=4).astype(mx.float32)
    assert w.shape == (shape["num_experts"], hidden, inter)
    # dequantized weights centred with std ~ 1/sqrt(fan in) (scales drawn x0.5..1.5 around it)
    assert abs(w.mean().item()) < 0.1 / np.sqrt(inter)
    assert 0.85 < w.std().item() * np.sqrt(inter) < 1.2
    tokens = mx.array([[1, 2, 3, 400, 5000]])
    dense = build_moe_model(out, FlashConfig(mode="dense"))(tokens)
    assert bool(mx.all(mx.isfinite(dense)))
    naive = build_moe_model(out, FlashConfig(mode="naive"))(tokens)
    assert np.array_equal(np.array(dense), np.array(naive))


# sha256 of the generated files of `convert --synthetic opt-tiny --dtype float16 --weight-sparsity
# 0.5 [--encoding endor]` (seed 0, mlx 0.32.4), as the writer wrote them when it still went through
# safetensors shards on disk. The in-memory path must give the same bytes. If the pack format
# changes on purpose, regenerate them.
OPT_TINY_PACK_SHA256 = {
    "dense": {
        "bundles/layer_000.bin": "6ed9439de4d58d9e00e31fa8fc8200ec6645227d49bb832f5835b7b16bc684b3",
        "bundles/layer_001.bin": "b06ff2b13b4ed5e1e72ec8ebdf721fe0548bf4816ffc75a1bd376bae629b3549",
        "predictors.safetensors": "bce2943e5bc40029b42c6f5a8bef1c72ff9507941129b2a2bb3029801e4ef307",
        "resident.safetensors": "987c8bada3071ecc764e1633b8f09b295dbb803be6847a918185e69c7a9d6083",
    },
    "endor": {
        "bundles/layer_000.bin": "2a3158b0d02b69586d98402ab5153ddc442a598439623ad660c52a796daa4953",
        "bundles/layer_001.bin": "c7d4296fe706a11fc95ee7e5982788d86c35c81ed96bf618f1748b276422a7da",
        "predictors.safetensors": "bce2943e5bc40029b42c6f5a8bef1c72ff9507941129b2a2bb3029801e4ef307",
        "resident.safetensors": "acb2861c3558fe8abb783eeeabf1727a15c0b00b04c51150be77342d530fded9",
    },
}


@pytest.mark.parametrize("encoding", ["dense", "endor"])
def test_same_seed_same_pack_bytes_as_the_shard_writer(tmp_path, encoding):
    import hashlib

    out = tmp_path / "pack"
    assert convert_main(["--synthetic", "opt-tiny", "--dtype", "float16", "--weight-sparsity", "0.5",
                         "--encoding", encoding, "--out", str(out)]) == 0
    expected = OPT_TINY_PACK_SHA256[encoding]
    assert {name: hashlib.sha256((out / name).read_bytes()).hexdigest() for name in expected} == expected
    assert sorted(p.name for p in (out / "bundles").iterdir()) == ["layer_000.bin", "layer_001.bin"]
    assert not (out / "source").exists()
