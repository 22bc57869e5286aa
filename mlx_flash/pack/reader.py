"""Whole-pack readers: resident tensors, and full FFN weights rebuilt from the bundles.

Checksums: the resident file has one crc32 over the file (checked when it is loaded, which reads it
all anyway); each bundle has its own crc32 in a table at the end of its layer file, so `mlx_flash.io`
can check exactly the bundles it reads (crc32 via zlib runs at several GB/s and releases the GIL).
"""

import zlib
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..errors import FlashError
from .layout import mx_dtype, read_manifest


def load_resident(pack_dir, *, manifest=None, verify=True):
    """(config, {name: mx.array}) of the resident tensors (everything but bundled FFN weights)."""
    pack = Path(pack_dir)
    manifest = manifest or read_manifest(pack)
    res = manifest.resident
    if res is None or manifest.config is None:
        raise FlashError(f"{pack / 'manifest.json'}: not a model pack (no resident tensors or config)")
    path = pack / res.file
    try:
        size = path.stat().st_size
    except OSError as e:
        raise FlashError(f"{path}: cannot read resident tensors ({e.strerror})") from None
    if size != res.length:
        raise FlashError(f"{path}: {size} bytes, manifest says {res['length']} (truncated or replaced)")
    if verify:
        crc = 0
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                crc = zlib.crc32(chunk, crc)
        if crc != res.crc32:
            raise FlashError(f"{path}: checksum mismatch (crc32 {crc:08x}, manifest {res['crc32']:08x})")
    try:
        weights = mx.load(str(path))
    except Exception as e:
        raise FlashError(f"{path}: unreadable safetensors ({e})") from None
    missing = set(res.tensors) - set(weights)
    if missing:
        raise FlashError(f"{path}: missing tensors {sorted(missing)[:3]}")
    return dict(manifest.config), weights


def bundle_pieces(entry):
    """[(offset, length)] of the components inside one bundle, in checksum order."""
    return [(c.offset, c.length) for c in entry.components]


def bundle_crc32(row, pieces) -> int:
    """crc32 of one bundle's component bytes (padding excluded); `row` is the bundle's bytes."""
    crc = 0
    for off, n in pieces:
        crc = zlib.crc32(row[off: off + n], crc)
    return crc


def read_checksum_table(path: Path, entry, data=None) -> np.ndarray:
    """The per-bundle crc32 table of a layer file, itself checked against the manifest."""
    t = entry.checksums
    if data is None:
        with open(path, "rb") as f:
            f.seek(t["offset"])
            raw = f.read(t["length"])
    else:
        raw = bytes(data[t["offset"]: t["offset"] + t["length"]])
    if len(raw) != t["length"]:
        raise FlashError(f"{path}: truncated (checksum table at offset {t['offset']} cut short)")
    if zlib.crc32(raw) != t["crc32"]:
        raise FlashError(f"{path}: checksum table at offset {t['offset']} is corrupt")
    return np.frombuffer(raw, "<u4")


def read_layer_components(pack_dir, entry, *, verify=True):
    """{component name: mx.array [count, *shape]} of one whole bundle file."""
    path = Path(pack_dir) / entry.file
    try:
        data = np.fromfile(path, np.uint8)
    except OSError as e:
        raise FlashError(f"{path}: cannot read bundle file ({e.strerror})") from None
    if data.size < entry.file_length:
        raise FlashError(f"{path}: truncated ({data.size} bytes, manifest says {entry['file_length']})")
    count, stride, off = entry.count, entry.stride, entry.offset
    rows = data[off: off + count * stride].reshape(count, stride)
    if verify:
        table = read_checksum_table(path, entry, data)
        pieces = bundle_pieces(entry)
        for i in range(count):
            if bundle_crc32(rows[i], pieces) != table[i]:
                raise FlashError(f"{path}: checksum mismatch in bundle {i} "
                                 f"(offset {off + i * stride})")
    out = {}
    for c in entry.components:
        raw = np.ascontiguousarray(rows[:, c.offset: c.offset + c.length])
        out[c.name] = mx.array(raw).view(mx_dtype(c.dtype)).reshape(count, *c.shape)
    return out


def load_pack_weights(pack_dir, *, verify=True):
    """(config, {mlx-lm weight name: mx.array}) of the whole model, FFN rebuilt from bundles.

    Gate/up (and expert) tensors come back exactly as in the source. The neuron down matrix comes
    back as `down = downT.T`: exact for float packs; for quantized packs (downT quantized along
    hidden) it is the float matrix dequantize(downT).T in the scales' dtype with no `.scales`, so
    mlx-lm builds a plain Linear there and the dense forward computes h @ dequantize(downT), the
    same product the sparse path takes with quantized_matmul(h, downT, transpose=False) (equal up
    to float summation order in float16/bfloat16; bit-identical in float32).
    """
    pack = Path(pack_dir)
    manifest = read_manifest(pack)
    config, weights = load_resident(pack, manifest=manifest, verify=verify)
    for entry in manifest.bundles:
        comps = read_layer_components(pack, entry, verify=verify)
        by_name = {c.name: c for c in entry.components}
        for name, arr in comps.items():
            c = by_name[name]
            if not name.startswith("down_t."):
                weights[c.source] = arr
            elif name == "down_t.weight":
                q = c.quantization
                if q:
                    arr = mx.dequantize(arr, comps["down_t.scales"], comps["down_t.biases"],
                                        group_size=q["group_size"], bits=q["bits"])
                weights[c.source] = mx.contiguous(arr.T)
    return config, weights
