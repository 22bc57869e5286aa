"""GGUF export: a flash pack's model as a llama.cpp GGUF file (the llama.cpp peer of `bench run`).

OPT-shaped packs become llama.cpp's "gpt2" (write_gpt2_gguf: llama.cpp has no OPT; same tensors,
GELU for ReLU, which changes no cost of a dense pass).

MoE packs of mlx-lm's olmoe and qwen3_moe become llama.cpp's "olmoe" / "qwen3moe" with the same
weights. MLX affine 4-bit quantization with group size 32 and float16 scales and biases (or
float32 ones holding float16 values, as synthetic packs store them) is exactly llama.cpp's Q4_1 block (per 32 weights: d = scale, m = bias, 16 bytes of 4-bit codes, value
= d * code + m), so those tensors are re-laid-out, not re-quantized: the export is lossless
(synthetic MoE packs use group size 32 for this). Float16 tensors stay F16; norms are written F32
(what llama.cpp's converters write). Other quantizations are refused with a one-line error.

The file is written tensor by tensor: the tensor table from the manifest first, then the resident
tensors and one MoE layer's expert blocks at a time, so memory holds one layer's experts.
"""

from pathlib import Path

import numpy as np

from ..errors import FlashError
from ..pack import load_pack_weights, load_resident, read_layer_components, read_manifest
from ..paths import write_file_atomic
from .gguf import gguf_name

# mlx-lm model_type -> llama.cpp architecture
EXPORT_ARCHITECTURES = {"olmoe": "olmoe", "qwen3_moe": "qwen3moe"}
Q4_1_BLOCK = 32  # weights per Q4_1 block (20 bytes: d, m as float16, then 16 bytes of codes)


def mlx_to_q4_1(weight: np.ndarray, scales: np.ndarray, biases: np.ndarray) -> np.ndarray:
    """MLX affine 4-bit (group size 32, float16 scales/biases) -> Q4_1 blocks, uint8 [..., in/32*20].

    weight: uint32 [..., out, in/8] (MLX packs code j of a word at bits 4j, so byte k of a group
    holds codes 2k (low nibble) and 2k+1); Q4_1 byte j holds codes j (low) and j+16 (high).
    """
    scales, biases = _exact_float16(scales), _exact_float16(biases)
    lead = weight.shape[:-1]
    groups = scales.shape[-1]
    raw = np.ascontiguousarray(weight).view(np.uint8).reshape(*lead, groups, 16)
    codes = np.stack([raw & 0x0F, raw >> 4], axis=-1).reshape(*lead, groups, Q4_1_BLOCK)
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    blocks = np.empty((*lead, groups, 20), np.uint8)
    blocks[..., 0:2] = scales[..., None].view(np.uint8)
    blocks[..., 2:4] = biases[..., None].view(np.uint8)
    blocks[..., 4:] = qs
    return blocks.reshape(*lead, groups * 20)


def _exact_float16(a: np.ndarray) -> np.ndarray:
    """`a` as float16, refusing values float16 cannot hold exactly (the export must be lossless)."""
    h = a.astype(np.float16)
    if a.dtype != np.float16 and not np.array_equal(h.astype(a.dtype), a):
        raise FlashError("GGUF export: a float tensor holds values float16 cannot represent "
                         "(Q4_1's d and m and the F16 tensors are float16; the export would be lossy)")
    return h


def add_tokenizer(writer, tokenizer_gguf: Path, vocab_size: int) -> None:
    """Copy the tokenizer metadata of `tokenizer_gguf` (a gpt2-style BPE GGUF: the embedded model's,
    the synthetic packs' tokenizer) into `writer`, padded with control tokens to `vocab_size`."""
    import gguf  # optional (the test and peers extras)

    reader = gguf.GGUFReader(str(tokenizer_gguf))
    field = reader.fields

    def strings(key):
        return [bytes(field[key].parts[i]) for i in field[key].data]

    tokens, merges = strings("tokenizer.ggml.tokens"), strings("tokenizer.ggml.merges")
    types = [int(field["tokenizer.ggml.token_type"].parts[i][0])
             for i in field["tokenizer.ggml.token_type"].data]
    for i in range(len(tokens), vocab_size):
        tokens.append(f"<|synthetic_{i}|>".encode())
        types.append(gguf.TokenType.CONTROL)
    writer.add_tokenizer_model("gpt2")
    if "tokenizer.ggml.pre" in field:
        f = field["tokenizer.ggml.pre"]
        writer.add_tokenizer_pre(bytes(f.parts[f.data[0]]).decode())
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for key in ("bos", "eos"):
        f = field.get(f"tokenizer.ggml.{key}_token_id")
        if f is not None:
            getattr(writer, f"add_{key}_token_id")(int(f.parts[f.data[0]][0]))


def _tensor_plan(manifest) -> list:
    """[(gguf name, mlx base name, where)] in file order: resident tensors, then per layer its
    experts; where = "resident" or the expert layer's bundle entry."""
    names = sorted({n.rpartition(".")[0] for n in manifest.resident.tensors})
    plan = [(gguf_name(n + ".weight"), n, "resident") for n in names]
    for entry in sorted(manifest.bundles, key=lambda b: b.layer):
        if entry.kind != "experts":
            raise FlashError(f"{entry.file}: GGUF export handles MoE expert bundles only")
        for base in sorted({c.source.rpartition(".")[0] for c in entry.components}):
            plan.append((gguf_name(base + ".weight"), base, entry))
    return plan


def _gguf_array(name, tensors: dict, base: str):
    """(numpy array to write, raw ggml type or None) for the mlx tensor `base` (+.scales/.biases)."""
    import gguf

    w = tensors[base + ".weight"]
    if base + ".scales" in tensors:
        return mlx_to_q4_1(w, tensors[base + ".scales"], tensors[base + ".biases"]), \
            gguf.GGMLQuantizationType.Q4_1
    if w.ndim == 1:  # norms: llama.cpp's converters write them float32
        return w.astype(np.float32), None
    return _exact_float16(w), None


def _numpy(arr) -> np.ndarray:
    import mlx.core as mx

    if arr.dtype == mx.bfloat16:
        arr = arr.astype(mx.float32)
    return np.array(arr)


def write_moe_gguf(pack_dir, out, tokenizer_gguf) -> Path:
    """Write the MoE pack `pack_dir` as a llama.cpp GGUF at `out`, whole (paths.write_file_atomic).

    tokenizer_gguf: a GGUF whose gpt2 BPE tokenizer the pack uses (synthetic packs: the
    embedded model's). FlashError names the pack when its architecture or quantization has no
    lossless llama.cpp equivalent.
    """
    import gguf  # optional (the test and peers extras)

    pack, out = Path(pack_dir), Path(out)
    manifest = read_manifest(pack)
    config = manifest.config
    arch = EXPORT_ARCHITECTURES.get(config.get("model_type"))
    if arch is None:
        raise FlashError(f"{pack}: GGUF export supports model types "
                         f"{', '.join(EXPORT_ARCHITECTURES)}, not {config.get('model_type')!r}")
    q = config.get("quantization")
    if q and (q.get("bits"), q.get("group_size")) != (4, Q4_1_BLOCK):
        raise FlashError(f"{pack}: {q.get('bits')}-bit group-{q.get('group_size')} quantization has "
                         f"no lossless llama.cpp type (4-bit group 32 is Q4_1)")
    _, resident = load_resident(pack, manifest=manifest)
    resident = {k: _numpy(v) for k, v in resident.items()}
    plan = _tensor_plan(manifest)

    def write(tmp):
        writer = gguf.GGUFWriter(str(tmp), arch)
        try:
            _add_metadata(writer, config, pack, tokenizer_gguf)
            shapes = _declared(plan, manifest, resident)
            for (name, _, _), (shape, dtype, nbytes, raw) in zip(plan, shapes):
                writer.add_tensor_info(name, shape, dtype, nbytes, raw_dtype=raw)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            layer_entry, layer_tensors = None, None
            for name, base, where in plan:
                if where == "resident":
                    tensors = resident
                else:
                    if where is not layer_entry:  # one layer's experts in memory at a time
                        comps = read_layer_components(pack, where)
                        layer_tensors = {c.source: _numpy(comps[c.name]) for c in where.components}
                        layer_entry = where
                    tensors = layer_tensors
                arr, _ = _gguf_array(name, tensors, base)
                writer.write_tensor_data(arr)
        finally:
            writer.close()

    return write_file_atomic(out, write, suffix=out.suffix)


def _declared(plan, manifest, resident) -> list:
    """(byte or element shape, numpy dtype, nbytes, raw type) of each planned tensor, from the
    manifest alone (no expert bytes read)."""
    import gguf

    out = []
    by_layer = {}
    for name, base, where in plan:
        if where == "resident":
            spec = {k[len(base) + 1:]: (tuple(v.shape), v.dtype) for k, v in resident.items()
                    if k.rpartition(".")[0] == base}
        else:
            comps = by_layer.setdefault(where.layer, {c.source: c for c in where.components})
            spec = {k[len(base) + 1:]: ((where.count, *c.shape), None) for k, c in comps.items()
                    if k.rpartition(".")[0] == base}
        shape = spec["weight"][0]
        if "scales" in spec:
            groups = spec["scales"][0][-1]
            byte_shape = (*shape[:-1], groups * 20)
            out.append((byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)),
                        gguf.GGMLQuantizationType.Q4_1))
        else:
            dtype = np.dtype(np.float32 if len(shape) == 1 else np.float16)
            out.append((shape, dtype, int(np.prod(shape)) * dtype.itemsize, None))
    return out


def _add_metadata(writer, config, pack, tokenizer_gguf):
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    expert_ffn = config.get("moe_intermediate_size") or config["intermediate_size"]
    writer.add_name(f"mlx-flash export of {pack.name}"
                    + (" (synthetic weights)" if config.get("synthetic") else ""))
    writer.add_context_length(config.get("max_position_embeddings") or 4096)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_expert_count(int(config["num_experts"]))
    writer.add_expert_used_count(int(config["num_experts_per_tok"]))
    writer.add_expert_feed_forward_length(expert_ffn)
    writer.add_file_type(3)  # LLAMA_FTYPE_MOSTLY_Q4_1
    add_tokenizer(writer, Path(tokenizer_gguf), config["vocab_size"])


def write_gpt2_gguf(pack: Path, out: Path, tokenizer_gguf: Path) -> Path:
    """A llama.cpp GGUF (architecture "gpt2") with the tensors of an OPT-shaped pack; the
    tokenizer metadata comes from `tokenizer_gguf` (the embedded model's, the synthetic packs'
    tokenizer), padded with control tokens to the pack's vocabulary size."""
    import gguf  # optional (the test and peers extras)
    import mlx.core as mx


    config, w = load_pack_weights(pack)
    if config.get("model_type") != "opt":
        raise FlashError(f"{pack}: llama.cpp GGUF export is written for OPT-shaped packs only "
                         f"(this is {config.get('model_type')}); pass --gguf FILE")
    hidden, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    ctx = config["max_position_embeddings"]

    def np_(a):
        a = a.astype(mx.float32) if a.dtype == mx.bfloat16 else a
        return np.array(a)

    writer = gguf.GGUFWriter(None, "gpt2")  # the file is opened by write() below
    writer.add_name(f"mlx-flash synthetic export of {pack.name}")
    writer.add_context_length(ctx)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(config["ffn_dim"])
    writer.add_block_count(layers)
    writer.add_head_count(config["num_attention_heads"])
    writer.add_layer_norm_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    add_tokenizer(writer, tokenizer_gguf, vocab)
    d = "model.decoder."
    writer.add_tensor("token_embd.weight", np_(w[d + "embed_tokens.weight"]))
    writer.add_tensor("position_embd.weight", np_(w[d + "embed_positions.weight"][2: 2 + ctx]))
    writer.add_tensor("output_norm.weight", np_(w[d + "final_layer_norm.weight"]).astype(np.float32))
    writer.add_tensor("output_norm.bias", np_(w[d + "final_layer_norm.bias"]).astype(np.float32))
    for i in range(layers):
        p, b = f"{d}layers.{i}.", f"blk.{i}."

        def t(name):
            return np_(w[p + name])

        qkv = np.concatenate([t(f"self_attn.{n}_proj.weight") for n in "qkv"])
        qkv_b = np.concatenate([t(f"self_attn.{n}_proj.bias") for n in "qkv"]).astype(np.float32)
        pairs = {"attn_norm": "self_attn_layer_norm", "ffn_norm": "final_layer_norm"}
        for g, o in pairs.items():
            writer.add_tensor(f"{b}{g}.weight", t(f"{o}.weight").astype(np.float32))
            writer.add_tensor(f"{b}{g}.bias", t(f"{o}.bias").astype(np.float32))
        writer.add_tensor(f"{b}attn_qkv.weight", qkv)
        writer.add_tensor(f"{b}attn_qkv.bias", qkv_b)
        writer.add_tensor(f"{b}attn_output.weight", t("self_attn.out_proj.weight"))
        writer.add_tensor(f"{b}attn_output.bias", t("self_attn.out_proj.bias").astype(np.float32))
        writer.add_tensor(f"{b}ffn_up.weight", t("fc1.weight"))
        writer.add_tensor(f"{b}ffn_up.bias", t("fc1.bias").astype(np.float32))
        writer.add_tensor(f"{b}ffn_down.weight", t("fc2.weight"))
        writer.add_tensor(f"{b}ffn_down.bias", t("fc2.bias").astype(np.float32))

    def write(tmp):
        try:
            writer.write_header_to_file(path=tmp)
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()

    return write_file_atomic(out, write, suffix=out.suffix)
