"""Whole-pack readers: resident tensors, and full FFN weights rebuilt from the bundles.

Checksums: the resident file has one crc32 over the file (checked when it is loaded, which reads it
all anyway); each bundle has its own crc32 in a table at the end of its layer file, so `mlx_flash.io`
can check exactly the bundles it reads (crc32 via zlib runs at several GB/s and releases the GIL).
"""

import json
import zlib
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..errors import FlashError
from ..paths import load_safetensors
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
    weights = load_safetensors(path)
    if verify:
        crc = loaded_crc32(path, weights, size)
        if crc != res.crc32:
            raise FlashError(f"{path}: checksum mismatch (crc32 {crc:08x}, manifest {res['crc32']:08x})")
    missing = set(res.tensors) - set(weights)
    if missing:
        raise FlashError(f"{path}: missing tensors {sorted(missing)[:3]}")
    for name, spec in res.endor.items():
        weights[name] = decode_resident(weights, name, spec, path)
    return dict(manifest.config), weights


def loaded_crc32(path: Path, weights: dict, size: int) -> int:
    """crc32 of the safetensors file `path` (`size` bytes) whose tensors mx.load gave as `weights`:
    its header read again (a few kB), then the tensors' bytes in file order, evaluated (the one
    read of the data); safetensors data is contiguous, so that is every byte of the file. A file
    whose tensors do not tile its data is read whole instead."""
    with open(path, "rb") as f:
        head = f.read(8)
        header = f.read(int.from_bytes(head, "little")) if len(head) == 8 else b""
    try:
        spans = sorted((v["data_offsets"][0], v["data_offsets"][1], k) for k, v in
                       json.loads(header).items() if k != "__metadata__")
    except (ValueError, TypeError, KeyError, AttributeError, IndexError):
        spans = None
    tiled = spans is not None and all(k in weights for _, _, k in spans) and \
        [b for b, _, _ in spans] == [0] + [e for _, e, _ in spans[:-1]] and \
        len(head) + len(header) + (spans[-1][1] if spans else 0) == size
    if not tiled:
        return file_crc32(path)
    mx.eval([weights[k] for _, _, k in spans])
    crc = zlib.crc32(header, zlib.crc32(head))
    for b, e, k in spans:
        view = memoryview(weights[k])
        if view.nbytes != e - b:
            return file_crc32(path)
        crc = zlib.crc32(view, crc)
    return crc


def file_crc32(path: Path) -> int:
    """crc32 of a whole file, read in 4 MiB chunks."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def decode_resident(weights: dict, name: str, spec: dict, path) -> mx.array:
    """The dense matrix of an ENDOR-encoded resident tensor (pops its encoded pieces from weights);
    FlashError naming the file when the bitmap's popcount disagrees with the stored non-zeros."""
    from .bitmap import dequantize_values, unpack_codes

    rows, cols = spec["shape"]
    bitmap = np.array(weights.pop(f"{name}.endor_bitmap"))
    mask = np.unpackbits(bitmap, axis=1, bitorder="little", count=cols).astype(bool)
    nnz = int(mask.sum())
    payload = spec["payload"]
    if payload.get("bits") is None:
        v = weights.pop(f"{name}.endor_values")
        values = np.array(v.view(mx.uint16) if v.dtype == mx.bfloat16 else v)
        ok = len(values) == nnz
    else:
        bits, g = payload["bits"], payload["group_size"]
        codes = np.array(weights.pop(f"{name}.endor_codes"))
        scales = np.array(weights.pop(f"{name}.endor_scales"))
        biases = np.array(weights.pop(f"{name}.endor_biases"))
        ok = len(codes) == (nnz * bits + 7) // 8 and len(scales) == len(biases) == -(-nnz // g)
        if ok:
            values = dequantize_values(unpack_codes(codes, nnz, bits), scales, biases, g)
    if not ok or nnz != spec["nnz"]:
        raise FlashError(f"{path}: {name}: its bitmap's popcount ({nnz}) disagrees with the stored "
                         f"non-zeros (manifest says {spec['nnz']})")
    out = np.zeros((rows, cols), values.dtype)
    out[mask] = values
    arr = mx.array(out)
    return arr.view(mx.bfloat16) if spec["dtype"] == "bfloat16" else arr


def bundle_pieces(entry):
    """[(offset, length)] of the components inside one bundle, in checksum order."""
    return [(c.offset, c.length) for c in entry.components]


def bundle_crc32(row, pieces, crc32=zlib.crc32) -> int:
    """crc32 of one bundle's component bytes (padding excluded); `row` is the bundle's bytes;
    crc32(data, start) is zlib's or a faster equal one (the loader passes the kernels')."""
    crc = 0
    for off, n in pieces:
        crc = crc32(row[off: off + n], crc)
    return crc


def _read_table(path: Path, t: dict, what: str, data=None, length=None) -> bytes:
    """The bytes of a table of a layer file (its manifest record `t`), checked against its crc32."""
    if data is None:
        with open(path, "rb") as f:
            f.seek(t["offset"])
            raw = f.read(t["length"])
    else:
        raw = bytes(data[t["offset"]: t["offset"] + t["length"]])
    if len(raw) != t["length"] or (length is not None and t["length"] != length):
        raise FlashError(f"{path}: truncated ({what} at offset {t['offset']} cut short)")
    if zlib.crc32(raw) != t["crc32"]:
        raise FlashError(f"{path}: {what} at offset {t['offset']} is corrupt")
    return raw


def read_checksum_table(path: Path, entry, data=None) -> np.ndarray:
    """The per-bundle crc32 table of a layer file, itself checked against the manifest."""
    return np.frombuffer(_read_table(path, entry.checksums, "checksum table", data), "<u4")


def read_bundle_index(path: Path, entry, data=None) -> np.ndarray:
    """int64 [count + 1] file offsets of an ENDOR layer's bundles, checked against the manifest."""
    raw = _read_table(path, entry.index, "bundle index", data, 8 * (entry.count + 1))
    index = np.frombuffer(raw, "<u8").astype(np.int64)
    if index[0] != entry.offset or np.any(np.diff(index) < 0) or index[-1] != entry.offset + entry.length:
        raise FlashError(f"{path}: bundle index disagrees with the manifest")
    return index


def endor_roles(entry, dest: dict) -> list:
    """[(uint8 [rows, row bytes] view of dest[component], n elements, payload or None)] in the
    bundle's component order, for mlx_flash.pack.bitmap.decode_into."""
    roles = []
    for c in entry.components:
        mat = dest[c.name]
        n = int(np.prod(c.shape)) if c.shape else 1
        roles.append((mat.reshape(mat.shape[0], -1), n, c.endor))
    return roles


def read_layer_components(pack_dir, entry, *, verify=True):
    """{component name: mx.array [count, *shape]} of one whole bundle file."""
    path = Path(pack_dir) / entry.file
    try:
        data = np.fromfile(path, np.uint8)
    except OSError as e:
        raise FlashError(f"{path}: cannot read bundle file ({e.strerror})") from None
    if data.size < entry.file_length:
        raise FlashError(f"{path}: truncated ({data.size} bytes, manifest says {entry['file_length']})")
    if entry.encoding == "endor":
        return _read_endor_components(path, entry, data, verify)
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


def _read_endor_components(path, entry, data, verify):
    from .bitmap import decode_into

    count = entry.count
    index = read_bundle_index(path, entry, data)
    starts, lengths = index[:-1], np.diff(index)
    table = read_checksum_table(path, entry, data) if verify else None
    dest = {c.name: np.zeros((count, c.length), np.uint8) for c in entry.components}
    decode_into(data, starts, lengths, np.arange(count), endor_roles(entry, dest), str(path), crcs=table)
    return {c.name: mx.array(dest[c.name]).view(mx_dtype(c.dtype)).reshape(count, *c.shape)
            for c in entry.components}


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
        if entry.groups:
            raise FlashError(f"{pack}: layer {entry.layer} holds experts of mixed bit widths, which "
                             f"no single mlx-lm tensor holds (load it with mlx_flash.models.load)")
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
