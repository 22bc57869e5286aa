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


@pytest.mark.parametrize("content, reason", [
    ('{"model_type": "llama",', "not JSON ("),
    ('["llama"]', "not a JSON object (an array)"),
    ('{"hidden_size": 64}', "no model_type"),
])
def test_folder_with_a_bad_config_names_it(tiny_llama, content, reason):
    path = tiny_llama()
    (path / "config.json").write_text(content)
    with pytest.raises(FlashError) as e:
        resolve_model(str(path))
    assert str(e.value).startswith(f"{path / 'config.json'}: {reason}") and "\n" not in str(e.value)


def test_folder_whose_config_is_a_fifo_is_refused_without_reading_it(tiny_llama):
    import os

    from conftest import flash_error_within

    path = tiny_llama()
    (path / "config.json").unlink()
    os.mkfifo(path / "config.json")
    assert flash_error_within(lambda: resolve_model(str(path))) == f"{path / 'config.json'}: not a regular file"


def test_cli_bad_config_is_one_line_exit_2(tiny_llama, tmp_path, capsys):
    from mlx_flash.convert import main

    path = tiny_llama()
    (path / "config.json").write_text("null")
    with pytest.raises(SystemExit) as e:
        main(["--model", str(path), "--out", str(tmp_path / "pack")])
    assert e.value.code == 2
    assert capsys.readouterr().err == f"error: {path / 'config.json'}: not a JSON object (null)\n"
    assert not (tmp_path / "pack").exists()
