"""pack/reader.py: corrupt and truncated packs are refused with the file named."""

import json
import os
import zlib
from pathlib import Path

import numpy as np
import pytest

from mlx_flash.errors import FlashError
from mlx_flash.pack import load_pack_weights, read_manifest, write_manifest, write_pack


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


def test_resident_file_of_the_right_size_but_not_safetensors_is_named(tiny_llama, tmp_path):
    pack = write_pack(tiny_llama("src"), tmp_path / "pack", progress=False)
    path = pack / "resident.safetensors"
    path.write_bytes(b"\xff" * path.stat().st_size)
    with pytest.raises(FlashError, match=r"resident\.safetensors: unreadable safetensors"):
        load_pack_weights(pack, verify=False)


def test_truncated_bundle_file(tiny_llama, tmp_path):
    pack = write_pack(tiny_llama("src"), tmp_path / "pack", progress=False)
    entry = read_manifest(pack)["bundles"][0]
    os.truncate(pack / entry["file"], 5000)
    with pytest.raises(FlashError, match=r"layer_000\.bin: truncated"):
        load_pack_weights(pack)


# ---- ENDOR layer files (bitmap + non-zeros) ----------------------------------------------------

def endor_pack(tiny_llama, tmp_path):
    from test_calibration_prune import pruned_model

    src, _ = pruned_model(tiny_llama, tmp_path, intermediate=96)
    return write_pack(src, tmp_path / "endor", progress=False, encoding="endor")


def _rewrite_bundle(pack, layer, bundle, change):
    """Apply change(bytes of bundle) in place and fix that bundle's crc32 (so only the ENDOR
    consistency checks can notice)."""
    entry = read_manifest(pack)["bundles"][layer]
    path = pack / entry["file"]
    data = bytearray(path.read_bytes())
    index = np.frombuffer(bytes(data[entry["index"]["offset"]: entry["index"]["offset"] + entry["index"]["length"]]), "<u8")
    s, e = int(index[bundle]), int(index[bundle + 1])
    data[s:e] = change(bytes(data[s:e]))
    t = entry["checksums"]["offset"] + 4 * bundle
    data[t: t + 4] = np.array([zlib.crc32(bytes(data[s:e]))], "<u4").tobytes()
    table = bytes(data[entry["checksums"]["offset"]: entry["checksums"]["offset"] + entry["checksums"]["length"]])
    m = json.loads((pack / "manifest.json").read_text())
    m["bundles"][layer]["checksums"]["crc32"] = zlib.crc32(table)
    write_manifest(pack, m)
    path.write_bytes(bytes(data))


def _two_more_bits(block: bytes) -> bytes:
    b = bytearray(block)
    bits = np.unpackbits(np.frombuffer(bytes(b[:8]), np.uint8), bitorder="little")
    bits[np.flatnonzero(bits == 0)[:2]] = 1
    b[:8] = np.packbits(bits, bitorder="little").tobytes()
    return bytes(b)


@pytest.mark.parametrize("use_kernel", [True, False])
def test_endor_popcount_disagreement_names_the_file(tiny_llama, tmp_path, monkeypatch, use_kernel):
    from mlx_flash.pack import bitmap

    if not use_kernel:
        monkeypatch.setattr(bitmap, "_extension", lambda: None)
    pack = endor_pack(tiny_llama, tmp_path)
    _rewrite_bundle(pack, 1, 7, _two_more_bits)
    with pytest.raises(FlashError, match=r"layer_001\.bin: bundle 7\b.*popcount"):
        load_pack_weights(pack)


def test_endor_truncated_and_corrupt_index_name_the_file(tiny_llama, tmp_path):
    pack = endor_pack(tiny_llama, tmp_path)
    entry = read_manifest(pack)["bundles"][0]
    flip_byte(pack / entry["file"], entry["index"]["offset"] + 9)
    with pytest.raises(FlashError, match=r"layer_000\.bin: bundle index .* is corrupt"):
        load_pack_weights(pack)
    os.truncate(pack / entry["file"], 2000)
    with pytest.raises(FlashError, match=r"layer_000\.bin: truncated"):
        load_pack_weights(pack)


def test_endor_resident_popcount_disagreement_names_the_file(tiny_llama, tmp_path):
    pack = endor_pack(tiny_llama, tmp_path)
    m = json.loads((pack / "manifest.json").read_text())
    name = "model.layers.0.self_attn.k_proj.weight"
    m["resident"]["endor"][name]["nnz"] += 1
    write_manifest(pack, m)
    with pytest.raises(FlashError, match=r"resident\.safetensors: .*k_proj.weight: its bitmap's popcount"):
        load_pack_weights(pack)
