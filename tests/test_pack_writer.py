"""pack/writer.py: round trips, dense equivalence with mlx-lm, failure handling."""

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_flash.errors import FlashError
from mlx_flash.pack import (load_pack_weights, load_resident, read_layer_components,
                            read_manifest, write_pack)
from mlx_flash.pack import Bundle
from mlx_flash.pack import writer as pack_writer

SOURCES = [("float32", None), ("float16", None), ("bfloat16", None),
           ("float32", (4, 32)), ("float16", (4, 32)), ("bfloat16", (8, 64))]


def source_weights(folder):
    out = {}
    for f in sorted(Path(folder).glob("model*.safetensors")):
        out.update(mx.load(str(f)))
    return out


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and mx.array_equal(a, b).item()


def build_model(config, weights):
    """An mlx-lm model from a config and weights dict (quantized where `.scales` exist)."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    if q := config.get("quantization"):
        def predicate(p, m):  # per-module overrides as mlx-lm reads them
            if not hasattr(m, "to_quantized") or f"{p}.scales" not in weights:
                return False
            return q[p] if isinstance(q.get(p), dict) else True

        nn.quantize(model, group_size=q["group_size"], bits=q["bits"], class_predicate=predicate)
    model.load_weights(list(weights.items()))
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("dtype,quant", SOURCES)
def test_round_trip_every_tensor_and_bundle(tiny_llama, tmp_path, dtype, quant):
    src = tiny_llama("src", dtype=dtype, quantize=quant, intermediate=128)
    pack = write_pack(src, tmp_path / "pack", progress=False)
    weights = source_weights(src)
    manifest = read_manifest(pack)
    assert manifest["down_requantized"] is False  # the default pack is the source model
    _, resident = load_resident(pack)
    for name, arr in resident.items():
        assert same(arr, weights[name]), name
    ffn_names = set()
    for entry in manifest["bundles"]:
        assert entry["offset"] % 4096 == 0 and entry["file_length"] % 4096 == 0
        assert entry["checksums"]["offset"] % 4096 == 0 and entry["encoding"] == "dense"
        comps = read_layer_components(pack, entry)
        prefix = f"model.layers.{entry['layer']}.mlp."
        for role in ("gate", "up"):
            for part in ("weight", "scales", "biases") if quant else ("weight",):
                name = f"{prefix}{role}_proj.{part}"
                assert same(comps[f"{role}.{part}"], weights[name]), name
                ffn_names.add(name)
        down = f"{prefix}down_proj"
        ffn_names.update(k for k in weights if k.startswith(down))
        if quant is None:
            assert same(comps["down_t.weight"], weights[f"{down}.weight"].T)
        else:
            bits, group = quant
            full = mx.dequantize(weights[f"{down}.weight"], weights[f"{down}.scales"],
                                 weights[f"{down}.biases"], group_size=group, bits=bits)
            assert same(comps["down_t.weight"], mx.contiguous(full.T))
            assert "down_t.scales" not in comps
    assert set(resident) | ffn_names == set(weights)
    assert not set(resident) & ffn_names


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_dense_logits_bit_identical_for_float_sources(tiny_llama, tmp_path, dtype):
    from mlx_lm.utils import load_model

    src = tiny_llama("src", dtype=dtype, tie=False)
    pack = write_pack(src, tmp_path / "pack", progress=False)
    config, weights = load_pack_weights(pack)
    source = source_weights(src)
    assert set(weights) == set(source)
    assert all(same(weights[k], source[k]) for k in source)
    ref, _ = load_model(src)
    ours = build_model(config, weights)
    tokens = mx.array([[1, 5, 9, 33, 2, 77, 100, 3]])
    assert mx.array_equal(ref(tokens), ours(tokens)).item()


@pytest.mark.parametrize("down_bits", [4, 8, 16, None])
def test_down_bits_for_quantized_sources(tiny_llama, tmp_path, down_bits):
    src = tiny_llama("src", dtype="float16", quantize=(4, 32))
    pack = write_pack(src, tmp_path / "pack", down_bits=down_bits, progress=False)
    _, weights = load_pack_weights(pack)
    source = source_weights(src)
    manifest = read_manifest(pack)
    lossy = down_bits in (4, 8)
    assert manifest["down_requantized"] == lossy and manifest["down"]["lossy"] == lossy
    # the measured weight error: float16 rounding of d*q+m (< 2^-11 relative) or re-quantization
    assert (manifest["down"]["relative_rms_error"] > 0.02) == (down_bits == 4)
    assert manifest["down"]["relative_rms_error"] < (1e-3 if not lossy else 0.2)
    for layer in range(2):
        k = f"model.layers.{layer}.mlp.down_proj"
        full = mx.dequantize(source[f"{k}.weight"], source[f"{k}.scales"], source[f"{k}.biases"],
                             group_size=32, bits=4)
        if not lossy:
            assert same(weights[f"{k}.weight"], full)  # the source's values
        else:
            err = mx.abs(weights[f"{k}.weight"] - full).max() / mx.abs(full).max()
            assert err.item() < (0.01 if down_bits == 8 else 0.2)
            comp = manifest["bundles"][layer]["components"]
            assert [c["quantization"]["bits"] for c in comp if c["name"] == "down_t.weight"] == [down_bits]


def test_default_pack_of_a_quantized_source_is_the_source_model(tiny_llama, tmp_path):
    """Dense logits of the default pack equal the source model's up to float16 rounding of the
    down weights (re-quantizing down along the other axis, the old default, moved them ~10x more)."""
    from mlx_lm.utils import load_model

    src = tiny_llama("src", dtype="float16", quantize=(4, 32), layers=4, intermediate=128)
    ref, _ = load_model(src)
    tokens = mx.array([[1, 5, 9, 33, 2, 77, 100, 3]])
    want = ref(tokens).astype(mx.float32)
    errors = {}
    for down_bits in (None, 4):
        config, weights = load_pack_weights(write_pack(src, tmp_path / f"p{down_bits}", progress=False,
                                                       down_bits=down_bits))
        got = build_model(config, weights)(tokens).astype(mx.float32)
        errors[down_bits] = (mx.abs(got - want).max() / mx.abs(want).max()).item()
    assert errors[None] <= 4 * 2.0 ** -10  # a few float16 ulp of the largest logit
    assert errors[4] > 5 * errors[None]


def test_quantized_dense_path_equals_sparse_semantics(tiny_llama, tmp_path):
    # float32 so that quantized_matmul(transpose=False) and h @ dequantize agree bit for bit
    src = tiny_llama("src", dtype="float32", quantize=(4, 32))
    pack = write_pack(src, tmp_path / "pack", progress=False, down_bits=4)
    config, weights = load_pack_weights(pack)
    model = build_model(config, weights)
    manifest = read_manifest(pack)
    x = mx.random.normal((3, config["hidden_size"]), key=mx.random.key(1))
    for entry in manifest["bundles"]:
        c = read_layer_components(pack, entry)
        q = {"group_size": 32, "bits": 4}

        def qmm(h, role, transpose):
            return mx.quantized_matmul(h, c[f"{role}.weight"], c[f"{role}.scales"],
                                       c[f"{role}.biases"], transpose=transpose, **q)

        h = nn.silu(qmm(x, "gate", True)) * qmm(x, "up", True)
        sparse = qmm(h, "down_t", False)
        dense = model.model.layers[entry["layer"]].mlp(x)
        assert mx.array_equal(sparse, dense).item()


@pytest.mark.parametrize("dtype,quantize", [("float16", None), ("bfloat16", 4), (None, 8)])
def test_write_pack_casts_and_quantizes(tiny_llama, tmp_path, dtype, quantize):
    src = tiny_llama("src", dtype="float32", intermediate=64)
    pack = write_pack(src, tmp_path / "pack", dtype=dtype, quantize=quantize, group_size=32,
                      progress=False)
    config, weights = load_pack_weights(pack)
    manifest = read_manifest(pack)
    assert manifest["down_requantized"] is False
    if quantize:
        assert config["quantization"] == {"group_size": 32, "bits": quantize}
        assert "model.layers.0.mlp.up_proj.scales" in weights
        assert "model.layers.0.self_attn.q_proj.scales" in weights
        assert json.loads((pack / "config.json").read_text())["quantization"]["bits"] == quantize
    want = getattr(mx, dtype or "float32")
    assert weights["model.norm.weight"].dtype == want
    source = source_weights(src)
    ids = (mx.arange(192) % 128).reshape(64, 3)  # 64 three-token prompts: the error RMS varies little
    logits = build_model(config, weights)(ids).astype(mx.float32)
    ref = build_model(json.loads((src / "config.json").read_text()), source)(ids)
    # lossy only through the requested cast / quantization: RMS error relative to the logits' RMS
    rel = (mx.sqrt(mx.mean((logits - ref) ** 2)) / mx.sqrt(mx.mean(ref ** 2))).item()
    # measured over 6 source seeds: float16 0.00088-0.00093, 8-bit 0.0099-0.0105, 4-bit 0.170-0.183
    assert rel < {None: 1.5e-3, 8: 0.015, 4: 0.25}[quantize]


def test_non_gated_with_biases_and_moe_experts(tmp_path):
    rng = np.random.default_rng(0)
    hidden, inter, experts = 32, 48, 4
    w = {"model.decoder.embed_tokens.weight": rng.standard_normal((64, hidden)),
         "model.decoder.final_layer_norm.weight": rng.standard_normal(hidden)}
    for i in range(2):
        p = f"model.decoder.layers.{i}."
        w[p + "fc1.weight"] = rng.standard_normal((inter, hidden))
        w[p + "fc1.bias"] = rng.standard_normal(inter)
        w[p + "fc2.weight"] = rng.standard_normal((hidden, inter))
        w[p + "fc2.bias"] = rng.standard_normal(hidden)
        w[p + "self_attn.q_proj.weight"] = rng.standard_normal((hidden, hidden))
    moe = {"model.layers.0.mlp.gate.weight": rng.standard_normal((experts, hidden)),
           "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((hidden, hidden))}
    for role, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
        moe[f"model.layers.0.mlp.switch_mlp.{role}_proj.weight"] = rng.standard_normal((experts, *shape))
    for name, tensors, cfg in (("opt", w, {"model_type": "opt"}),
                               ("moe", moe, {"model_type": "qwen2_moe"})):
        src = tmp_path / name
        src.mkdir()
        arrays = {k: mx.array(v.astype(np.float16)) for k, v in tensors.items()}
        mx.save_safetensors(str(src / "model.safetensors"), arrays)
        (src / "config.json").write_text(json.dumps(cfg))
        pack = write_pack(src, tmp_path / f"{name}.pack", progress=False)
        _, back = load_pack_weights(pack)
        assert set(back) == set(arrays)
        assert all(same(back[k], arrays[k]) for k in arrays)
        manifest = read_manifest(pack)
        kinds = {b["kind"] for b in manifest["bundles"]}
        if name == "opt":
            assert kinds == {"neurons"} and len(manifest["bundles"]) == 2
            names = [c["name"] for c in manifest["bundles"][0]["components"]]
            assert names == ["up.weight", "down_t.weight", "up.bias"]
            assert "model.decoder.layers.0.fc2.bias" in manifest["resident"]["tensors"]
        else:
            assert kinds == {"experts"} and manifest["bundles"][0]["count"] == experts
            assert "model.layers.0.mlp.gate.weight" in manifest["resident"]["tensors"]


def test_tokenizer_files_are_copied(tiny_llama, tmp_path):
    src = tiny_llama("src")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "chat_template.jinja", "generation_config.json"):
        (src / f).write_text("{}")
    pack = write_pack(src, tmp_path / "pack", progress=False)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "chat_template.jinja", "generation_config.json", "config.json", "manifest.json"):
        assert (pack / f).is_file(), f


def leftovers(parent: Path, name: str):
    return [p.name for p in parent.iterdir() if p.name == name or p.name.startswith(f".{name}.tmp")]


def test_failure_midway_leaves_nothing(tiny_llama, tmp_path, monkeypatch):
    src = tiny_llama("src", layers=3)
    real, calls = pack_writer._write_bytes, []

    def disk_full(path, pieces, length):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device", str(path))
        return real(path, pieces, length)

    monkeypatch.setattr(pack_writer, "_write_bytes", disk_full)
    with pytest.raises(FlashError, match="No space left on device"):
        write_pack(src, tmp_path / "out" / "pack", progress=False)
    assert leftovers(tmp_path / "out", "pack") == []


def test_bad_source_leaves_nothing(tmp_path):
    (tmp_path / "src").mkdir()
    with pytest.raises(FlashError, match="no config.json"):
        write_pack(tmp_path / "src", tmp_path / "pack", progress=False)
    (tmp_path / "src" / "config.json").write_text("{}")
    (tmp_path / "src" / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(FlashError, match=r"model\.safetensors: unreadable safetensors"):
        write_pack(tmp_path / "src", tmp_path / "pack", progress=False)
    assert leftovers(tmp_path, "pack") == []


def test_refuses_existing_output_and_double_quantization(tiny_llama, tmp_path):
    src = tiny_llama("src", quantize=(4, 32))
    with pytest.raises(FlashError, match="already quantized"):
        write_pack(src, tmp_path / "pack", quantize=4, progress=False)
    (tmp_path / "pack").mkdir()
    with pytest.raises(FlashError, match="already exists"):
        write_pack(src, tmp_path / "pack", progress=False)


@pytest.mark.parametrize("text, reason", [("{", "not JSON"), ("[1, 2]", "not a JSON object")])
def test_a_bad_config_is_one_error_naming_the_file(tiny_llama, tmp_path, text, reason):
    # the source's config.json goes through the one JSON-file reader: no traceback for an array
    src = tiny_llama("src")
    (src / "config.json").write_text(text)
    with pytest.raises(FlashError, match=rf"config\.json: {reason}"):
        write_pack(src, tmp_path / "pack", progress=False)
    assert not (tmp_path / "pack").exists()


def test_interrupt_midway_leaves_nothing(tiny_llama, tmp_path, monkeypatch):
    # Ctrl-C while the second bundle file is written: no pack, no temporary directory
    src = tiny_llama("src", layers=3)
    real, calls = pack_writer._write_bytes, []

    def interrupted(path, pieces, length):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(path, pieces, length)

    monkeypatch.setattr(pack_writer, "_write_bytes", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_pack(src, tmp_path / "pack", progress=False)
    assert len(calls) == 2 and leftovers(tmp_path, "pack") == []


def test_bundle_file_regions_read_back_as_written(tmp_path):
    # write_bundle_file: several regions in one file (bench io's matrix-major copy), each readable
    # by the pack reader from its own record
    up = mx.random.normal((6, 40)).astype(mx.float16)
    wq, sc, bi = mx.quantize(mx.random.normal((6, 64)), group_size=32, bits=4)
    regions = [[("up.weight", "m.up.weight", up, None)],
               [("down_t.weight", "m.down.weight", wq, {"group_size": 32, "bits": 4}),
                ("down_t.scales", "m.down.scales", sc, None), ("down_t.biases", "m.down.biases", bi, None)]]
    (tmp_path / "bundles").mkdir()
    records = pack_writer.write_bundle_file(tmp_path / "bundles" / "x.bin", regions, 4096)
    assert [r["offset"] % 4096 for r in records] == [0, 0] and records[1]["offset"] > 0
    size = (tmp_path / "bundles" / "x.bin").stat().st_size
    assert size == records[0]["file_length"] == records[1]["file_length"]
    for record, comps in zip(records, regions):
        got = read_layer_components(tmp_path, Bundle.from_dict({"layer": 0, "kind": "neurons",
                                                                "file": "bundles/x.bin", **record}))
        for name, _, arr, _ in comps:
            assert same(got[name], arr), name


# ---- ENDOR encoding (bitmap + non-zeros) --------------------------------------------------------

def endor_source(tiny_llama, tmp_path, dtype="float16"):
    from test_calibration_prune import pruned_model

    return pruned_model(tiny_llama, tmp_path, f"pruned-{dtype}", dtype=dtype, intermediate=96)[0]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_endor_pack_holds_the_dense_packs_weights_exactly(tiny_llama, tmp_path, dtype):
    src = endor_source(tiny_llama, tmp_path, dtype)
    dense = write_pack(src, tmp_path / "dense", dtype=dtype, progress=False)
    endor = write_pack(src, tmp_path / "endor", dtype=dtype, progress=False, encoding="endor")
    md, me = read_manifest(dense), read_manifest(endor)
    assert md["format_version"] == 1 and me["format_version"] == 2 and me["encoding"] == "endor"
    assert all(b["encoding"] == "endor" and "index" in b for b in me["bundles"])
    assert len(me["resident"]["endor"]) == 8  # q, k, v, o of both layers
    assert me["resident"]["length"] < 0.9 * md["resident"]["length"]  # budgets count decoded bytes:
    assert me["resident"]["memory_length"] == pytest.approx(md["resident"]["length"], rel=0.02)
    ratio = sum(b["length"] for b in me["bundles"]) / sum(b["length"] for b in md["bundles"])
    assert ratio < (0.57 if dtype != "float32" else 0.54)
    _, wd = load_pack_weights(dense)
    _, we = load_pack_weights(endor)
    assert set(wd) == set(we)
    for k in wd:
        assert same(wd[k], we[k]), k


@pytest.mark.parametrize("bits", [8, 4])
def test_endor_quantized_keeps_pruned_zeros_exact(tiny_llama, tmp_path, bits):
    src = endor_source(tiny_llama, tmp_path)
    endor = write_pack(src, tmp_path / "endor", quantize=bits, progress=False, encoding="endor")
    _, w = load_pack_weights(endor)
    ref = source_weights(src)
    for k in ("model.layers.1.mlp.down_proj.weight", "model.layers.0.mlp.gate_proj.weight",
              "model.layers.0.self_attn.q_proj.weight"):
        assert w[k].dtype == mx.float16 and mx.array_equal(w[k] == 0, ref[k] == 0).item(), k
        err = mx.abs(w[k].astype(mx.float32) - ref[k].astype(mx.float32)).max().item()
        assert err < (0.02 if bits == 8 else 0.3) * mx.abs(ref[k]).max().item(), k


@pytest.mark.parametrize("flag, kwargs", [("--quantize", {"quantize": 4}),
                                           ("--encoding endor", {"encoding": "endor"}),
                                           ("--gate-bits", {"gate_bits": 4}),
                                           ("--resident-bits", {"resident_bits": 8})])
def test_every_flag_that_needs_floats_refuses_a_quantized_source_alike(tiny_llama, tmp_path, flag, kwargs):
    src = tiny_llama("q", quantize=(4, 32))
    with pytest.raises(FlashError) as e:
        write_pack(src, tmp_path / "p", progress=False, **kwargs)
    assert str(e.value).startswith(f"{src}: already quantized; {flag} needs a float source")
    assert leftovers(tmp_path, "p") == []


@pytest.mark.parametrize("payload", [{"dtype": "float16"}, {"dtype": "bfloat16"},
                                     {"dtype": "float32"}, {"bits": 4, "group_size": 32}])
def test_endor_bundle_file_is_every_row_encoded_in_turn(tmp_path, payload):
    """The whole-matrix ENDOR encoder writes, bundle by bundle, exactly bitmap.encode_row's
    blocks of each component (biases raw, padded to 4 bytes), with their index and crc32s."""
    import zlib

    from mlx_flash.pack.bitmap import encode_row, pad4

    rng = np.random.default_rng(0)
    dtype = {"float16": mx.float16, "bfloat16": mx.bfloat16}.get(payload.get("dtype"), mx.float32)

    def pruned(shape, zeros):
        w = rng.standard_normal(shape).astype(np.float32)
        w[rng.random(shape) < zeros] = 0.0
        w[0, :3] = -0.0  # negative zeros are pruned zeros too
        return mx.array(w).astype(dtype)
    comps = [("up.weight", "m.up.weight", pruned((24, 40), 0.5), None),
             ("down_t.weight", "m.down.weight", pruned((24, 36), 0.9), None),
             ("up.bias", "m.up.bias", mx.array(rng.standard_normal(24).astype(np.float32)).astype(dtype), None)]
    quant = payload.get("bits")
    entry = pack_writer._write_endor_bundle_file(tmp_path / "layer.bin", comps, 4096, quant,
                                                 payload.get("group_size", 64))
    expected = []
    for i in range(24):
        parts = []
        for name, _, arr, _ in comps:
            if name.endswith(".weight"):
                parts.append(encode_row(pack_writer._host_rows(arr)[i], payload))
            else:
                raw = pack_writer._row_bytes(arr)[i]
                parts.append(np.concatenate([raw, np.zeros(pad4(len(raw)) - len(raw), np.uint8)]))
        expected.append(np.concatenate(parts).tobytes())
    data = (tmp_path / "layer.bin").read_bytes()
    index = np.frombuffer(data, "<u8", 25, entry["index"]["offset"])
    crcs = np.frombuffer(data, "<u4", 24, entry["checksums"]["offset"])
    assert index[0] == 0 and entry["length"] == index[-1] == sum(map(len, expected))
    assert data[: entry["length"]] == b"".join(expected)
    assert [int(c) for c in crcs] == [zlib.crc32(b) for b in expected]


def test_resident_gate_pack_keeps_the_quantized_gate_out_of_the_bundles(tiny_llama, tmp_path):
    src = tiny_llama("src", layers=2, intermediate=96)
    pack = write_pack(src, tmp_path / "pack", dtype="float16", gate_bits=4, progress=False)
    manifest = read_manifest(pack)
    source = mx.load(str(src / "model.safetensors"))
    _, resident = load_resident(pack)
    for b in manifest.bundles:
        gate = f"model.layers.{b.layer}.mlp.gate_proj"
        assert b.resident_gate == {"source": gate, "bits": 4, "group_size": 32}
        assert [c.name for c in b.components] == ["up.weight", "down_t.weight"]  # 2/3 of a gated bundle
        assert b.gated and b.modules()["gate"] == gate
        want = mx.quantize(source[f"{gate}.weight"].astype(mx.float16), group_size=32, bits=4)
        for part, w in zip(("weight", "scales", "biases"), want):
            assert mx.array_equal(resident[f"{gate}.{part}"], w).item()
    assert manifest.config["quantization"] == {"bits": 4, "group_size": 32}
    # only the gates are quantized: the model holds them as QuantizedLinear, the rest in float16
    config, weights = load_pack_weights(pack)
    assert sorted(k for k in weights if k.endswith(".scales")) == [
        f"model.layers.{i}.mlp.gate_proj.scales" for i in range(2)]
    with pytest.raises(FlashError, match="--gate-bits"):
        write_pack(src, tmp_path / "q", quantize=4, gate_bits=4, progress=False)
    with pytest.raises(FlashError, match="--gate-bits"):
        write_pack(src, tmp_path / "b", gate_bits=5, progress=False)
    doc = read_manifest(pack).fields
    del doc["resident"]["tensors"]["model.layers.1.mlp.gate_proj.scales"]
    pack_writer.write_manifest(pack, doc)
    with pytest.raises(FlashError, match=r"bundles\[1\]\.resident_gate needs the resident tensor "
                                         r"model\.layers\.1\.mlp\.gate_proj\.scales"):
        read_manifest(pack)


def test_resident_bits_quantizes_the_resident_linears_and_leaves_the_bundles(tiny_llama, tmp_path):
    """convert --resident-bits 8: attention projections and the tied embedding are MLX 8-bit
    affine in the resident file (config names the bits, the resident gates keep theirs as
    per-module overrides); the neuron bundles are the float pack's, byte for byte."""
    src = tiny_llama("src", layers=2, intermediate=96)
    plain = write_pack(src, tmp_path / "plain", dtype="float16", gate_bits=4, progress=False)
    pack = write_pack(src, tmp_path / "pack", dtype="float16", gate_bits=4, resident_bits=8,
                      resident_group_size=32, progress=False)
    manifest, source = read_manifest(pack), mx.load(str(src / "model.safetensors"))
    config, resident = load_resident(pack)
    linears = ["model.embed_tokens"] + [f"model.layers.{i}.self_attn.{p}_proj" for i in range(2)
                                        for p in "qkvo"]
    gates = [f"model.layers.{i}.mlp.gate_proj" for i in range(2)]
    assert sorted(k[: -len(".scales")] for k in resident if k.endswith(".scales")) == sorted(linears + gates)
    for name in linears:
        want = mx.quantize(source[f"{name}.weight"].astype(mx.float16), group_size=32, bits=8)
        for part, w in zip(("weight", "scales", "biases"), want):
            assert mx.array_equal(resident[f"{name}.{part}"], w).item(), name
    assert resident["model.norm.weight"].dtype == mx.float16  # norms stay float
    assert config["quantization"] == {"bits": 8, "group_size": 32,
                                      **{g: {"bits": 4, "group_size": 32} for g in gates}}
    assert manifest.resident.length < 0.7 * read_manifest(plain).resident.length
    for b, p in zip(manifest.bundles, read_manifest(plain).bundles):
        assert b.resident_gate == p.resident_gate and b.stride == p.stride
        assert (pack / b.file).read_bytes() == (plain / p.file).read_bytes()
    for bad in ({"quantize": 4}, {"resident_bits": 5}, {"resident_group_size": 48}):
        with pytest.raises(FlashError, match="--resident-"):
            write_pack(src, tmp_path / "bad", **{"resident_bits": 8, **bad}, progress=False)


@pytest.mark.parametrize("kwargs, message", [
    ({"gate_bits": 5}, "--gate-bits 5: choose 2, 3, 4 or 8, for a float pack"),
    ({"gate_bits": 4, "quantize": 4}, "--gate-bits 4: choose 2, 3, 4 or 8, for a float pack"),
    ({"gate_bits": 4, "gate_group_size": 48}, "--gate-group-size 48: choose 32, 64 or 128"),
    ({"resident_bits": 5}, "--resident-bits 5: choose 4 or 8, for a float pack"),
    ({"resident_bits": 8, "encoding": "endor"}, "--resident-bits 8: choose 4 or 8, for a float pack"),
    ({"resident_bits": 8, "resident_group_size": 48}, "--resident-group-size 48: choose 32, 64 or 128")])
def test_resident_quantization_flags_refuse_alike_before_reading(tmp_path, kwargs, message):
    with pytest.raises(FlashError) as e:  # no source folder: the flags are checked first
        write_pack(tmp_path / "missing", tmp_path / "p", progress=False, **kwargs)
    assert str(e.value).startswith(message)


def test_resident_modules_choose_each_linears_bits_and_the_config_names_them(tiny_llama, tmp_path):
    """convert --resident-bits 4 --resident-module ...: a module named by its end or its whole
    path gets its own bits / group size (16: kept float), the longest matching name wins, and the
    config's "quantization" names each one that differs from the default."""
    src = tiny_llama("src", layers=2, intermediate=96)
    pack = write_pack(src, tmp_path / "pack", dtype="float16", gate_bits=4, resident_bits=4,
                      resident_group_size=32, progress=False,
                      resident_modules={"embed_tokens": (8, 64), "v_proj": (16, 64), "q_proj": (8, 32),
                                        "model.layers.1.self_attn.q_proj": (4, 64)})
    config, resident = load_resident(pack)
    source = mx.load(str(src / "model.safetensors"))
    want = {"model.embed_tokens": (8, 64), "model.layers.0.self_attn.q_proj": (8, 32),
            "model.layers.1.self_attn.q_proj": (4, 64),
            **{f"model.layers.{i}.self_attn.{p}_proj": (4, 32) for i in range(2) for p in "ko"}}
    for name, (bits, size) in want.items():
        q = mx.quantize(source[f"{name}.weight"].astype(mx.float16), group_size=size, bits=bits)
        for part, w in zip(("weight", "scales", "biases"), q):
            assert mx.array_equal(resident[f"{name}.{part}"], w).item(), name
    for i in range(2):  # kept float
        v = f"model.layers.{i}.self_attn.v_proj"
        assert f"{v}.scales" not in resident and resident[f"{v}.weight"].dtype == mx.float16
    gates = {f"model.layers.{i}.mlp.gate_proj": {"bits": 4, "group_size": 32} for i in range(2)}
    assert config["quantization"] == {"bits": 4, "group_size": 32, **gates,
                                      "model.embed_tokens": {"bits": 8, "group_size": 64},
                                      "model.layers.0.self_attn.q_proj": {"bits": 8, "group_size": 32},
                                      "model.layers.1.self_attn.q_proj": {"bits": 4, "group_size": 64}}


@pytest.mark.parametrize("kwargs, message", [
    ({"resident_modules": {"q_proj": (4, 32)}}, "--resident-module: needs --resident-bits"),
    ({"resident_bits": 8, "resident_modules": {"q_proj": (5, 32)}}, "--resident-module q_proj=5:32: choose"),
    ({"resident_bits": 8, "resident_modules": {"q_proj": (4, 48)}}, "--resident-module q_proj=4:48: choose")])
def test_resident_modules_refuse_before_reading(tmp_path, kwargs, message):
    with pytest.raises(FlashError) as e:  # no source folder: the flags are checked first
        write_pack(tmp_path / "missing", tmp_path / "p", progress=False, **kwargs)
    assert str(e.value).startswith(message)


def test_resident_quantizer_rounds_the_resident_linears_not_the_gates(tiny_llama, tmp_path):
    """write_pack(resident_quantizer=f): f gives every resident linear's stored (packed, scales,
    biases), called with its module path, its float weight and its bits / group size; the
    resident gates keep mx.quantize."""
    src = tiny_llama("src", layers=2, intermediate=96)
    calls = []

    def halved(path, w, bits, size):  # a quantizer the default would never match
        calls.append((path, w.dtype, bits, size))
        q, s, b = mx.quantize(w, group_size=size, bits=bits)
        return q, s / 2, b

    pack = write_pack(src, tmp_path / "pack", dtype="float16", gate_bits=4, resident_bits=8,
                      resident_group_size=32, resident_modules={"o_proj": (4, 64)},
                      resident_quantizer=halved, progress=False)
    _, resident = load_resident(pack)
    source = mx.load(str(src / "model.safetensors"))
    linears = ["model.embed_tokens"] + [f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkvo"]
    assert sorted(c[0] for c in calls) == sorted(linears)
    assert all(c[1] == mx.float16 and c[2:] == ((4, 64) if c[0].endswith("o_proj") else (8, 32)) for c in calls)
    name = "model.layers.1.self_attn.o_proj"
    assert mx.array_equal(resident[f"{name}.scales"],
                          mx.quantize(source[f"{name}.weight"].astype(mx.float16), group_size=64, bits=4)[1] / 2).item()
    gate = "model.layers.0.mlp.gate_proj"
    assert mx.array_equal(resident[f"{gate}.scales"],
                          mx.quantize(source[f"{gate}.weight"].astype(mx.float16), group_size=32, bits=4)[1]).item()
