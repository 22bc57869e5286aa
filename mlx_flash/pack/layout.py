"""The one place that knows the flash pack format: names, manifest schema, bundle layouts.

A pack is a directory:

    manifest.json            format version, source, config, resident tensors, bundle files
    config.json              the model config (with "quantization" when quantized)
    resident.safetensors     embeddings, attention, norms, lm_head, MoE routers, FFN output biases
    bundles/layer_NNN.bin    one file per layer: all FFN neurons (or all MoE experts) of that layer
    tokenizer*.json, ...     copied through from the source folder

A bundle file holds `count` bundles of `stride` bytes starting at `offset` (a multiple of the pack's
`alignment`, 4 KiB by default), then a crc32 table (uint32 little endian, one per bundle) at its own
aligned offset; the file is zero-padded to a multiple of `alignment`.

Neuron bundle i (kind "neurons") = its gate row, up row and down column, each with its quantization
scales and biases, one after another ("row-column bundling"). The down column is stored as row i of
down.T ([intermediate, hidden]) because a column of an MLX-quantized down matrix is not separable:
its groups run along the intermediate axis. When the source down matrix is already quantized, down.T
is re-quantized with the same bits and group size (lossy; the manifest says `down_requantized`).
Expert bundle e (kind "experts") = expert e's full gate, up and down matrices in the source (mlx-lm
SwitchGLU) orientation, with their scales and biases: no transposition, no re-quantization.

Each component starts at a multiple of 4 bytes inside its bundle (so typed views are aligned);
`stride` is the bundle size rounded up to 4 bytes. A bundle's crc32 covers its components' bytes
in order, padding excluded, so a reader can check exactly the bundles it read and nothing else.
"""

import json
import re
from pathlib import Path

import mlx.core as mx

from ..errors import FlashError

FORMAT = "mlx-flash-pack"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
RESIDENT_FILE = "resident.safetensors"
DEFAULT_ALIGNMENT = 4096
COMPONENT_ALIGN = 4

# Which tensors are the FFN of layer N, per architecture family (mlx-lm weight names).
# Roles: "gate" (gated models), "up" (rows = neurons), "down" (columns = neurons).
# kind "experts": tensors are stacked [E, out, in] (mlx-lm SwitchGLU); one bundle per expert.
FFN_TABLE = [
    {"name": "switch-glu", "kind": "experts",
     "prefix": r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.switch_mlp\.",
     "roles": {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}},
    {"name": "gated-mlp", "kind": "neurons", "prefix": r"model\.layers\.(\d+)\.mlp\.",
     "roles": {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}},
    {"name": "opt", "kind": "neurons", "prefix": r"model\.decoder\.layers\.(\d+)\.",
     "roles": {"up": "fc1", "down": "fc2"}},
    {"name": "fc1-fc2", "kind": "neurons", "prefix": r"model\.layers\.(\d+)\.mlp\.",
     "roles": {"up": "fc1", "down": "fc2"}},
    {"name": "gpt2", "kind": "neurons", "prefix": r"model\.h\.(\d+)\.mlp\.",
     "roles": {"up": "c_fc", "down": "c_proj"}},
]

ROLE_ORDER = ("gate", "up", "down")


def find_ffn(names):
    """Map layer index -> {"arch", "kind", "modules": {role: module path}} for every FFN found."""
    names = set(names)
    layers = {}
    for entry in FFN_TABLE:
        pattern = re.compile("^(" + entry["prefix"] + ")" + re.escape(entry["roles"]["up"]) + r"\.weight$")
        for name in sorted(names):
            m = pattern.match(name)
            if not m:
                continue
            prefix, layer = m.group(1), int(m.group(2))
            modules = {role: prefix + mod for role, mod in entry["roles"].items()}
            if layer in layers or not all(f"{p}.weight" in names for p in modules.values()):
                continue
            layers[layer] = {"arch": entry["name"], "kind": entry["kind"], "modules": modules}
    return dict(sorted(layers.items()))


def mx_dtype(name: str):
    """MLX dtype from its manifest name ('float16', 'uint32', ...)."""
    try:
        return getattr(mx, name)
    except AttributeError:
        raise FlashError(f"unknown dtype {name!r} in manifest") from None


def dtype_name(dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def read_manifest(pack_dir) -> dict:
    """Read and validate `pack_dir/manifest.json`; FlashError naming the file if unusable."""
    path = Path(pack_dir) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise FlashError(f"{path}: not a flash pack (no manifest.json)") from None
    except (OSError, ValueError) as e:
        raise FlashError(f"{path}: unreadable manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise FlashError(f"{path}: not a flash pack manifest (format {manifest.get('format')!r})"
                         if isinstance(manifest, dict) else f"{path}: not a flash pack manifest")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise FlashError(f"{path}: pack format version {version}, this mlx-flash reads version "
                         f"{FORMAT_VERSION}; re-convert the model")
    for b in manifest.get("bundles", []):
        if b.get("encoding") != "dense":
            raise FlashError(f"{path}: layer {b.get('layer')} has bundle encoding "
                             f"{b.get('encoding')!r}; this reader supports 'dense'")
    return manifest


def layer_bundles(manifest: dict) -> dict:
    """Layer index -> bundle file entry of the manifest."""
    return {b["layer"]: b for b in manifest["bundles"]}
