"""The flash pack: the on-disk format (layout.py), its writer and its whole-pack readers.

Public API:
    write_pack(src_dir, out_dir, *, dtype=None, quantize=None, group_size=64, progress=True) -> Path
    load_pack_weights(pack_dir) -> (config, {mlx-lm name: mx.array})   # full model, dense
    load_resident(pack_dir) -> (config, {name: mx.array})               # everything but bundled FFN
    read_manifest(pack_dir) -> Manifest                                 # checked manifest, typed:
        .alignment, .resident (Resident), .config, .bundles (Bundle: layer, kind, file, offset,
        count, stride, components (Component: name, source, dtype, shape, offset, length, ...))
    write_bundle_file(path, regions, alignment) -> [bundle record]      # one bundle file
    write_manifest(pack_dir, manifest)                                  # manifest.json, atomically
"""

from .layout import (FFN_TABLE, FORMAT, FORMAT_VERSION, Bundle, Component, Manifest, find_ffn, layer_bundles,
                     read_manifest)
from .reader import load_pack_weights, load_resident, read_layer_components
from .writer import write_bundle_file, write_manifest, write_pack

__all__ = ["FORMAT", "FORMAT_VERSION", "FFN_TABLE", "Bundle", "Component", "Manifest", "find_ffn", "layer_bundles", "read_manifest",
           "load_pack_weights", "load_resident", "read_layer_components", "write_bundle_file", "write_manifest", "write_pack"]
