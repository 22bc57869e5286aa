"""write_pack: an mlx-lm folder -> a flash pack (format in layout.py)."""

import json
import math
import os
import zlib
from pathlib import Path

import mlx.core as mx
import numpy as np
from tqdm import tqdm

from ..errors import FlashError
from ..model_folder import copy_tokenizer_files, read_config
from ..paths import atomic_dir, load_safetensors, save_safetensors
from .reader import file_crc32
from .schema import write_metadata
from .layout import (COMPONENT_ALIGN, DEFAULT_ALIGNMENT, ENDOR_MIN_ZEROS, ENDOR_VERSION,
                     FORMAT, FORMAT_VERSION, MANIFEST,
                     RESIDENT_FILE, dtype_name, find_ffn, round_up)

FLOAT_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def write_pack(src_dir, out_dir, *, dtype=None, quantize=None, group_size=64, progress=True,
               alignment=DEFAULT_ALIGNMENT, overwrite=False, down_bits=None, encoding="dense",
               expert_bits=None, moe_routing=None, weights=None, expert_quantizer=None,
               gate_bits=None, gate_group_size=32, resident_bits=None, resident_group_size=64,
               resident_modules=None, resident_quantizer=None) -> Path:
    """Convert the mlx-lm folder `src_dir` into a flash pack directory `out_dir`.

    dtype: None or 'float32' / 'float16' / 'bfloat16': cast every float tensor (incl. scales).
    quantize: None, 4 or 8: MLX affine quantization with `group_size` of every linear / embedding
      weight (FFN down is quantized in its transposed, bundled form). Source must be unquantized.
    alignment: bytes; bundle regions and file lengths are multiples of it (direct I/O).
    down_bits: only for an already quantized source, how to store down.T (whose groups must run
      along hidden, across the source's groups): None or 16 (default) = the source's dequantized
      values as floats in the scales' dtype: the source model (float16 rounding of each weight;
      on SmolLM2-135M Q4_1 perplexity 18.80 = the source's, bundles 1.73x the 4-bit size);
      8 or 4 = re-quantized at that many bits, smaller bundles but a different model (lossy:
      +0.12% / +4.5% perplexity there). The manifest's "down" entry names the choice and the
      measured weight error.
    encoding: "dense", or "endor": FFN neuron bundles and pruned resident linears stored as a bitmap
      of their non-zeros plus the non-zeros (layout.py; with `quantize`, only the non-zeros are
      quantized and pruned zeros stay exact). Needs a float source (prune saves float16).
    expert_bits: MoE packs only, {layer: [bits of each expert]} (2, 3, 4, 5, 6 or 8; `group_size`):
      each expert quantized at its own width (layout.py "expert-bits"; moe/bitwidths.py chooses
      them). Needs float experts; the rest follows `quantize`.
    expert_quantizer: with expert_bits, a function (layer, role "gate"/"up"/"down", expert ids,
      float weights [n, out, in], bits, group_size) -> (packed uint32, scales, biases) in MLX's
      affine format (moe/quantize.py); default `mx.quantize`.
    gate_bits: None, or 2, 3, 4 or 8: gated neuron FFNs keep each layer's gate resident, MLX
      affine-quantized at this many bits (`gate_group_size`), instead of in the neuron bundles
      (layout.py "resident_gate"): bundles hold up and down only (2/3 of a float gated bundle) and
      the model computes with the quantized gate, from which `calibrate --kind gate-threshold`
      predicts the active neurons exactly. Float source, no `quantize`, dense encoding only.
    resident_bits: None, 4 or 8: the resident linears (attention projections, embedding / lm_head;
      every resident float matrix whose rows split into `resident_group_size` groups, norms
      excluded) MLX affine-quantized at this many bits, the FFN bundles as they are (float). The
      config's "quantization" names these bits, with the resident gates' own as per-module
      overrides. Float source, no `quantize`, dense encoding only.
    resident_modules: with resident_bits, {name: (bits, group_size)}: the resident linears whose
      module path is `name` or ends with ".name" (e.g. "embed_tokens", "q_proj"; the longest
      matching name wins) at these bits (4 or 8, or 16: kept float) and group size instead;
      the config's "quantization" names each such module's own (layout.py).
    resident_quantizer: with resident_bits, a function (module path, float weight [out, in], bits,
      group_size) -> (packed uint32, scales, biases) in MLX's affine format, for the resident
      linears (not the gates); default `mx.quantize` (calibration/resident_quant.py makes others).
    moe_routing: MoE packs, calibration routing statistics for the runtime's per-layer expert
      slots: {"policy", "sizes": [slots], "hits": {layer: [hits at each size]}, "tokens"}.
    weights: {tensor name: mx.array} to convert instead of `src_dir`'s model*.safetensors (which
      then gives only config.json and the tokenizer files); may be unevaluated: each layer is
      computed as it is written. The dict is consumed (emptied as tensors are written), so the
      memory of a written layer is freed.
    Writes into a temporary directory beside `out_dir`, fsyncs it and renames it (paths.atomic_dir);
    on any failure the temporary directory is removed and FlashError names the file and reason.
    Returns out_dir.
    """
    src, out = Path(src_dir), Path(out_dir)
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise FlashError(f"--dtype {dtype!r}: choose one of {', '.join(FLOAT_DTYPES)}")
    if quantize not in (None, 4, 8):
        raise FlashError(f"--quantize {quantize!r}: choose 4 or 8 bits")
    if down_bits not in (None, 4, 8, 16):
        raise FlashError(f"down_bits {down_bits!r}: choose 4, 8 or 16")
    if encoding not in ("dense", "endor"):
        raise FlashError(f"--encoding {encoding!r}: choose dense or endor")
    if alignment <= 0 or alignment % 512:
        raise FlashError(f"alignment {alignment}: must be a positive multiple of 512 bytes")
    float_pack = not quantize and encoding == "dense" and expert_bits is None
    _check_resident_quantization("--gate", gate_bits, (2, 3, 4, 8), gate_group_size, float_pack)
    _check_resident_quantization("--resident", resident_bits, (4, 8), resident_group_size, float_pack)
    modules = check_resident_modules(resident_modules, resident_bits)
    if out.exists() and not overwrite:
        raise FlashError(f"{out}: already exists (remove it or pass overwrite=True)")
    gate = {"bits": gate_bits, "group_size": gate_group_size} if gate_bits else None
    linears = ({"bits": resident_bits, "group_size": resident_group_size, "modules": modules,
                "quantizer": resident_quantizer} if resident_bits else None)
    with atomic_dir(out, replace=overwrite) as tmp:
        _write(src, tmp, dtype, quantize, group_size, progress, alignment, down_bits, encoding,
               expert_bits, moe_routing, weights, expert_quantizer, gate, linears)
    return out


def _check_resident_quantization(flag: str, bits, choices: tuple, group_size, float_pack: bool):
    """FlashError unless `{flag}-bits` (None: off) is one of `choices`, for a float pack (no
    --quantize / --expert-bits, dense encoding), and `{flag}-group-size` is 32, 64 or 128."""
    if bits is None:
        return
    if bits not in choices or not float_pack:
        names = ", ".join(map(str, choices[:-1])) + f" or {choices[-1]}"
        raise FlashError(f"{flag}-bits {bits!r}: choose {names}, for a float pack (no --quantize, dense encoding)")
    if group_size not in (32, 64, 128):
        raise FlashError(f"{flag}-group-size {group_size!r}: choose 32, 64 or 128")


def check_resident_modules(modules, resident_bits) -> dict:
    """{name: {"bits", "group_size"} or None (kept float)} of write_pack's `resident_modules`;
    FlashError naming --resident-module and the reason when one is not a choice."""
    if not modules:
        return {}
    if not resident_bits:
        raise FlashError("--resident-module: needs --resident-bits (the other resident linears' bits)")
    out = {}
    for name, (bits, size) in modules.items():
        if not name or bits not in (4, 8, 16) or size not in (32, 64, 128):
            raise FlashError(f"--resident-module {name}={bits}:{size}: choose a module name, "
                             "bits 4, 8 or 16 (float) and group size 32, 64 or 128")
        out[name] = None if bits == 16 else {"bits": bits, "group_size": size}
    return out


def _resident_choice(base: str, linears: dict):
    """(bits, group_size) of resident linear `base` (a module path) under `linears`, None: float."""
    names = [n for n in linears["modules"] if base == n or base.endswith("." + n)]
    if not names:
        return linears["bits"], linears["group_size"]
    own = linears["modules"][max(names, key=len)]
    return None if own is None else (own["bits"], own["group_size"])


def _mlx_quantize(_base, w, bits, group_size):
    return mx.quantize(w, group_size=group_size, bits=bits)


def _resident_width(k, v, quantize, group_size, gate_weights, gate, linears):
    """(bits, group_size, quantizer, own config entry) resident tensor `k` is stored at, None: as
    it is: a resident gate (--gate-bits) at the gate's width, else --quantize's, else the resident
    linears' (--resident-bits, or its --resident-module override, by --resident-quantizer; a module
    whose width differs from --resident-bits' needs a config entry of its own).
    quantizer(base, w, bits, group_size) -> (q, scales, biases)."""
    if k in gate_weights:
        return gate["bits"], gate["group_size"], _mlx_quantize, False
    if quantize and _should_quantize(k, v, group_size):
        return quantize, group_size, _mlx_quantize, False
    if linears and _should_quantize(k, v, 32):
        choice = _resident_choice(k[: -len(".weight")], linears)
        if choice is not None and v.shape[-1] % choice[1] == 0:
            own = choice != (linears["bits"], linears["group_size"])
            return choice[0], choice[1], linears["quantizer"] or _mlx_quantize, own
    return None


def _load_source(src: Path, weights=None):
    if (src / MANIFEST).exists():
        raise FlashError(f"{src}: is already a flash pack")
    if not (src / "config.json").is_file():
        raise FlashError(f"{src}: not an mlx-lm model folder (no config.json)")
    config = read_config(src)
    if weights is not None:
        return config, weights, []
    files = sorted(src.glob("model*.safetensors"))
    if not files:
        raise FlashError(f"{src}: no model*.safetensors files")
    weights = {}
    for f in files:
        weights.update(load_safetensors(f))
    return config, weights, files


def _qparams(config, module):
    """(group_size, bits) of a quantized module in the source config."""
    q = config.get("quantization") or config.get("quantization_config")
    if not q:
        raise FlashError(f"config.json: {module} is quantized but the config has no 'quantization'")
    own = q.get(module)
    if isinstance(own, dict):
        return own["group_size"], own["bits"]
    return q["group_size"], q["bits"]


def _should_quantize(name, arr, group_size):
    return (name.endswith(".weight") and arr.ndim >= 2 and "norm" not in name
            and mx.issubdtype(arr.dtype, mx.floating) and arr.shape[-1] % group_size == 0)


def _check_float_source(src, quantized: bool, flags: dict) -> None:
    """FlashError naming the first of `flags` ({flag: its value}) that is set, when the source is
    quantized: these quantize the weights themselves or need their exact values."""
    needs_float = [flag for flag, value in flags.items() if value]
    if quantized and needs_float:
        why = (" (its zeros must be exact; python -m mlx_flash.prune saves float16)"
               if needs_float[0] == "--encoding endor" else "")
        raise FlashError(f"{src}: already quantized; {needs_float[0]} needs a float source{why}")


def _write(src, tmp, dtype, quantize, group_size, progress, alignment, down_bits, encoding="dense",
           expert_bits=None, moe_routing=None, given_weights=None, expert_quantizer=None, gate=None,
           linears=None):
    """gate: {"bits", "group_size"} to keep gated neuron FFNs' gates resident and quantized;
    linears: {"bits", "group_size", "modules", "quantizer"} to quantize the other resident linears."""
    config, weights, files = _load_source(src, given_weights)
    src_quant = config.get("quantization")
    endor = encoding == "endor"
    _check_float_source(src, src_quant or any(k.endswith(".scales") for k in weights),
                        {"--quantize": quantize, "--encoding endor": endor, "--gate-bits": gate,
                         "--resident-bits": linears})
    if dtype is not None:
        target = FLOAT_DTYPES[dtype]
        for k, v in weights.items():  # in place: a caller's weights are freed as they are written
            if mx.issubdtype(v.dtype, mx.floating):
                weights[k] = v.astype(target)
    ffn = find_ffn(weights)
    if not ffn:
        raise FlashError(f"{src}: no FFN tensors recognised (architecture not in pack.layout.FFN_TABLE)")
    if any(info["kind"] == "experts" for info in ffn.values()):
        # MoE pack: only experts stream; dense FFN layers (deepseek's first layers) stay resident.
        ffn = {layer: info for layer, info in ffn.items() if info["kind"] == "experts"}
    if expert_bits is not None:
        _check_expert_bits(src, ffn, weights, expert_bits, group_size, encoding)
    if quantize:
        config["quantization"] = {"group_size": group_size, "bits": quantize}
        config["quantization_config"] = dict(config["quantization"])
    # Resident quantized gates: {layer: gate module}; the model quantizes the modules whose scales
    # the resident file holds (models.build_model), here only these gates.
    resident_gates = {layer: info["modules"]["gate"] for layer, info in ffn.items()
                      if gate and info["kind"] == "neurons" and "gate" in info["modules"]}
    if gate:
        if not resident_gates:
            raise FlashError(f"{src}: --gate-bits: the model's FFNs have no gate")
        config["quantization"] = dict(gate)
    if linears:
        # the resident linears' bits are the default; each resident gate keeps its own
        config["quantization"] = {"bits": linears["bits"], "group_size": linears["group_size"],
                                  **{m: dict(gate) for m in resident_gates.values()}}
    gate_weights = {f"{m}.weight" for m in resident_gates.values()}
    # Tensors that go into bundles; the rest is resident.
    bundled = set()
    for layer, info in ffn.items():
        if layer in resident_gates:
            info = dict(info, modules={r: m for r, m in info["modules"].items() if r != "gate"})
            ffn[layer] = info
        for role, module in info["modules"].items():
            bundled.update(k for k in (f"{module}.{p}" for p in ("weight", "scales", "biases"))
                           if k in weights)
            # A neuron's down bias is per output, not per neuron: it stays resident.
            if (info["kind"] == "experts" or role != "down") and f"{module}.bias" in weights:
                bundled.add(f"{module}.bias")
    resident, resident_endor = {}, {}
    names = [k for k in weights if k not in bundled]
    bar = tqdm(total=sum(weights[k].nbytes for k in names), desc="resident tensors", unit="B",
               unit_scale=True, disable=not progress)
    for k in names:
        v = weights.pop(k)  # only the resident dict (or its encoded form) keeps it
        # Computed (or read) here, tensor by tensor under the bar, not all at once by the save.
        mx.eval(v)
        bar.update(v.nbytes)
        if endor and _endor_worth_it(k, v):
            tensors, resident_endor[k] = _encode_resident(k, v, quantize, group_size)
            resident.update(tensors)
        elif (width := _resident_width(k, v, quantize, group_size, gate_weights, gate, linears)) is not None:
            base = k[: -len(".weight")]
            bits, size, quantizer, own_entry = width
            q, s, b = quantizer(base, v, bits, size)
            resident.update({k: q, f"{base}.scales": s, f"{base}.biases": b})
            if own_entry:
                config["quantization"][base] = {"bits": bits, "group_size": size}
        else:
            resident[k] = v
    bar.close()
    requantized, down_errors = False, []
    bundles = []
    bundle_dir = tmp / "bundles"
    bundle_dir.mkdir()
    for layer, info in tqdm(ffn.items(), desc="flash pack", unit="layer", disable=not progress):
        encode = endor and info["kind"] == "neurons"
        comps, req, err = _components(weights, config, info,
                                      None if encode or expert_bits is not None else quantize,
                                      group_size, down_bits)
        requantized |= req
        if err is not None:
            down_errors.append(err)
        rel = f"bundles/layer_{layer:03d}.bin"
        if expert_bits is not None:
            entry = _write_expert_bits_file(tmp / rel, comps, expert_bits[layer], group_size,
                                            alignment, layer, info, expert_quantizer)
        elif encode:
            entry = _write_endor_bundle_file(tmp / rel, comps, alignment, quantize, group_size)
        else:
            # An expert is one direct-I/O-aligned block: its stride is a multiple of the alignment.
            (entry,) = write_bundle_file(tmp / rel, [comps], alignment,
                                         block_align=alignment if info["kind"] == "experts" else COMPONENT_ALIGN)
            entry["encoding"] = "dense"
        for g in entry.get("groups", ()):
            g["file"] = rel
        bundles.append({"layer": layer, "kind": info["kind"], "arch": info["arch"], "file": rel,
                        **entry})
        if layer in resident_gates:
            bundles[-1]["resident_gate"] = {"source": resident_gates[layer], **gate}
        del comps
        # mx.load maps the source lazily; dropping a written layer's tensors frees their memory,
        # so peak memory is one layer's bundles, not the model (a 17 GB MoE source on 23 GB).
        for module in info["modules"].values():
            for part in ("weight", "scales", "biases", "bias"):
                weights.pop(f"{module}.{part}", None)
    res_path = tmp / RESIDENT_FILE
    save_safetensors(res_path, resident, metadata={"format": "mlx"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    copy_tokenizer_files(src, tmp)
    manifest = {
        "format": FORMAT,
        "format_version": ENDOR_VERSION if endor else FORMAT_VERSION,
        "encoding": encoding,
        "source": {"path": str(src.resolve()),
                   "files": {f.name: f.stat().st_size for f in files}},
        "config": config,
        "alignment": alignment,
        "checksum": "crc32",
        "quantization": config.get("quantization"),
        "down_layout": "transposed",
        "down_requantized": requantized,
        "down_bits": down_bits,
        "down": _down_summary(down_errors, requantized, down_bits),
        "resident": {"file": RESIDENT_FILE, "length": res_path.stat().st_size,
                     "crc32": file_crc32(res_path),
                     "tensors": {k: {"dtype": dtype_name(v.dtype), "shape": list(v.shape)}
                                 for k, v in sorted(resident.items())},
                     "endor": resident_endor,
                     "memory_length": res_path.stat().st_size + sum(
                         _decoded_extra(resident, k, e) for k, e in resident_endor.items())},
        "bundles": bundles,
    }
    if moe_routing is not None:
        manifest["moe_routing"] = {**moe_routing, "hits": {str(k): [int(h) for h in v]
                                                           for k, v in moe_routing["hits"].items()}}
    write_manifest(tmp, manifest)


def _check_expert_bits(src, ffn, weights, expert_bits, group_size, encoding):
    """FlashError unless `expert_bits` gives a known width to every expert of every MoE layer of
    a float source."""
    from .schema import QUANT_BITS

    if encoding != "dense" or any(info["kind"] != "experts" for info in ffn.values()):
        raise FlashError(f"{src}: --expert-bits needs an MoE model (dense encoding)")
    for layer, info in ffn.items():
        w = weights[f"{info['modules']['up']}.weight"]
        widths = expert_bits.get(layer) if isinstance(expert_bits, dict) else None
        if widths is None or len(widths) != w.shape[0]:
            raise FlashError(f"--expert-bits: layer {layer} needs a width for each of its "
                             f"{w.shape[0]} experts")
        bad = sorted({int(b) for b in widths} - set(QUANT_BITS))
        if bad:
            raise FlashError(f"--expert-bits: {bad[0]} bits is not one of {QUANT_BITS}")
        if f"{info['modules']['up']}.scales" in weights or not mx.issubdtype(w.dtype, mx.floating):
            raise FlashError(f"{src}: --expert-bits needs float experts (the source is quantized)")
        if any(weights[f"{m}.weight"].shape[-1] % group_size for m in info["modules"].values()):
            raise FlashError(f"--group-size {group_size}: must divide every expert input width")


def _write_expert_bits_file(path, comps, widths, group_size, alignment, layer, info,
                            quantizer=None) -> dict:
    """One MoE layer file of width groups (layout.py "expert-bits"): the float expert
    components `comps` quantized (by `quantizer`, see write_pack) per group of experts sharing a
    width, each group a region of direct-I/O-aligned blocks."""
    widths = np.asarray([int(b) for b in widths])
    regions, members = [], []
    for bits in sorted(set(widths.tolist())):
        ids = np.flatnonzero(widths == bits)
        idx = mx.array(ids)
        region = []
        for name, source, arr, _ in comps:
            sub = arr[idx]
            if name.endswith(".weight"):
                role = name.split(".")[0]
                if quantizer is None:
                    q, s, b = mx.quantize(sub, group_size=group_size, bits=int(bits))
                else:
                    q, s, b = quantizer(layer, role, ids, sub, int(bits), group_size)
                region += [(name, source, q, {"group_size": group_size, "bits": int(bits)}),
                           (f"{role}.scales", source[: -len("weight")] + "scales", s, None),
                           (f"{role}.biases", source[: -len("weight")] + "biases", b, None)]
            else:
                region.append((name, source, sub, None))
        regions.append(region)
        members.append((int(bits), ids.tolist()))
    records = write_bundle_file(path, regions, alignment, block_align=alignment)
    groups = [{"layer": layer, "kind": "experts", "arch": info["arch"], "file": None,
               "encoding": "dense", "bits": bits, "experts": ids, **r}
              for (bits, ids), r in zip(members, records)]
    return {"encoding": "expert-bits", "count": int(len(widths)),
            "expert_bits": widths.tolist(), "groups": groups,
            "file_length": records[0]["file_length"]}


def _down_summary(errors, requantized, down_bits) -> dict | None:
    """How the down projection of a quantized source was stored and how far it is from the source's
    weights: max |stored - source| and sqrt(sum diff^2 / sum source^2), over every layer."""
    if not errors:
        return None
    num, den = sum(e[1] for e in errors), sum(e[2] for e in errors)
    return {"storage": f"{down_bits}-bit re-quantized (lossy)" if requantized else
            "float values of the source's quantized weights (exact up to float rounding)",
            "lossy": requantized, "max_abs_error": max(e[0] for e in errors),
            "relative_rms_error": math.sqrt(num / den) if den else 0.0}


def _weight_error(stored, source_t) -> tuple:
    """(max |stored - source|, sum diff^2, sum source^2) in float32 (both [n, hidden])."""
    d = stored.astype(mx.float32) - source_t
    return (mx.abs(d).max().item(), mx.sum(d * d).item(), mx.sum(source_t * source_t).item())


def _components(weights, config, info, quantize, group_size, down_bits=None):
    """([(component name, source tensor name, array [count, ...row], quantization|None)],
    requantized, down error (see _weight_error) or None when down was not converted)."""
    modules, kind = info["modules"], info["kind"]
    comps, requantized, down_error = [], False, None

    def add_matrix(role, module, w, s=None, b=None, q=None, source=None):
        source = source or f"{module}.weight"
        comps.append((f"{role}.weight", source, w, q))
        if s is not None:
            comps.append((f"{role}.scales", f"{module}.scales", s, None))
            comps.append((f"{role}.biases", f"{module}.biases", b, None))

    for role in ("gate", "up", "down"):
        if role not in modules:
            continue
        module = modules[role]
        w = weights[f"{module}.weight"]
        if kind == "neurons" and role == "down":
            role = "down_t"
            if f"{module}.scales" in weights:
                g, bits = _qparams(config, module)
                scales, biases = weights[f"{module}.scales"], weights[f"{module}.biases"]
                full = mx.dequantize(w, scales, biases, group_size=g, bits=bits)
                exact_t = mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32),
                                        group_size=g, bits=bits).T
                if down_bits in (None, 16):  # the source's values, as floats
                    stored = mx.contiguous(full.T)
                    add_matrix(role, module, stored)
                    down_error = _weight_error(stored, exact_t)
                    continue
                q, s, b = mx.quantize(mx.contiguous(full.T), group_size=g, bits=down_bits)
                add_matrix(role, module, q, s, b, {"group_size": g, "bits": down_bits})
                down_error = _weight_error(mx.dequantize(q, s, b, group_size=g, bits=down_bits), exact_t)
                requantized = True
                continue
            w = mx.contiguous(w.T)
        if f"{module}.scales" in weights:
            g, bits = _qparams(config, module)
            add_matrix(role, module, w, weights[f"{module}.scales"], weights[f"{module}.biases"],
                       {"group_size": g, "bits": bits})
        elif quantize and w.shape[-1] % group_size == 0:
            q, s, b = mx.quantize(w, group_size=group_size, bits=quantize)
            add_matrix(role, module, q, s, b, {"group_size": group_size, "bits": quantize},
                       source=f"{module}.weight")
        else:
            add_matrix(role, module, w)
    for role in ("gate", "up") if kind == "neurons" else ("gate", "up", "down"):
        module = modules.get(role)
        if module and f"{module}.bias" in weights:
            comps.append((f"{role}.bias", f"{module}.bias", weights[f"{module}.bias"], None))
    counts = {c[2].shape[0] for c in comps}
    if len(counts) != 1:
        raise FlashError(f"{modules['up']}: FFN tensors disagree on the neuron count {sorted(counts)}")
    return comps, requantized, down_error


def _row_bytes(arr) -> np.ndarray:
    """uint8 [count, row bytes] view of an MLX array's rows (works for bfloat16 too)."""
    arr = mx.contiguous(arr.reshape(arr.shape[0], -1))
    return np.array(arr.view(mx.uint8), copy=False)


def write_bundle_file(path: Path, regions, alignment: int, block_align=COMPONENT_ALIGN) -> list:
    """Write bundle regions into a new file at `path` and fsync it; one bundle record per region.

    regions: [[(component name, source tensor name, array [count, ...row], quantization|None)]]:
    each region's bundles hold its components row by row (each component at a multiple of
    COMPONENT_ALIGN bytes inside the bundle; a bundle's stride is a multiple of `block_align`),
    then its crc32 table; regions and tables start at multiples of `alignment` bytes. A record has offset, count, stride, length, file_length,
    components and checksums (the manifest's bundle fields without layer / kind / file).
    """
    records, pieces, pos = [], [], 0
    for comps in regions:
        count = comps[0][2].shape[0]
        layout, comp_pos, rows = [], 0, []
        for name, source, arr, q in comps:
            mx.eval(arr)
            r = _row_bytes(arr)
            entry = {"name": name, "source": source, "dtype": dtype_name(arr.dtype),
                     "shape": list(arr.shape[1:]), "offset": comp_pos, "length": r.shape[1]}
            if q:
                entry["quantization"] = q
            layout.append(entry)
            rows.append(r)
            comp_pos = round_up(comp_pos + r.shape[1], COMPONENT_ALIGN)
        stride = round_up(comp_pos, block_align)
        data = np.zeros((count, stride), np.uint8)
        for c, r in zip(layout, rows):
            data[:, c["offset"]: c["offset"] + c["length"]] = r
        crcs = np.empty(count, "<u4")
        for i in range(count):
            crc = 0
            for c in layout:
                crc = zlib.crc32(data[i, c["offset"]: c["offset"] + c["length"]], crc)
            crcs[i] = crc
        length = count * stride
        table_offset = round_up(pos + length, alignment)
        pieces += [(pos, data), (table_offset, crcs)]
        records.append({"offset": pos, "count": count, "stride": stride, "length": length,
                        "components": layout,
                        "checksums": {"offset": table_offset, "length": int(crcs.nbytes),
                                      "crc32": zlib.crc32(crcs.tobytes())}})
        pos = round_up(table_offset + crcs.nbytes, alignment)
    _write_bytes(path, pieces, pos)
    return [{**r, "file_length": pos} for r in records]


def write_manifest(pack_dir, manifest: dict) -> Path:
    """Write `manifest` as the pack's manifest.json with its metadata checksum (temporary file,
    fsync, rename, fsync of the folder)."""
    path = Path(pack_dir) / MANIFEST
    write_metadata(path, manifest)
    return path


def _write_bytes(path: Path, pieces, file_length):
    """Write (offset, array) pieces into a new file of `file_length` bytes and fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for offset, arr in pieces:
            view = memoryview(np.ascontiguousarray(arr)).cast("B")
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], offset + done)
        os.ftruncate(fd, file_length)
        os.fsync(fd)
    except OSError as e:
        e.filename = e.filename or str(path)
        raise
    finally:
        os.close(fd)


def _decoded_extra(resident, name, spec) -> int:
    """Bytes a decoded ENDOR resident matrix takes in memory beyond its stored pieces."""
    rows, cols = spec["shape"]
    stored = sum(v.nbytes for k, v in resident.items() if k.startswith(f"{name}.endor_"))
    return rows * cols * (2 if spec["dtype"] != "float32" else 4) - stored


def _endor_worth_it(name, arr) -> bool:
    """A resident linear weight with enough exact zeros that a bitmap pays for itself."""
    if not (name.endswith(".weight") and arr.ndim == 2 and mx.issubdtype(arr.dtype, mx.floating)):
        return False
    if any(s in name for s in ("norm", "embed", "lm_head", "wte", "wpe")):
        return False
    return mx.mean(arr == 0).item() >= ENDOR_MIN_ZEROS


def _host_rows(arr) -> np.ndarray:
    """numpy [rows, cols] of a float MLX matrix (bfloat16 as its uint16 bits)."""
    arr = mx.contiguous(arr.reshape(arr.shape[0], -1))
    if arr.dtype == mx.bfloat16:
        return np.array(arr.view(mx.uint16))
    return np.array(arr)


def _endor_payload(dtype, quantize, group_size) -> dict:
    return {"bits": quantize, "group_size": group_size} if quantize else {"dtype": dtype}


def _encode_resident(name, arr, quantize, group_size):
    """({tensor name: mx.array}, manifest entry) of a resident matrix stored as ENDOR: a bitmap
    [rows, ceil(cols / 8)] and its non-zeros in row order (quantized in groups when asked)."""
    from .bitmap import pack_codes, quantize_values

    rows = _host_rows(arr)
    mask = (rows & 0x7FFF) != 0 if rows.dtype == np.uint16 else rows != 0
    bitmap = np.packbits(mask, axis=1, bitorder="little")
    values = rows[mask]
    dtype = dtype_name(arr.dtype)
    out = {f"{name}.endor_bitmap": mx.array(bitmap)}
    if quantize:
        if rows.dtype == np.uint16:
            values = (values.astype(np.uint32) << 16).view(np.float32)
        codes, scales, biases = quantize_values(values, quantize, group_size)
        out.update({f"{name}.endor_codes": mx.array(pack_codes(codes, quantize)),
                    f"{name}.endor_scales": mx.array(scales), f"{name}.endor_biases": mx.array(biases)})
        dtype = "float16"
    else:
        v = mx.array(values)
        out[f"{name}.endor_values"] = v.view(mx.bfloat16) if arr.dtype == mx.bfloat16 else v
    return out, {"shape": list(arr.shape), "dtype": dtype, "nnz": int(mask.sum()),
                 "payload": _endor_payload(dtype_name(arr.dtype), quantize, group_size)}


def _endor_pieces(host: np.ndarray, payload):
    """(bytes [count] of each bundle's piece of this component, fill(data, starts)) where fill
    copies piece i to data[starts[i]:] (data zeroed: the padding is left as is). The bytes are
    bitmap.encode_row's, row by row: raw rows (payload None, e.g. a bias) zero-padded to 4 bytes;
    float payloads encoded for the whole matrix at once (one mask, one packbits, one gather of
    the non-zeros), quantized ones row by row."""
    from .bitmap import encode_row, pad4

    count = host.shape[0]
    if payload is None:
        row_bytes = host.shape[1]

        def fill(data, starts):
            for i, start in enumerate(starts):
                data[start: start + row_bytes] = host[i]
        return np.full(count, pad4(row_bytes), np.int64), fill
    if payload.get("bits") is not None:
        blocks = [encode_row(row, payload) for row in host]

        def fill(data, starts):
            for block, start in zip(blocks, starts):
                data[start: start + len(block)] = block
        return np.array([len(b) for b in blocks], np.int64), fill
    mask = (host & 0x7FFF) != 0 if host.dtype == np.uint16 else host != 0  # bfloat16: +-0 bits
    bitmaps = np.packbits(mask, axis=1, bitorder="little")
    values = np.ascontiguousarray(host[mask]).view(np.uint8)  # every row's non-zeros, in order
    value_bytes = mask.sum(axis=1, dtype=np.int64) * host.dtype.itemsize
    value_ends = np.cumsum(value_bytes).tolist()
    bitmap_bytes = pad4(bitmaps.shape[1])

    def fill(data, starts):
        end = 0
        for i, start in enumerate(starts):
            data[start: start + bitmaps.shape[1]] = bitmaps[i]
            begin, end = end, value_ends[i]
            data[start + bitmap_bytes: start + bitmap_bytes + end - begin] = values[begin:end]
    return bitmap_bytes + (value_bytes + 3) // 4 * 4, fill


def _write_endor_bundle_file(path: Path, comps, alignment, quantize, group_size):
    """A layer file of variable-length ENDOR neuron bundles (layout.py): bundles packed back to
    back, then the bundle index (uint64 [count + 1] file offsets) and the crc32 table."""
    count = comps[0][2].shape[0]
    layout, sources = [], []
    for name, source, arr, q in comps:
        mx.eval(arr)
        if q:
            raise FlashError(f"{source}: quantized tensor in an ENDOR bundle (convert a float source)")
        host = _host_rows(arr) if name.endswith(".weight") else _row_bytes(arr)
        entry = {"name": name, "source": source, "shape": list(arr.shape[1:]), "offset": 0}
        if name.endswith(".weight"):
            payload = _endor_payload(dtype_name(arr.dtype), quantize, group_size)
            entry.update(dtype="float16" if quantize else dtype_name(arr.dtype), endor=payload)
            entry["length"] = host.shape[1] * (2 if quantize else arr.dtype.size)
        else:
            payload = None
            entry.update(dtype=dtype_name(arr.dtype), length=host.shape[1])
        layout.append(entry)
        sources.append((host, payload))
    pieces = [_endor_pieces(host, payload) for host, payload in sources]
    piece_lengths = np.stack([lengths for lengths, _ in pieces])  # [component, bundle]
    index = np.zeros(count + 1, "<u8")
    index[1:] = np.cumsum(piece_lengths.sum(axis=0))
    length = int(index[-1])
    data = np.zeros(length, np.uint8)  # the zeros are the pieces' padding
    starts = index[:-1].astype(np.int64)
    for (lengths, fill), before in zip(pieces, np.cumsum(piece_lengths, axis=0) - piece_lengths):
        fill(data, (starts + before).tolist())
    crcs = np.array([zlib.crc32(data[a:b]) for a, b in zip(index[:-1].tolist(), index[1:].tolist())],
                    "<u4")
    index_offset = round_up(length, alignment)
    table_offset = round_up(index_offset + index.nbytes, alignment)
    file_length = round_up(table_offset + crcs.nbytes, alignment)
    _write_bytes(path, [(0, data), (index_offset, index), (table_offset, crcs)], file_length)
    return {"encoding": "endor", "offset": 0, "count": count, "stride": -(-length // count),
            "length": length, "file_length": file_length, "components": layout,
            "index": {"offset": index_offset, "length": int(index.nbytes),
                      "crc32": zlib.crc32(index.tobytes())},
            "checksums": {"offset": table_offset, "length": int(crcs.nbytes),
                          "crc32": zlib.crc32(crcs.tobytes())}}
