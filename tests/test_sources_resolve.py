"""Where a --model value points (sources/resolve.py): the default converted once, every bad source named."""

import pytest

from mlx_flash.errors import FlashError
from mlx_flash.sources import resolve_model


def test_default_model_is_converted_once(flash_home, embedded_model_dir):
    assert embedded_model_dir.is_relative_to(flash_home)
    before = (embedded_model_dir / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(None) == embedded_model_dir
    assert (embedded_model_dir / "model.safetensors").stat().st_mtime_ns == before


def test_missing_path():
    with pytest.raises(FlashError, match=r"--model /no/such/dir: no such file or folder"):
        resolve_model("/no/such/dir")


def test_folder_without_config(tmp_path):
    with pytest.raises(FlashError, match=r": not a model folder \(no config.json\)"):
        resolve_model(str(tmp_path))


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
