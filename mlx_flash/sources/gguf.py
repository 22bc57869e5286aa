"""GGUF import: the one place that knows the GGUF layout.

`read_gguf_header` parses and validates the header (metadata and tensor table) in pure Python, so
a truncated, corrupt or unsupported file fails with a one-line error before any tensor is read.
`gguf_to_mlx` then reads tensors with `mx.load` (which turns Q4_0/Q4_1/Q8_0 blocks into MLX affine
quantized weights exactly) and maps llama.cpp names, config and layouts to mlx-lm's.
"""

import struct
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from ..errors import FlashError

GGUF_MAGIC = b"GGUF"

# GGUF metadata value types -> struct format (scalars) ; 8 = string, 9 = array
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9

# ggml tensor types we import: type id -> (name, elements per block, bytes per block)
SUPPORTED_TENSOR_TYPES = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    8: ("Q8_0", 32, 34),
}
# The rest, by name only, so the error can say what the file holds.
_OTHER_TENSOR_TYPES = {
    6: "Q5_0", 7: "Q5_1", 9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K",
    15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S",
    22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M",
    30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}
# MLX affine parameters each GGUF block type becomes: (bits, group_size)
QUANT_PARAMS = {"Q4_0": (4, 32), "Q4_1": (4, 32), "Q8_0": (8, 32)}


@dataclass
class GGUFTensorInfo:
    name: str
    shape: tuple  # GGUF order: fastest-varying dimension first
    type_name: str
    offset: int  # bytes, from the start of the file
    nbytes: int


@dataclass
class GGUFHeader:
    path: Path
    version: int
    metadata: dict
    tensors: dict = field(default_factory=dict)  # name -> GGUFTensorInfo

    @property
    def architecture(self) -> str:
        return self.metadata.get("general.architecture", "")

    def arch_value(self, key, default=None):
        """Metadata `<architecture>.<key>`, e.g. arch_value('block_count')."""
        return self.metadata.get(f"{self.architecture}.{key}", default)


class _Cursor:
    def __init__(self, data: bytes, path: Path):
        self.data, self.pos, self.path = data, 0, path

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.data):
            raise FlashError(f"{self.path}: GGUF header is truncated at byte {self.pos}")
        value = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += size
        return value if len(value) > 1 else value[0]

    def string(self) -> str:
        length = self.take("Q")
        if length > len(self.data) - self.pos:
            raise FlashError(
                f"{self.path}: GGUF header is truncated or corrupt "
                f"(a string of {length} bytes at byte {self.pos} runs past the end)"
            )
        raw = self.data[self.pos : self.pos + length]
        self.pos += length
        return raw.decode("utf-8", errors="replace")

    def value(self, type_id: int):
        if type_id in _SCALAR_FORMATS:
            return self.take(_SCALAR_FORMATS[type_id])
        if type_id == _STRING:
            return self.string()
        if type_id == _ARRAY:
            item_type, count = self.take("I"), self.take("Q")
            if item_type in _SCALAR_FORMATS:
                fmt = _SCALAR_FORMATS[item_type]
                size = struct.calcsize(fmt) * count
                if self.pos + size > len(self.data):
                    raise FlashError(f"{self.path}: GGUF header is truncated at byte {self.pos}")
                values = list(struct.unpack_from(f"<{count}{fmt}", self.data, self.pos))
                self.pos += size
                return values
            return [self.value(item_type) for _ in range(count)]
        raise FlashError(f"{self.path}: corrupt GGUF header (unknown value type {type_id} at byte {self.pos})")


def read_gguf_header(path) -> GGUFHeader:
    """Parse a GGUF file's metadata and tensor table; check every tensor's type and extent."""
    path = Path(path)
    if not path.is_file():
        raise FlashError(f"{path}: no such file")
    file_size = path.stat().st_size
    with open(path, "rb") as f:
        # Headers hold the tokenizer (a few MB); read more only if the table runs past it.
        data = f.read(min(file_size, 64 << 20))
    cur = _Cursor(data, path)
    if data[:4] != GGUF_MAGIC:
        raise FlashError(f"{path}: not a GGUF file (bad magic {data[:4]!r})")
    cur.pos = 4
    version = cur.take("I")
    if version not in (2, 3):
        raise FlashError(f"{path}: unsupported GGUF version {version} (supported: 2, 3)")
    n_tensors, n_kv = cur.take("Q"), cur.take("Q")
    if n_tensors > 1_000_000 or n_kv > 1_000_000:
        raise FlashError(f"{path}: corrupt GGUF header ({n_tensors} tensors, {n_kv} keys)")
    metadata = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.take("I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.take("I")
        if n_dims > 8:
            raise FlashError(f"{path}: corrupt GGUF header (tensor {name!r} has {n_dims} dimensions)")
        shape = tuple(cur.take("Q") for _ in range(n_dims))
        type_id, offset = cur.take("I"), cur.take("Q")
        infos.append((name, shape, type_id, offset))
    alignment = metadata.get("general.alignment", 32)
    if isinstance(alignment, bool) or not isinstance(alignment, int) or not 0 < alignment <= 1 << 20 \
            or alignment & (alignment - 1):
        raise FlashError(f"{path}: corrupt GGUF header (general.alignment = {alignment!r:.40}, "
                         f"must be a power of two up to 1 MiB)")
    data_start = (cur.pos + alignment - 1) // alignment * alignment
    header = GGUFHeader(path=path, version=version, metadata=metadata)
    for name, shape, type_id, offset in infos:
        if type_id not in SUPPORTED_TENSOR_TYPES:
            type_name = _OTHER_TENSOR_TYPES.get(type_id, f"type {type_id}")
            supported = ", ".join(t[0] for t in SUPPORTED_TENSOR_TYPES.values())
            raise FlashError(
                f"{path}: tensor {name!r} uses GGUF quantization {type_name}, which mlx-flash does not "
                f"import (supported: {supported}); requantize the model with llama-quantize"
            )
        type_name, block, block_bytes = SUPPORTED_TENSOR_TYPES[type_id]
        count = 1
        for d in shape:
            count *= d
        if count % block:
            raise FlashError(f"{path}: tensor {name!r} has {count} elements, not a multiple of {block}")
        nbytes = count // block * block_bytes
        start = data_start + offset
        if start + nbytes > file_size:
            raise FlashError(
                f"{path}: file is truncated: tensor {name!r} needs bytes {start}..{start + nbytes} "
                f"but the file has {file_size}"
            )
        header.tensors[name] = GGUFTensorInfo(name, shape, type_name, start, nbytes)
    return header


# llama.cpp tensor names -> mlx-lm names, for the llama family (llama, mistral, qwen2, qwen3).
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # MoE (llama.cpp's names): router, stacked experts [E, out, in] (mlx-lm SwitchGLU), shared expert
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# GGUF architecture -> (mlx-lm model_type, HF class); MoE ones read llama.cpp's expert_* keys.
_MODEL_TYPES = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM"),
                "qwen3": ("qwen3", "Qwen3ForCausalLM"), "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
                "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
                "olmoe": ("olmoe", "OlmoeForCausalLM")}
_MOE_ARCHITECTURES = ("qwen2moe", "qwen3moe", "olmoe")
SUPPORTED_ARCHITECTURES = tuple(_MODEL_TYPES)
# llama.cpp's converter permutes llama q/k rows for its interleaved RoPE; mlx-lm (like HF) uses the
# half-split RoPE, so those rows are put back. Qwen GGUFs use NeoX RoPE and are not permuted.
_PERMUTED_QK_ARCHITECTURES = ("llama",)


def mlx_name(gguf_name: str) -> str:
    """`blk.3.ffn_up.weight` -> `model.layers.3.mlp.up_proj.weight` (also .scales/.biases/.bias)."""
    base, _, suffix = gguf_name.rpartition(".")
    if base.startswith("blk."):
        pieces = base.split(".", 2)
        if len(pieces) != 3 or not pieces[1].isdigit() or pieces[2] not in _BLOCK_NAMES:
            raise FlashError(f"unknown GGUF tensor {gguf_name!r}")
        _, layer, part = pieces
        return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{suffix}"
    if base not in _GLOBAL_NAMES:
        raise FlashError(f"unknown GGUF tensor {gguf_name!r}")
    return f"{_GLOBAL_NAMES[base]}.{suffix}"


def gguf_name(mlx_name_: str) -> str:
    """`model.layers.3.mlp.up_proj.weight` -> `blk.3.ffn_up.weight`: the inverse of `mlx_name`."""
    base, _, suffix = mlx_name_.rpartition(".")
    for gguf_base, mlx_base in _GLOBAL_NAMES.items():
        if base == mlx_base:
            return f"{gguf_base}.{suffix}"
    pieces = base.split(".", 3)
    if len(pieces) == 4 and pieces[:2] == ["model", "layers"] and pieces[2].isdigit():
        for part, mlx_part in _BLOCK_NAMES.items():
            if pieces[3] == mlx_part:
                return f"blk.{pieces[2]}.{part}.{suffix}"
    raise FlashError(f"no GGUF name for tensor {mlx_name_!r}")


def unpermute_rows(w: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's q/k row permutation: per head, rows (0, d/2, 1, d/2+1, ...) -> halves."""
    rows = w.shape[0]
    head_dim = rows // n_heads
    return (
        w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(rows, *w.shape[1:])
    )


def gguf_config(header: GGUFHeader) -> dict:
    """mlx-lm / HF style config.json from GGUF metadata (llama family)."""
    arch = header.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise FlashError(
            f"{header.path}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    get = header.arch_value
    try:
        n_heads = int(get("attention.head_count"))
        hidden = int(get("embedding_length"))
        config = {
            "model_type": _MODEL_TYPES[arch][0],
            "architectures": [_MODEL_TYPES[arch][1]],
            "hidden_size": hidden,
            "num_hidden_layers": int(get("block_count")),
            "intermediate_size": int(get("feed_forward_length")),
            "num_attention_heads": n_heads,
            "num_key_value_heads": int(get("attention.head_count_kv", n_heads)),
            "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
            "rope_theta": float(get("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(get("context_length", 2048)),
            "vocab_size": int(get("vocab_size", len(header.metadata.get("tokenizer.ggml.tokens", [])))),
            "tie_word_embeddings": "output.weight" not in header.tensors,
        }
    except TypeError as e:  # a required key is missing (int(None))
        raise FlashError(f"{header.path}: GGUF metadata lacks a required {arch}.* key ({e})") from None
    except (ValueError, OverflowError) as e:  # a key of the wrong type (a string, NaN as int)
        raise FlashError(f"{header.path}: GGUF metadata has an invalid {arch}.* value ({e})") from None
    _check_config_vs_tensors(header, config)
    if arch in _MOE_ARCHITECTURES:
        _moe_config(config, header, get)
    head_dim = get("attention.key_length") or get("rope.dimension_count")
    if head_dim and int(head_dim) != hidden // n_heads or arch in ("qwen3", "qwen3moe"):
        config["head_dim"] = int(head_dim or hidden // n_heads)
    if arch in ("qwen2", "qwen2moe"):
        config["attention_bias"] = "blk.0.attn_q.bias" in header.tensors
    scaling = get("rope.scaling.type")
    if scaling == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise FlashError(f"{header.path}: RoPE scaling {scaling!r} is not supported")
    if "rope_freqs.weight" in header.tensors:
        raise FlashError(f"{header.path}: per-frequency RoPE factors (rope_freqs) are not supported")
    for key in ("general.name", "general.license"):
        if key in header.metadata:
            config.setdefault("gguf_metadata", {})[key] = header.metadata[key]
    return config


def _check_config_vs_tensors(header: GGUFHeader, config: dict):
    """The metadata must describe the tensors the file holds: one line naming the key otherwise
    (a wrong block_count made mlx-lm list thousands of missing weights)."""
    path, arch = header.path, header.architecture

    def bad(key, reason):
        raise FlashError(f"{path}: GGUF metadata {arch}.{key} {reason}")

    for key, value in (("embedding_length", config["hidden_size"]),
                       ("feed_forward_length", config["intermediate_size"]),
                       ("attention.head_count", config["num_attention_heads"]),
                       ("attention.head_count_kv", config["num_key_value_heads"]),
                       ("block_count", config["num_hidden_layers"]),
                       ("context_length", config["max_position_embeddings"])):
        if not 0 < value <= 1 << 24:
            bad(key, f"= {value} is out of range")
    eps = config["rms_norm_eps"]
    if not (eps == eps and 0 < eps < 1):  # NaN fails eps == eps
        bad("attention.layer_norm_rms_epsilon", f"= {eps} must be in (0, 1)")
    if not (config["rope_theta"] == config["rope_theta"] and 0 < config["rope_theta"] < 1e12):
        bad("rope.freq_base", f"= {config['rope_theta']} is out of range")
    if config["hidden_size"] % config["num_attention_heads"] or \
            config["num_attention_heads"] % config["num_key_value_heads"]:
        bad("attention.head_count", f"= {config['num_attention_heads']} (kv "
            f"{config['num_key_value_heads']}) does not divide embedding_length {config['hidden_size']}")
    blocks = {int(n.split(".")[1]) for n in header.tensors if n.startswith("blk.") and n.split(".")[1].isdigit()}
    n_layers = config["num_hidden_layers"]
    if blocks != set(range(n_layers)):
        bad("block_count", f"= {n_layers}, but the file holds tensors for {len(blocks)} blocks"
            + (f" (0..{max(blocks)})" if blocks else ""))
    embd = header.tensors.get("token_embd.weight")
    if embd is None:
        raise FlashError(f"{path}: GGUF file has no token_embd.weight tensor")
    if len(embd.shape) != 2 or embd.shape[0] != config["hidden_size"]:
        bad("embedding_length", f"= {config['hidden_size']}, but token_embd.weight is {list(embd.shape)}")
    if header.arch_value("vocab_size") is None:  # the token list may be shorter than the table
        config["vocab_size"] = embd.shape[1]
    elif config["vocab_size"] != embd.shape[1]:
        bad("vocab_size", f"= {config['vocab_size']}, but token_embd.weight has {embd.shape[1]} rows")
    up = header.tensors.get("blk.0.ffn_up.weight")
    if up is not None and list(up.shape) != [config["hidden_size"], config["intermediate_size"]]:
        bad("feed_forward_length", f"= {config['intermediate_size']}, but blk.0.ffn_up.weight is "
            f"{list(up.shape)}")


def _moe_config(config, header, get):
    """llama.cpp's expert_* metadata -> the mlx-lm MoE config keys (qwen2_moe, qwen3_moe, olmoe)."""
    try:
        config.update({"num_experts": int(get("expert_count")),
                       "num_experts_per_tok": int(get("expert_used_count")),
                       "moe_intermediate_size": int(get("expert_feed_forward_length"))})
    except TypeError as e:
        raise FlashError(f"{header.path}: MoE GGUF lacks an expert_* key ({e})") from None
    if header.architecture == "olmoe":
        # llama.cpp's olmoe graph keeps the softmax weights of the chosen experts (norm_w = false)
        config["norm_topk_prob"] = False
    elif header.architecture == "qwen3moe":
        # llama.cpp's qwen3moe graph normalises the chosen experts' weights (norm_w = true)
        config.update({"norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []})
    else:
        shared = get("expert_shared_feed_forward_length")
        config["shared_expert_intermediate_size"] = int(shared) if shared else 0


def gguf_to_mlx(path) -> tuple:
    """Read a GGUF file as (config, weights) with mlx-lm names and layouts.

    Quantized tensors stay MLX affine-quantized (`X.weight` uint32, `X.scales`, `X.biases`); the
    config's `quantization` holds the most common (bits, group_size) with per-layer overrides.
    """
    header = read_gguf_header(path)
    config = gguf_config(header)
    try:
        raw = mx.load(str(header.path))
    except Exception as e:  # MLX's reader failed on something our header check let through
        raise FlashError(f"{header.path}: could not read tensors: {e}") from None
    permuted = header.architecture in _PERMUTED_QK_ARCHITECTURES
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    weights, layer_quant = {}, {}
    for gguf_name, value in raw.items():
        name = mlx_name(gguf_name)
        part = gguf_name.split(".")[-2]
        if permuted and part in heads:
            if value.ndim < 1 or value.shape[0] == 0 or value.shape[0] % (2 * heads[part]):
                raise FlashError(f"{header.path}: tensor {gguf_name!r} has {value.shape[0] if value.ndim else 0} "
                                 f"rows, not a multiple of 2 x {heads[part]} heads")
            value = unpermute_rows(value, heads[part])
        weights[name] = value
    for info in header.tensors.values():
        if info.type_name in QUANT_PARAMS:
            layer_quant[mlx_name(info.name).rpartition(".")[0]] = QUANT_PARAMS[info.type_name]
    if layer_quant:
        counts = {}
        for params in layer_quant.values():
            counts[params] = counts.get(params, 0) + 1
        bits, group_size = max(counts, key=counts.get)
        quant = {"group_size": group_size, "bits": bits}
        for layer, (b, g) in sorted(layer_quant.items()):
            if (b, g) != (bits, group_size):
                quant[layer] = {"group_size": g, "bits": b}
        config["quantization"] = quant
    return config, weights
