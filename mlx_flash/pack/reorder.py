"""Permute the neurons of a pack's layers on disk (neuron bundles only), keeping the pack valid.

Bundle i of a layer holds everything neuron i needs, so a new neuron order is a permutation of the
bundle rows of that layer's file and of its crc32 table; nothing else in the pack is per neuron
(the down bias is per output and stays resident). The manifest entry records the order:
`neuron_order[p]` = the neuron of the original model at position p (composed over reorders), so
statistics in original ids can be mapped. The FFN output is a sum over neurons, so the model
computes the same function (up to float summation order).

A layer whose gate is resident (layout.py "resident_gate") has its gate rows permuted in the
resident file too (rewritten whole; its length and crc32 in the manifest).

Writes: each new bundle file to a temporary name (fsynced) and renamed, then the manifest
(temporary name, fsync, rename); a crash between them leaves crc tables whose checksum the old
manifest refuses, naming the file.
"""

import os
import zlib
from pathlib import Path

import numpy as np

from ..errors import FlashError
from .layout import MANIFEST, read_manifest


def check_order(order, count: int, where: str) -> np.ndarray:
    order = np.asarray(order, np.int64)
    if order.shape != (count,) or not np.array_equal(np.sort(order), np.arange(count)):
        raise FlashError(f"{where}: neuron order is not a permutation of its {count} neurons")
    return order


def reorder_pack(pack_dir, orders: dict) -> dict:
    """Permute layer bundles: orders {layer: int [count]} with order[new position] = current
    position. Returns the new manifest."""
    from .writer import _write_bytes, write_manifest

    pack = Path(pack_dir)
    manifest = read_manifest(pack).fields  # the JSON document: entries are edited in place below
    entries = {b["layer"]: b for b in manifest["bundles"]}
    by_file = {}
    for layer in sorted(orders):
        entry = entries.get(layer)
        if entry is None or entry["kind"] != "neurons":
            raise FlashError(f"{pack / MANIFEST}: layer {layer} has no neuron bundles to reorder")
        by_file.setdefault(entry["file"], []).append(entry)
    renames = []
    try:
        for file, file_entries in by_file.items():
            path = pack / file
            raw = np.fromfile(path, np.uint8)
            new = raw.copy()
            for entry in file_entries:
                count, stride, offset = entry["count"], entry["stride"], entry["offset"]
                order = check_order(orders[entry["layer"]], count, str(path))
                if len(raw) != entry["file_length"]:
                    raise FlashError(f"{path}: {len(raw)} bytes, manifest says {entry['file_length']}")
                ck = entry["checksums"]
                crcs = raw[ck["offset"]: ck["offset"] + ck["length"]].view("<u4")
                if zlib.crc32(crcs.tobytes()) != ck["crc32"]:
                    raise FlashError(f"{path}: crc32 table does not match the manifest (corrupt pack)")
                rows = raw[offset: offset + count * stride].reshape(count, stride)
                new[offset: offset + count * stride] = rows[order].ravel()
                new[ck["offset"]: ck["offset"] + ck["length"]] = crcs[order].view(np.uint8)
                ck["crc32"] = zlib.crc32(crcs[order].tobytes())
                prev = entry.get("neuron_order")
                entry["neuron_order"] = (np.asarray(prev, np.int64)[order] if prev is not None
                                         else order).tolist()
            tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
            renames.append((tmp, path))
            _write_bytes(tmp, [(0, new)], len(new))
        gates = {entries[layer]["resident_gate"]["source"]: orders[layer] for layer in orders
                 if entries[layer].get("resident_gate")}
        if gates:
            renames.append(_permuted_resident(pack, manifest, gates))
    except BaseException:
        for tmp, _ in renames:
            tmp.unlink(missing_ok=True)
        raise
    for tmp, dst in renames:
        os.replace(tmp, dst)
    write_manifest(pack, manifest)  # a crash before this leaves files the manifest refuses
    return manifest


def _permuted_resident(pack: Path, manifest: dict, gates: dict) -> tuple:
    """Write the resident file with the rows of the resident gates permuted ({gate module:
    order}) to a temporary name, update the manifest's length and crc32; (tmp, path)."""
    import mlx.core as mx

    from .reader import file_crc32, load_resident
    from ..paths import fsync_file, save_safetensors

    _, weights = load_resident(pack, manifest=read_manifest(pack))
    for module, order in gates.items():
        idx = mx.array(np.asarray(order, np.int64))
        for part in ("weight", "scales", "biases", "bias"):
            if f"{module}.{part}" in weights:  # quantized rows: groups run along the input
                weights[f"{module}.{part}"] = weights[f"{module}.{part}"][idx]
    res = manifest["resident"]
    path = pack / res["file"]
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    try:
        save_safetensors(tmp, weights, metadata={"format": "mlx"})
        fsync_file(tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    res["length"], res["crc32"] = tmp.stat().st_size, file_crc32(tmp)
    if res.get("memory_length") is not None:
        res["memory_length"] = res["length"]  # dense packs only: nothing decoded
    return tmp, path


def neuron_orders(manifest) -> dict:
    """{layer: int [count] original neuron at each position} (identity for never-reordered layers)."""
    return {b["layer"]: np.asarray(b.get("neuron_order", range(b["count"])), np.int64)
            for b in manifest["bundles"] if b["kind"] == "neurons"}
