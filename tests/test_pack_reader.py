"""pack/reader.py: corrupt and truncated packs are refused with the file named."""

import os
from pathlib import Path

import pytest

from mlx_flash.errors import FlashError
from mlx_flash.pack import load_pack_weights, read_manifest, write_pack


def flip_byte(path: Path, offset: int):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_checksum_mismatch_names_file(tiny_llama, tmp_path):
    pack = write_pack(tiny_llama("src"), tmp_path / "pack", progress=False)
    entry = read_manifest(pack)["bundles"][1]
    flip_byte(pack / entry["file"], entry["stride"] * 5 + 3)
    with pytest.raises(FlashError, match=r"layer_001\.bin: checksum mismatch in bundle 5"):
        load_pack_weights(pack)
    pack2 = write_pack(tiny_llama("src2"), tmp_path / "pack2", progress=False)
    flip_byte(pack2 / "resident.safetensors", os.path.getsize(pack2 / "resident.safetensors") - 10)
    with pytest.raises(FlashError, match=r"resident\.safetensors: checksum mismatch"):
        load_pack_weights(pack2)


def test_truncated_bundle_file(tiny_llama, tmp_path):
    pack = write_pack(tiny_llama("src"), tmp_path / "pack", progress=False)
    entry = read_manifest(pack)["bundles"][0]
    os.truncate(pack / entry["file"], 5000)
    with pytest.raises(FlashError, match=r"layer_000\.bin: truncated"):
        load_pack_weights(pack)
