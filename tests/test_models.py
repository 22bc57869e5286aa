"""Loading through the seam: same weights and logits as mlx-lm; every bad source named."""

import json

import mlx.core as mx
import numpy as np
import pytest

from mlx_flash.errors import FlashError
from mlx_flash.models import get_model_classes, load_model
from mlx_flash.models.source import resolve_model


def test_logits_bit_identical_to_mlx_lm_load(embedded_model_dir):
    from mlx_lm import load as mlx_lm_load

    import mlx_flash
    from mlx_flash import ops
    from mlx_flash.models.kernel_layers import FusedBlock, KernelQuantizedLinear, patch_layers

    ours, our_tok = mlx_flash.load(str(embedded_model_dir))
    ref, ref_tok = mlx_lm_load(str(embedded_model_dir))
    patch_layers(ref)  # the same seam: mlx-lm's model with its linear layers on our kernels
    ids = ref_tok.encode("Bit-identical logits are the contract of the dense path.")
    assert our_tok.encode("Bit-identical logits are the contract of the dense path.") == ids
    if ops.kernels_active():  # the dense path runs on our kernels (fused blocks) with no flag (issue 6)
        assert any(isinstance(m, KernelQuantizedLinear) for _, m in ours.named_modules())
        assert all(isinstance(layer, FusedBlock) for layer in ours.model.layers)
    a, b = ours(mx.array([ids])), ref(mx.array([ids]))
    assert a.dtype == b.dtype
    assert np.array_equal(np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32)))


def test_default_model_is_converted_once(flash_home, embedded_model_dir):
    assert embedded_model_dir.is_relative_to(flash_home)
    before = (embedded_model_dir / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(None) == embedded_model_dir
    assert (embedded_model_dir / "model.safetensors").stat().st_mtime_ns == before


def test_tiny_folder_loads(tiny_llama):
    path = tiny_llama("q", quantize=(4, 32))
    model, config = load_model(path)
    assert config["model_type"] == "llama"
    assert model(mx.array([[1, 2, 3]])).shape == (1, 3, 128)


def test_missing_path():
    with pytest.raises(FlashError, match=r"--model /no/such/dir: no such file or folder"):
        resolve_model("/no/such/dir")


def test_folder_without_config(tmp_path):
    with pytest.raises(FlashError, match=r": not a model folder \(no config.json\)"):
        resolve_model(str(tmp_path))


def test_unknown_model_type(tiny_llama):
    path = tiny_llama()
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "no_such_arch"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(FlashError, match=r"model_type 'no_such_arch' is not supported"):
        load_model(resolve_model(str(path)))
    with pytest.raises(FlashError):
        get_model_classes({"model_type": "no_such_arch"})


def test_truncated_safetensors(tiny_llama):
    path = tiny_llama()
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(FlashError, match=r"model.safetensors: file is truncated: tensor"):
        resolve_model(str(path))


def test_corrupt_safetensors_header(tiny_llama):
    path = tiny_llama()
    weights = path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:16] = b"not json"
    weights.write_bytes(bytes(data))
    with pytest.raises(FlashError, match=r"model.safetensors: corrupt safetensors header"):
        resolve_model(str(path))


def test_non_gguf_file(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 100)
    with pytest.raises(FlashError, match=r"weights.bin: a file that is not GGUF"):
        resolve_model(str(f))


def test_hub_repo_offline_fails_clearly(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FlashError, match=r"--model someone/some-model: not a local path.*hub failed"):
        resolve_model("someone/some-model")
