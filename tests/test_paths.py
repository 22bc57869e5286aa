"""paths.py: the cache home and output folders that appear whole or not at all."""

import pytest

from mlx_flash.errors import FlashError
from mlx_flash.paths import atomic_output_dir, flash_home


def test_failed_conversion_leaves_nothing(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with atomic_output_dir(out) as tmp:
            (tmp / "model.safetensors").write_bytes(b"partial")
            raise RuntimeError("disk full")
    assert list(tmp_path.iterdir()) == []


def test_existing_output_is_refused(tmp_path):
    with pytest.raises(FlashError, match="--out .*: already exists"):
        with atomic_output_dir(tmp_path):
            pass


def test_flash_home_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_FLASH_HOME", str(tmp_path / "home"))
    assert flash_home() == tmp_path / "home"
    monkeypatch.delenv("MLX_FLASH_HOME")
    assert flash_home().parts[-2:] == (".cache", "mlx_flash")
