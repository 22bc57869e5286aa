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
holds its dequantized values as floats (the source model; write_pack's down_bits=4/8 re-quantizes
instead: smaller, lossy, and the manifest says so in `down_requantized` and `down`).
Resident gate (`convert --gate-bits B`, the layer entry's "resident_gate": {"source": the gate
module, "bits", "group_size"}): the layer's gate is not in its bundles but in the resident file,
MLX affine-quantized (SOURCE.weight / .scales / .biases; config "quantization" names the bits and
group size, and only these modules have scales): a bundle is up row + down column.
Resident linears (`convert --resident-bits B`): the other resident matrices (attention projections,
embedding / tied lm_head) MLX affine-quantized in the resident file the same way; config
"quantization" then names their bits and group size, and each resident gate's as a per-module
override ({module path: {"bits", "group_size"}}, mlx-lm's form). The bundles are unchanged.
Expert bundle e (kind "experts") = expert e's full gate, up and down matrices in the source (mlx-lm
SwitchGLU) orientation, with their scales and biases: no transposition, no re-quantization.

Expert-wise bit widths (encoding "expert-bits", written by `convert --expert-bits`): an MoE layer's
experts are quantized at their own widths (2, 3, 4, 5, 6 or 8 bits). The layer entry records each
expert's width in `expert_bits` [count] and holds `groups`, one per width present: a complete dense
experts bundle record (same file; its own offset, count, stride, components, checksums) plus `bits`
and `experts`, the expert ids its bundles hold in order. Each group's stride is a multiple of the
alignment, so a 2-bit expert is a smaller direct-I/O block than a 4-bit one. Readers address a group
as the bundle key (layer, bits) (`layer_bundles`).

Each component starts at a multiple of 4 bytes inside its bundle (so typed views are aligned);
`stride` is the bundle size rounded up to 4 bytes. A bundle's crc32 covers its components' bytes
in order, padding excluded, so a reader can check exactly the bundles it read and nothing else.

ENDOR layer files (bundle "encoding": "endor", format version 2; written by `convert --encoding
endor`) hold pruned neurons as bitmap + non-zeros (pack/bitmap.py): neuron bundle i is its gate,
up and down-column rows, each one ENDOR block, plus any raw per-neuron pieces (biases), in
component order. Bundles vary in length: they are packed back to back from `offset` (compact: a
whole-layer read fetches only the encoded bytes; a reader of some neurons reads a covering,
`alignment`-rounded range and discards the edges), and an index table (uint64 [count + 1] file
offsets, bundle i = [index[i], index[i+1])) sits at its own aligned offset, with its crc32 in the
manifest, before the crc32 table (one per bundle, over its whole bytes). Components describe the
decoded rows (dtype, shape, `length` = decoded bytes, `offset` 0) and carry `endor`: the block
payload. The entry's `stride` is the mean encoded bundle size (for estimates only). Resident
matrices with enough exact zeros are stored as NAME.endor_bitmap + NAME.endor_values (or
.endor_codes, .endor_scales, .endor_biases), listed under the manifest's resident "endor", with
the resident tensors' decoded size as resident "memory_length".
"""

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from ..errors import FlashError
from .schema import check_pack_files, read_json_file, validate_manifest

FORMAT = "mlx-flash-pack"
FORMAT_VERSION = 1       # what dense packs are written as (readable by older mlx-flash)
ENDOR_VERSION = 2        # packs with any ENDOR-encoded tensor
READ_VERSIONS = (FORMAT_VERSION, ENDOR_VERSION)
ENCODINGS = ("dense", "endor", "expert-bits")
ENDOR_MIN_ZEROS = 0.25   # a resident matrix is bitmap-encoded from this fraction of exact zeros
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


class _Record:
    """Dict-style reads (`record["count"]`, `record.get("quantization")`) for code written against
    the manifest's JSON; mlx-flash's own code reads the attributes."""
    __slots__ = ()

    def __getitem__(self, key):
        try:
            return getattr(self, key)
        except AttributeError:
            raise KeyError(key) from None

    def get(self, key, default=None):
        return getattr(self, key, default)

    def __contains__(self, key):
        return hasattr(self, key)


@dataclass(frozen=True)
class Component(_Record):
    """One tensor's row inside every bundle of a layer: `name` is "role.part" (gate/up/down_t/...
    and weight/scales/biases/bias), `source` the mlx-lm tensor it came from; bytes `offset` ..
    `offset + length` of each bundle hold it as `dtype` [*shape]."""
    name: str
    source: str
    dtype: str
    shape: tuple
    offset: int
    length: int
    quantization: dict | None = None  # {"group_size", "bits"} of a quantized weight
    endor: dict | None = None  # ENDOR layers: the block payload ({"dtype"} or {"bits", "group_size"})

    @property
    def role(self) -> str:
        return self.name.split(".", 1)[0]

    @property
    def part(self) -> str:
        return self.name.split(".", 1)[1]

    @classmethod
    def from_dict(cls, d: dict) -> "Component":
        return cls(d["name"], d["source"], d["dtype"], tuple(d["shape"]), d["offset"], d["length"],
                   d.get("quantization"), d.get("endor"))


@dataclass(frozen=True)
class Bundle(_Record):
    """One layer's bundle file: `count` bundles of `stride` bytes from `offset` (kind "neurons":
    one per FFN neuron; "experts": one per MoE expert), their crc32 table at `checksums`."""
    layer: int
    kind: str
    file: str
    offset: int
    count: int
    stride: int
    length: int
    file_length: int
    components: tuple
    checksums: dict  # {"offset", "length", "crc32"} of the per-bundle crc32 table
    arch: str | None = None  # the FFN_TABLE family ("gated-mlp", "opt", ...)
    encoding: str = "dense"
    neuron_order: list | None = None  # reordered packs: original neuron at each position (reorder.py)
    index: dict | None = None  # ENDOR layers: {"offset", "length", "crc32"} of the bundle offsets
    expert_bits: tuple | None = None  # "expert-bits" layers: each expert's width (bits)
    groups: tuple | None = None  # "expert-bits" layers: one Bundle per width (its own layout)
    bits: int | None = None  # a width group: the bits of its experts
    experts: tuple | None = None  # a width group: the expert id of each of its bundles
    resident_gate: dict | None = None  # {"source", "bits", "group_size"}: gate resident, quantized

    @property
    def key(self):
        """How `layer_bundles` and the loader address this record: the layer, or (layer, bits)
        for a width group of an "expert-bits" layer."""
        return self.layer if self.bits is None else (self.layer, self.bits)

    @property
    def row_bytes(self) -> int:
        """Bytes of one bundle's components (padding excluded)."""
        return sum(c.length for c in self.components)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole layer's bundles on disk (count x stride; the groups' sum for an
        "expert-bits" layer)."""
        if self.groups:
            return sum(g.nbytes for g in self.groups)
        return self.count * self.stride

    def component(self, name: str) -> Component | None:
        return next((c for c in self.components if c.name == name), None)

    def modules(self) -> dict:
        """{role: mlx-lm module path} of the layer's projections ("up": "model.layers.0.mlp.up_proj"),
        a resident gate's included."""
        out = {c.role: c.source.rsplit(".", 1)[0] for c in self.components if c.part == "weight"}
        if self.resident_gate:
            out["gate"] = self.resident_gate["source"]
        return out

    @property
    def gated(self) -> bool:
        """True when the layer's FFN has a gate (in its bundles or resident)."""
        return self.component("gate.weight") is not None or bool(self.resident_gate)

    @classmethod
    def from_dict(cls, d: dict) -> "Bundle":
        if d.get("encoding") == "expert-bits":
            # the layer as a whole: its widths and groups; the layout lives in the groups
            groups = tuple(cls.from_dict(g) for g in d["groups"])
            return cls(d["layer"], d["kind"], d["file"], min(g.offset for g in groups), d["count"],
                       max(g.stride for g in groups), sum(g.length for g in groups),
                       d["file_length"], (), None, d.get("arch"), "expert-bits",
                       expert_bits=tuple(d["expert_bits"]), groups=groups)
        return cls(d["layer"], d["kind"], d["file"], d["offset"], d["count"], d["stride"], d["length"],
                   d["file_length"], tuple(Component.from_dict(c) for c in d["components"]),
                   d["checksums"], d.get("arch"), d.get("encoding", "dense"), d.get("neuron_order"),
                   d.get("index"), bits=d.get("bits"),
                   experts=tuple(d["experts"]) if d.get("experts") is not None else None,
                   resident_gate=d.get("resident_gate"))


@dataclass(frozen=True)
class Resident(_Record):
    """The resident safetensors file: `length` bytes, whole-file `crc32`, {name: {dtype, shape}}."""
    file: str
    length: int
    crc32: int
    tensors: dict = field(default_factory=dict)
    endor: dict = field(default_factory=dict)  # {name: {shape, dtype, nnz, payload}} stored as ENDOR
    memory_length: int | None = None  # bytes once ENDOR tensors are decoded (None: = length)


@dataclass(frozen=True)
class Manifest(_Record):
    """A pack's manifest.json as typed records; `fields` keeps the whole JSON document (labels such
    as "synthetic", "source", "down_requantized")."""
    alignment: int
    bundles: tuple
    resident: Resident | None
    config: dict
    fields: dict

    def __getitem__(self, key):
        return getattr(self, key) if key in _MANIFEST_ATTRS else self.fields[key]

    def get(self, key, default=None):
        return getattr(self, key) if key in _MANIFEST_ATTRS else self.fields.get(key, default)

    def __contains__(self, key):
        return key in _MANIFEST_ATTRS or key in self.fields

    @property
    def synthetic(self) -> dict | None:
        """The synthetic label of a pack of random weights, None for a real model's pack."""
        return self.fields.get("synthetic") or self.config.get("synthetic")

    @classmethod
    def from_dict(cls, d: dict) -> "Manifest":
        res = d.get("resident")
        resident = None if res is None else Resident(res["file"], res["length"], res["crc32"],
                                                     res.get("tensors", {}), res.get("endor", {}),
                                                     res.get("memory_length"))
        return cls(d["alignment"], tuple(Bundle.from_dict(b) for b in d.get("bundles", [])), resident,
                   d.get("config", {}), d)


_MANIFEST_ATTRS = ("alignment", "bundles", "resident", "config", "fields")


def read_manifest(pack_dir) -> Manifest:
    """Read and check `pack_dir/manifest.json` (format, version, encodings) -> Manifest; FlashError
    naming the file if unusable."""
    path = Path(pack_dir) / MANIFEST
    if not os.path.lexists(path):
        raise FlashError(f"{path}: not a flash pack (no manifest.json)")
    manifest = read_json_file(path, "manifest")
    if manifest.get("format") != FORMAT:  # read_json_file returns only objects
        raise FlashError(f"{path}: not a flash pack manifest (format {manifest.get('format')!r})")
    version = manifest.get("format_version")
    if version not in READ_VERSIONS:
        raise FlashError(f"{path}: pack format version {version}, this mlx-flash reads versions "
                         f"{', '.join(map(str, READ_VERSIONS))}; re-convert the model")
    validate_manifest(manifest, path)  # first: the loop below needs a list of objects
    for b in manifest["bundles"]:
        if b.get("encoding", "dense") not in ENCODINGS or (b.get("encoding") == "endor"
                                                            and version < ENDOR_VERSION):
            raise FlashError(f"{path}: layer {b.get('layer')} has bundle encoding "
                             f"{b.get('encoding')!r}; this reader supports {', '.join(ENCODINGS)}")
    check_pack_files(pack_dir, manifest, path)
    return Manifest.from_dict(manifest)


def layer_bundles(manifest: Manifest) -> dict:
    """Layer index -> Bundle of the manifest, and (layer, bits) -> the width group of an
    "expert-bits" layer (what a reader reads: the layer record itself has no single layout)."""
    out = {b.layer: b for b in manifest.bundles}
    for b in manifest.bundles:
        out.update((g.key, g) for g in b.groups or ())
    return out
