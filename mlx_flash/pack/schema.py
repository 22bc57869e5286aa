"""Untrusted metadata: every field of manifest.json checked against a schema and against each other
(config vs tensors vs file sizes) before anything is allocated or read, a checksum over the
metadata itself, and the pack's files checked to be regular files inside the pack before any open.

A failed check raises FlashError naming the file, the field and the reason (one line).
"""

import json
import math
import os
import stat
import zlib
from pathlib import Path

from ..errors import FlashError
# read_json_file: how the pack reads manifest.json and predictors.json (the one JSON-file reader)
from ..paths import read_json_file, write_json_atomic  # noqa: F401

DTYPE_BYTES = {"bool_": 1, "uint8": 1, "int8": 1, "uint16": 2, "int16": 2, "float16": 2,
               "bfloat16": 2, "uint32": 4, "int32": 4, "float32": 4, "uint64": 8, "int64": 8}
QUANT_BITS = (2, 3, 4, 5, 6, 8)
QUANT_GROUP_SIZES = (32, 64, 128)
BUNDLE_KINDS = ("neurons", "experts")
CHECKSUM_KEY = "metadata_crc32"
# Bounds far above any real model, so a corrupt number fails here, not in an allocation.
MAX_COUNT = 1 << 24  # bundles per file
MAX_BYTES = 1 << 44  # bytes of one file (16 TiB)
MAX_DIM = 1 << 24  # elements along one tensor axis / one config dimension
MAX_LAYERS = 4096
# Config keys that give a layer's FFN width (neurons) or expert count, when the config has them.
NEURON_KEYS = ("intermediate_size", "ffn_dim", "n_inner")
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def metadata_crc32(doc: dict) -> int:
    """crc32 of a metadata document without its own checksum (canonical JSON: sorted keys)."""
    body = {k: v for k, v in doc.items() if k != CHECKSUM_KEY}
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def write_metadata(path: Path, doc: dict) -> None:
    """Write a metadata document (manifest.json, predictors.json) with its checksum, atomically."""
    doc = dict(doc)
    doc[CHECKSUM_KEY] = metadata_crc32(doc)
    write_json_atomic(path, doc)


class FieldCheck:
    """Field checks that raise FlashError '<file>: <field> <reason>'."""

    def __init__(self, path):
        self.path = path

    def fail(self, field, reason):
        raise FlashError(f"{self.path}: {field} {reason}")

    def get(self, doc, key, field=None):
        if not isinstance(doc, dict):
            self.fail(field or key, "is missing (its parent is not an object)")
        if key not in doc:
            self.fail(field or key, "is missing")
        return doc[key]

    def int(self, value, field, lo=0, hi=MAX_BYTES):
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(field, f"must be an integer, not {value!r:.40}")
        if not lo <= value <= hi:
            self.fail(field, f"= {value} is out of range {lo}..{hi}")
        return value

    def num(self, value, field, lo=-math.inf, hi=math.inf, lo_open=False):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self.fail(field, f"must be a finite number, not {value!r:.40}")
        if value < lo or value > hi or (lo_open and value == lo):
            self.fail(field, f"= {value} is out of range {'(' if lo_open else '['}{lo}, {hi}]")
        return value

    def str(self, value, field, choices=None):
        if not isinstance(value, str):
            self.fail(field, f"must be a string, not {value!r:.40}")
        if choices is not None and value not in choices:
            self.fail(field, f"= {value!r} is not one of {', '.join(map(str, choices))}")
        return value

    def list(self, value, field):
        if not isinstance(value, list):
            self.fail(field, "must be a list")
        return value

    def dict(self, value, field):
        if not isinstance(value, dict):
            self.fail(field, "must be an object")
        return value


def check_checksum(doc: dict, path) -> None:
    """FlashError unless `doc` carries a metadata checksum that matches its content."""
    c = FieldCheck(path)
    want = doc.get(CHECKSUM_KEY)
    if want is None:
        c.fail(CHECKSUM_KEY, "is missing (written by an older mlx-flash, or edited); re-create it")
    if metadata_crc32(doc) != want:
        c.fail(CHECKSUM_KEY, "does not match the content (corrupt or edited)")


def check_quantization(q, field, c: FieldCheck):
    c.dict(q, field)
    c.int(c.get(q, "group_size", f"{field}.group_size"), f"{field}.group_size", 1, MAX_DIM)
    if q["group_size"] not in QUANT_GROUP_SIZES:
        c.fail(f"{field}.group_size", f"= {q['group_size']} is not one of {QUANT_GROUP_SIZES}")
    c.int(c.get(q, "bits", f"{field}.bits"), f"{field}.bits", 1, 8)
    if q["bits"] not in QUANT_BITS:
        c.fail(f"{field}.bits", f"= {q['bits']} is not one of {QUANT_BITS}")


def check_config(config: dict, c: FieldCheck) -> None:
    """Values the model is built from: positive bounded integers, finite positive epsilons,
    valid quantization (group size 0 would kill the process inside MLX)."""
    c.dict(config, "config")
    c.str(c.get(config, "model_type", "config.model_type"), "config.model_type")
    for key in ("hidden_size", "vocab_size", *NEURON_KEYS, *EXPERT_KEYS, "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings"):
        if config.get(key) is not None:
            c.int(config[key], f"config.{key}", 1, MAX_DIM)
    if "num_hidden_layers" in config:
        c.int(config["num_hidden_layers"], "config.num_hidden_layers", 1, MAX_LAYERS)
    # present means a number: null reaches mlx-lm as None (rope_theta null: a ValueError in MLX's rope)
    for key in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon"):
        if key in config:
            c.num(config[key], f"config.{key}", 0, 1, lo_open=True)
    if "rope_theta" in config:
        c.num(config["rope_theta"], "config.rope_theta", 0, 1e12, lo_open=True)
    q = config.get("quantization")
    if q is not None:
        check_quantization(q, "config.quantization", c)
        for key, own in q.items():
            if isinstance(own, dict):
                check_quantization(own, f"config.quantization.{key}", c)


def _check_component(comp, i, field, stride, c: FieldCheck):
    f = f"{field}.components[{i}]"
    c.dict(comp, f)
    name = c.str(c.get(comp, "name", f"{f}.name"), f"{f}.name")
    c.str(c.get(comp, "source", f"{f}.source"), f"{f}.source")
    dtype = c.str(c.get(comp, "dtype", f"{f}.dtype"), f"{f}.dtype", DTYPE_BYTES)
    shape = c.list(c.get(comp, "shape", f"{f}.shape"), f"{f}.shape")
    if len(shape) > 4:
        c.fail(f"{f}.shape", f"has {len(shape)} axes")
    elements = 1
    for k, d in enumerate(shape):
        elements *= c.int(d, f"{f}.shape[{k}]", 1, MAX_DIM)
    off = c.int(c.get(comp, "offset", f"{f}.offset"), f"{f}.offset", 0, stride)
    length = c.int(c.get(comp, "length", f"{f}.length"), f"{f}.length", 1, stride)
    if off % 4:
        c.fail(f"{f}.offset", f"= {off} is not a multiple of 4")
    if length != elements * DTYPE_BYTES[dtype]:
        c.fail(f"{f}.length", f"= {length} bytes, but shape {shape} of {dtype} is "
                              f"{elements * DTYPE_BYTES[dtype]}")
    if off + length > stride:
        c.fail(f"{f}", f"runs past the bundle stride ({off} + {length} > {stride})")
    if comp.get("quantization") is not None:
        check_quantization(comp["quantization"], f"{f}.quantization", c)
        if dtype != "uint32":
            c.fail(f"{f}.dtype", f"= {dtype}: quantized weights are uint32")
    return name, off, length


def _check_table(b, key, field, want_length, c: FieldCheck) -> tuple:
    """(offset, length) of a layer file's table record b[key] = {"offset", "length", "crc32"}."""
    t = c.dict(c.get(b, key, f"{field}.{key}"), f"{field}.{key}")
    t_off = c.int(c.get(t, "offset", f"{field}.{key}.offset"), f"{field}.{key}.offset")
    t_len = c.int(c.get(t, "length", f"{field}.{key}.length"), f"{field}.{key}.length")
    c.int(c.get(t, "crc32", f"{field}.{key}.crc32"), f"{field}.{key}.crc32", 0, 2 ** 32 - 1)
    if t_len != want_length:
        c.fail(f"{field}.{key}.length", f"= {t_len}, but {b['count']} bundles need {want_length}")
    return t_off, t_len


def _check_endor_bundle(b, field, alignment, count, c: FieldCheck) -> None:
    """An ENDOR layer: decoded components, variable-length bundles found through the index table."""
    offset = c.int(c.get(b, "offset", f"{field}.offset"), f"{field}.offset")
    length = c.int(c.get(b, "length", f"{field}.length"), f"{field}.length")
    file_length = c.int(c.get(b, "file_length", f"{field}.file_length"), f"{field}.file_length")
    c.int(c.get(b, "stride", f"{field}.stride"), f"{field}.stride", 1, 1 << 30)
    if offset % alignment or file_length % alignment:
        c.fail(field, f"offset {offset} / file_length {file_length} not multiples of the alignment {alignment}")
    comps = c.list(c.get(b, "components", f"{field}.components"), f"{field}.components")
    if not comps:
        c.fail(f"{field}.components", "is empty")
    names = set()
    for k, comp in enumerate(comps):
        f = f"{field}.components[{k}]"
        name, _, _ = _check_component(comp, k, field, 1 << 30, c)
        if name in names:
            c.fail(f"{field}.components", f"name {name!r} appears twice")
        names.add(name)
        payload = comp.get("endor")
        if payload is None:
            continue
        c.dict(payload, f"{f}.endor")
        if payload.get("bits") is None:
            c.str(c.get(payload, "dtype", f"{f}.endor.dtype"), f"{f}.endor.dtype",
                  ("float16", "bfloat16", "float32"))
        else:
            c.int(payload["bits"], f"{f}.endor.bits", 4, 8)
            if payload["bits"] not in (4, 8):
                c.fail(f"{f}.endor.bits", f"= {payload['bits']}: ENDOR codes are 4 or 8 bits")
            c.int(c.get(payload, "group_size", f"{f}.endor.group_size"), f"{f}.endor.group_size", 1, 1 << 20)
    i_off, i_len = _check_table(b, "index", field, 8 * (count + 1), c)
    t_off, t_len = _check_table(b, "checksums", field, 4 * count, c)
    regions = sorted([(offset, offset + length), (i_off, i_off + i_len), (t_off, t_off + t_len)])
    if any(a[1] > b_[0] for a, b_ in zip(regions, regions[1:])) or regions[-1][1] > file_length:
        c.fail(field, f"bundles, index and checksum table overlap or run past file_length {file_length}")


def _check_expert_bits_bundle(b, field, alignment, c: FieldCheck) -> None:
    """An "expert-bits" MoE layer: each expert's width in `expert_bits`, one dense width group per
    width (validated as a bundle of its own) holding exactly the experts of that width, quantized
    at it: the packed weight's row and the scales' row must agree with bits and group size."""
    c.int(c.get(b, "layer", f"{field}.layer"), f"{field}.layer", 0, 1 << 20)
    c.str(c.get(b, "kind", f"{field}.kind"), f"{field}.kind", ("experts",))
    file = c.str(c.get(b, "file", f"{field}.file"), f"{field}.file")
    count = c.int(c.get(b, "count", f"{field}.count"), f"{field}.count", 1, MAX_COUNT)
    file_length = c.int(c.get(b, "file_length", f"{field}.file_length"), f"{field}.file_length")
    widths = c.list(c.get(b, "expert_bits", f"{field}.expert_bits"), f"{field}.expert_bits")
    if len(widths) != count:
        c.fail(f"{field}.expert_bits", f"has {len(widths)} widths for {count} experts")
    for e, w in enumerate(widths):
        c.int(w, f"{field}.expert_bits[{e}]", 1, 8)
        if w not in QUANT_BITS:
            c.fail(f"{field}.expert_bits[{e}]", f"= {w} is not one of {QUANT_BITS}")
    groups = c.list(c.get(b, "groups", f"{field}.groups"), f"{field}.groups")
    if not groups:
        c.fail(f"{field}.groups", "is empty")
    seen, regions = set(), []
    for j, g in enumerate(groups):
        f = f"{field}.groups[{j}]"
        check_bundle(g, f, alignment, c)
        if g.get("encoding", "dense") != "dense" or g["kind"] != "experts" or g["file"] != file \
                or g["layer"] != b["layer"]:
            c.fail(f, f"must be a dense experts bundle of layer {b['layer']} in {file}")
        bits = c.int(c.get(g, "bits", f"{f}.bits"), f"{f}.bits", 1, 8)
        experts = c.list(c.get(g, "experts", f"{f}.experts"), f"{f}.experts")
        if len(experts) != g["count"]:
            c.fail(f"{f}.experts", f"has {len(experts)} ids for {g['count']} bundles")
        for e in experts:
            c.int(e, f"{f}.experts", 0, count - 1)
            if e in seen:
                c.fail(f"{f}.experts", f"expert {e} is in two groups")
            seen.add(e)
            if widths[e] != bits:
                c.fail(f"{field}.expert_bits[{e}]", f"= {widths[e]}, but its block is in the "
                                                    f"{bits}-bit group {j}")
        comps = {comp["name"]: comp for comp in g["components"]}
        for comp in g["components"]:
            q = comp.get("quantization")
            if not comp["name"].endswith(".weight"):
                continue
            if q is None or q["bits"] != bits:
                c.fail(f"{f}.components[{comp['name']!r}].quantization",
                       f"= {q!r:.60}, but the group is {bits}-bit")
            scales = comps.get(comp["name"][: -len("weight")] + "scales")
            if scales is None or scales["shape"][:-1] != comp["shape"][:-1] or \
                    comp["shape"][-1] * 32 != scales["shape"][-1] * q["group_size"] * bits:
                c.fail(f"{f}.components[{comp['name']!r}]",
                       f"shape {comp['shape']} is not {bits}-bit with group size {q['group_size']} "
                       f"for its scales {scales['shape'] if scales else None}")
        regions += [(g["offset"], g["offset"] + g["length"]),
                    (g["checksums"]["offset"], g["checksums"]["offset"] + g["checksums"]["length"])]
    if len(seen) != count:
        c.fail(f"{field}.groups", f"hold {len(seen)} of the layer's {count} experts")
    regions.sort()
    if any(a[1] > b_[0] for a, b_ in zip(regions, regions[1:])) or regions[-1][1] > file_length:
        c.fail(field, f"width groups overlap or run past file_length {file_length}")


def check_bundle(b, i, alignment, c: FieldCheck) -> None:
    """One bundle file entry: its layout fits its stride, its regions fit its file, nothing overlaps.
    i: its index in `bundles` (or the field name of a nested record)."""
    field = i if isinstance(i, str) else f"bundles[{i}]"
    c.dict(b, field)
    if b.get("encoding") == "expert-bits":
        return _check_expert_bits_bundle(b, field, alignment, c)
    if b.get("encoding") == "endor":
        c.int(c.get(b, "layer", f"{field}.layer"), f"{field}.layer", 0, 1 << 20)
        c.str(c.get(b, "kind", f"{field}.kind"), f"{field}.kind", ("neurons",))
        c.str(c.get(b, "file", f"{field}.file"), f"{field}.file")
        count = c.int(c.get(b, "count", f"{field}.count"), f"{field}.count", 1, MAX_COUNT)
        return _check_endor_bundle(b, field, alignment, count, c)
    c.int(c.get(b, "layer", f"{field}.layer"), f"{field}.layer", 0, 1 << 20)
    c.str(c.get(b, "kind", f"{field}.kind"), f"{field}.kind", BUNDLE_KINDS)
    c.str(c.get(b, "file", f"{field}.file"), f"{field}.file")
    count = c.int(c.get(b, "count", f"{field}.count"), f"{field}.count", 1, MAX_COUNT)
    stride = c.int(c.get(b, "stride", f"{field}.stride"), f"{field}.stride", 4, 1 << 30)
    if stride % 4:
        c.fail(f"{field}.stride", f"= {stride} is not a multiple of 4")
    offset = c.int(c.get(b, "offset", f"{field}.offset"), f"{field}.offset")
    length = c.int(c.get(b, "length", f"{field}.length"), f"{field}.length")
    file_length = c.int(c.get(b, "file_length", f"{field}.file_length"), f"{field}.file_length")
    if length != count * stride:
        c.fail(f"{field}.length", f"= {length}, but count {count} x stride {stride} = {count * stride}")
    if offset % alignment or file_length % alignment:
        c.fail(field, f"offset {offset} / file_length {file_length} not multiples of the alignment {alignment}")
    comps = c.list(c.get(b, "components", f"{field}.components"), f"{field}.components")
    if not comps:
        c.fail(f"{field}.components", "is empty")
    spans, names = [], set()
    for k, comp in enumerate(comps):
        name, off, n = _check_component(comp, k, field, stride, c)
        if name in names:
            c.fail(f"{field}.components", f"name {name!r} appears twice")
        names.add(name)
        spans.append((off, off + n))
    spans.sort()
    if any(a[1] > b_[0] for a, b_ in zip(spans, spans[1:])):
        c.fail(f"{field}.components", "overlap inside the bundle")
    t = c.dict(c.get(b, "checksums", f"{field}.checksums"), f"{field}.checksums")
    t_off = c.int(c.get(t, "offset", f"{field}.checksums.offset"), f"{field}.checksums.offset")
    t_len = c.int(c.get(t, "length", f"{field}.checksums.length"), f"{field}.checksums.length")
    c.int(c.get(t, "crc32", f"{field}.checksums.crc32"), f"{field}.checksums.crc32", 0, 2 ** 32 - 1)
    if t_len != 4 * count:
        c.fail(f"{field}.checksums.length", f"= {t_len}, but {count} bundles need {4 * count}")
    regions = sorted([(offset, offset + length), (t_off, t_off + t_len)])
    if regions[0][1] > regions[1][0] or regions[1][1] > file_length:
        c.fail(field, f"bundles ({offset}+{length}) and checksum table ({t_off}+{t_len}) overlap "
                      f"or run past file_length {file_length}")


def _ffn_width(config, keys):
    return {config[k] for k in keys if isinstance(config.get(k), int)}


def validate_manifest(manifest, path) -> dict:
    """FlashError naming `path` and the field unless the manifest is internally consistent:
    schema of every field, bundle layouts vs strides vs file lengths, unique layers, bundle counts
    vs the config's FFN width, resident tensor table, config values, metadata checksum."""
    c = FieldCheck(path)
    check_checksum(manifest, path)
    alignment = c.int(c.get(manifest, "alignment"), "alignment", 1, 1 << 30)
    if alignment % 512 and alignment & (alignment - 1):
        c.fail("alignment", f"= {alignment} is not a power of two or a multiple of 512")
    if manifest.get("checksum", "crc32") != "crc32":
        c.fail("checksum", f"= {manifest.get('checksum')!r}: this reader checks crc32")
    # A model pack has both; bench io's unbundled comparison copy has neither (the loader only).
    if ("config" in manifest) != ("resident" in manifest):
        c.fail("config" if "config" not in manifest else "resident", "is missing")
    config = manifest.get("config")
    if "config" in manifest:
        check_config(config, c)
    if manifest.get("quantization") is not None:
        check_quantization(manifest["quantization"], "quantization", c)
    res = manifest.get("resident")
    if "resident" in manifest:
        c.dict(res, "resident")
        c.str(c.get(res, "file", "resident.file"), "resident.file")
        res_length = c.int(c.get(res, "length", "resident.length"), "resident.length", 8)
        c.int(c.get(res, "crc32", "resident.crc32"), "resident.crc32", 0, 2 ** 32 - 1)
        tensors = c.dict(c.get(res, "tensors", "resident.tensors"), "resident.tensors")
        for name, t in tensors.items():
            c.dict(t, f"resident.tensors[{name!r}]")
            c.str(c.get(t, "dtype", f"resident.tensors[{name!r}].dtype"),
                  f"resident.tensors[{name!r}].dtype", DTYPE_BYTES)
            for k, d in enumerate(c.list(c.get(t, "shape", f"resident.tensors[{name!r}].shape"),
                                         f"resident.tensors[{name!r}].shape")):
                c.int(d, f"resident.tensors[{name!r}].shape[{k}]", 0, MAX_DIM)
        for name, spec in c.dict(res.get("endor", {}), "resident.endor").items():
            f = f"resident.endor[{name!r}]"
            c.dict(spec, f)
            shape = c.list(c.get(spec, "shape", f"{f}.shape"), f"{f}.shape")
            if len(shape) != 2:
                c.fail(f"{f}.shape", f"= {shape!r:.40} must be [rows, columns]")
            for k, d in enumerate(shape):
                c.int(d, f"{f}.shape[{k}]", 1, MAX_DIM)
            c.str(c.get(spec, "dtype", f"{f}.dtype"), f"{f}.dtype", ("float16", "bfloat16", "float32"))
            c.int(c.get(spec, "nnz", f"{f}.nnz"), f"{f}.nnz", 0, shape[0] * shape[1])
            payload = c.dict(c.get(spec, "payload", f"{f}.payload"), f"{f}.payload")
            if payload.get("bits") is not None:
                check_quantization(payload, f"{f}.payload", c)
                if payload["bits"] not in (4, 8):
                    c.fail(f"{f}.payload.bits", f"= {payload['bits']}: ENDOR codes are 4 or 8 bits")
            # its pieces are tensors of the resident file; the bitmap holds one bit per column
            pieces = ("bitmap", "values") if payload.get("bits") is None else ("bitmap", "codes", "scales", "biases")
            for piece in pieces:
                if not isinstance(tensors.get(f"{name}.endor_{piece}"), dict):
                    c.fail(f, f"needs the resident tensor {name}.endor_{piece}")
            bitmap = tensors[f"{name}.endor_bitmap"]
            if bitmap["dtype"] != "uint8" or bitmap["shape"] != [shape[0], -(-shape[1] // 8)]:
                c.fail(f"resident.tensors[{name + '.endor_bitmap'!r}]",
                       f"must be uint8 [{shape[0]}, {-(-shape[1] // 8)}] for shape {shape}")
        _check_memory_length(res, res_length, c)
        if config is not None:
            _check_vocab(config, tensors, c)
    bundles = c.list(c.get(manifest, "bundles"), "bundles")
    layers = set()
    for i, b in enumerate(bundles):
        check_bundle(b, i, alignment, c)
        if b["layer"] in layers:
            c.fail(f"bundles[{i}].layer", f"= {b['layer']} appears twice")
        layers.add(b["layer"])
        if b.get("resident_gate") is not None:
            _check_resident_gate(b, i, res, c)
        if config is not None:
            _check_rows_vs_hidden(b, i, config, c)
            keys = NEURON_KEYS if b["kind"] == "neurons" else EXPERT_KEYS
            widths = _ffn_width(config, keys)
            if widths and b["count"] not in widths:
                c.fail(f"bundles[{i}].count", f"= {b['count']}, but the config's "
                                              f"{'/'.join(k for k in keys if k in config)} says "
                                              f"{sorted(widths)[0]}")
    if manifest.get("moe_routing") is not None:
        _check_moe_routing(manifest["moe_routing"], bundles, c)
    if config is not None and isinstance(config.get("num_hidden_layers"), int):
        beyond = sorted(x for x in layers if x >= config["num_hidden_layers"])
        if beyond:
            c.fail("bundles", f"layer {beyond[0]} is beyond config.num_hidden_layers "
                              f"{config['num_hidden_layers']}")
    return manifest


def _check_resident_gate(b, i, res, c: FieldCheck):
    """A neuron layer whose gate is resident and quantized: its source module, bits and group
    size, no gate component in its bundles, and the resident file's quantized tensors of it."""
    f = f"bundles[{i}].resident_gate"
    g = c.dict(b["resident_gate"], f)
    source = c.str(c.get(g, "source", f"{f}.source"), f"{f}.source")
    check_quantization(g, f, c)
    if b.get("kind") != "neurons" or b.get("encoding", "dense") != "dense":
        c.fail(f, "is for dense neuron bundles only")
    if any(str(comp.get("name", "")).startswith("gate.") for comp in b.get("components", ())):
        c.fail(f, "but the bundles hold gate rows too")
    tensors = (res or {}).get("tensors", {}) if isinstance(res, dict) else {}
    for part in ("weight", "scales", "biases"):
        if res is not None and not isinstance(tensors.get(f"{source}.{part}"), dict):
            c.fail(f, f"needs the resident tensor {source}.{part}")


def _check_moe_routing(r, bundles, c: FieldCheck):
    """Calibration routing statistics: increasing slot counts within the expert count, and for
    every MoE layer a non-negative hit count per size."""
    c.dict(r, "moe_routing")
    c.str(c.get(r, "policy", "moe_routing.policy"), "moe_routing.policy", ("lru", "lfu", "layer"))
    experts = {b["layer"]: b["count"] for b in bundles if b["kind"] == "experts"}
    sizes = c.list(c.get(r, "sizes", "moe_routing.sizes"), "moe_routing.sizes")
    if not sizes:
        c.fail("moe_routing.sizes", "is empty")
    for k, n in enumerate(sizes):
        c.int(n, f"moe_routing.sizes[{k}]", 1, max(experts.values(), default=1))
        if k and n <= sizes[k - 1]:
            c.fail("moe_routing.sizes", "must increase")
    hits = c.dict(c.get(r, "hits", "moe_routing.hits"), "moe_routing.hits")
    if set(hits) != {str(layer) for layer in experts}:
        c.fail("moe_routing.hits", f"must have one entry per MoE layer {sorted(experts)}")
    for layer, h in hits.items():
        c.list(h, f"moe_routing.hits[{layer}]")
        if len(h) != len(sizes):
            c.fail(f"moe_routing.hits[{layer}]", f"has {len(h)} counts for {len(sizes)} sizes")
        for k, v in enumerate(h):
            c.int(v, f"moe_routing.hits[{layer}][{k}]", 0, 1 << 40)


def _check_memory_length(res, length, c: FieldCheck):
    """resident.memory_length (bytes once ENDOR tensors are decoded; absent: = length) is what the
    memory plan adds up: at least the file's length (ENDOR pieces decode larger), exactly it when no
    tensor is ENDOR-encoded."""
    if res.get("memory_length") is None:
        return
    memory = c.int(res["memory_length"], "resident.memory_length", length, MAX_BYTES)
    if not res.get("endor") and memory != length:
        c.fail("resident.memory_length", f"= {memory}, but with no ENDOR tensors it is "
                                         f"resident.length {length}")


def _check_rows_vs_hidden(b, i, config, c: FieldCheck):
    """A neuron bundle's weight rows run along the hidden size (packed 32 / bits per uint32)."""
    hidden = config.get("hidden_size")
    if b["kind"] != "neurons" or not isinstance(hidden, int):
        return
    for k, comp in enumerate(b["components"]):
        if not comp["name"].endswith(".weight") or len(comp["shape"]) != 1:
            continue
        q = comp.get("quantization")
        want = hidden * q["bits"] // 32 if q else hidden
        if comp["shape"][0] != want:
            c.fail(f"bundles[{i}].components[{k}].shape", f"= {comp['shape']}, but hidden_size "
                                                          f"{hidden} needs [{want}]")


def _check_vocab(config, tensors, c: FieldCheck):
    """The embedding table's rows must be the config's vocab_size (a larger vocab_size would make
    the model allocate and index rows that do not exist)."""
    vocab = config.get("vocab_size")
    for name, t in tensors.items():
        if name.endswith(("embed_tokens.weight", "wte.weight")) and t["shape"]:
            if vocab is not None and t["shape"][0] != vocab:
                c.fail("config.vocab_size", f"= {vocab}, but {name} has {t['shape'][0]} rows")


def check_pack_file(pack_dir, rel, field, path_for_errors, *, size=None, min_size=None) -> Path:
    """The path of `rel` inside the pack, checked before any open: relative, no '..', no symlink
    out, a regular file (not a FIFO or device), of exactly `size` or at least `min_size` bytes."""
    c = FieldCheck(path_for_errors)
    pack = Path(pack_dir)
    p = Path(rel)
    if not rel or p.is_absolute() or ".." in p.parts or "\0" in rel:
        c.fail(field, f"= {rel!r} must be a relative path inside the pack")
    full = pack / p
    try:
        real = full.resolve(strict=True)
        # inside the pack, or inside the folder its manifest really is in (a view of symlinks to
        # a pack, as eval's sweep makes, reads that pack's files)
        roots = {pack.resolve(strict=True), (pack / "manifest.json").resolve(strict=True).parent}
        inside = any(real.is_relative_to(r) for r in roots)
        st = os.stat(real)  # stat never blocks, unlike an open of a FIFO
    except OSError as e:
        raise FlashError(f"{full}: cannot read ({e.strerror or e})") from None
    if not inside:
        c.fail(field, f"= {rel!r} leads outside the pack")
    if not stat.S_ISREG(st.st_mode):
        c.fail(field, f"= {rel!r} is not a regular file")
    if size is not None and st.st_size != size:
        raise FlashError(f"{full}: {st.st_size} bytes, manifest says {size} (truncated or replaced)")
    if min_size is not None and st.st_size < min_size:
        raise FlashError(f"{full}: truncated ({st.st_size} bytes, manifest says {min_size})")
    return full


def check_pack_files(pack_dir, manifest, path) -> None:
    """Every file the manifest names: inside the pack, regular, of the recorded size."""
    res = manifest.get("resident")
    if res is not None:
        check_pack_file(pack_dir, res["file"], "resident.file", path, size=res["length"])
    for i, b in enumerate(manifest["bundles"]):
        check_pack_file(pack_dir, b["file"], f"bundles[{i}].file", path, min_size=b["file_length"])
