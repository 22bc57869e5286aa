"""Synthetic flash packs: random weights in a real architecture's shape, for speed measurements only.

    python -m mlx_flash.convert --synthetic opt-1.3b --sparsity 0.95 --dtype float16 --out PACK

Why synthetic: the papers' models (OPT-6.7B, Llama-2-7B) cannot be downloaded here, but the speed of
flash loading depends only on tensor shapes, dtypes and how many FFN neurons fire, not on what the
weights mean. A synthetic pack is labelled `"synthetic"` in its manifest and config, and every bench
report that uses one says so; it is never used for quality.

FFN design (so the activation sparsity is chosen and a low-rank predictor is exact):
    up   = B @ A          A: [rank, hidden] orthonormal rows, B: [ffn, rank] unit rows
    bias = -Phi^-1(sparsity)   (for every neuron)
The FFN input is a layer-normalised vector (|x|^2 = hidden), so for a random direction A x has
unit-variance coordinates, B_i . (A x) ~ N(0, 1), and neuron i fires (up_i . x + bias_i > 0) with
probability 1 - sparsity. The predictor `(x @ A.T) @ B.T + bias` is the up projection itself, in
low rank: exact up to float rounding. OPT shapes use ReLU (exact zeros); Llama shapes are gated
with SiLU (mlx-lm's llama), so the gate carries B @ A and the bias (mlp_bias) and "inactive"
neurons are small rather than zero: speed only.

MoE shapes (MOE_ARCHS: OLMoE-1B-7B, Qwen3-30B-A3B and tiny ones) are written already quantized
(MLX affine, default 4 bits with group size 32; scales and biases are float16 values, stored as
float32 in the pack for MLX's CPU path: exactly llama.cpp's Q4_1 block, so sources.gguf_export
writes the same weights losslessly for llama.cpp). Every linear
weight is uniform random codes with per-group random scales (std 1/sqrt(fan in)); routers and norms
stay float16. Random routers pick every expert equally often, but not independently from token
to token: attention mixes the context into each hidden state, so consecutive tokens' routing
overlaps (measured on OLMoE-1B-7B, 47 sampled tokens: LRU with 8 of 64 slots hits 0.43, where
independent uniform routing would give 0.125). Hit rates on these packs describe this random
model's routing, not a trained model's.

The tokenizer is the embedded SmolLM2 tokenizer (49152 tokens), padded with placeholder tokens
when the architecture's vocabulary is larger; a smaller vocabulary (Llama-2's 32000) is raised to
49152 and the manifest says so.
"""

import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from tqdm import tqdm

from ..errors import FlashError
from ..model_folder import copy_tokenizer_files, write_config, write_weights
from ..pack import read_manifest, write_manifest, write_pack
from ..paths import atomic_output_dir, write_text_atomic
from ..sources import resolve_model
from ..sparse.predictor import save_predictors

# Shapes from the models' published config.json files.
ARCHS = {
    "opt-125m": dict(model_type="opt", hidden_size=768, num_hidden_layers=12, ffn_dim=3072,
                     num_attention_heads=12, vocab_size=50272, max_position_embeddings=2048),
    "opt-1.3b": dict(model_type="opt", hidden_size=2048, num_hidden_layers=24, ffn_dim=8192,
                     num_attention_heads=32, vocab_size=50272, max_position_embeddings=2048),
    "opt-6.7b": dict(model_type="opt", hidden_size=4096, num_hidden_layers=32, ffn_dim=16384,
                     num_attention_heads=32, vocab_size=50272, max_position_embeddings=2048),
    "llama-2-7b": dict(model_type="llama", hidden_size=4096, num_hidden_layers=32,
                       intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32,
                       vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5,
                       rope_theta=10000.0, tie_word_embeddings=False),
    # Tiny shapes for tests and quick runs.
    "opt-tiny": dict(model_type="opt", hidden_size=64, num_hidden_layers=2, ffn_dim=256,
                     num_attention_heads=4, vocab_size=49152, max_position_embeddings=512),
    "llama-tiny": dict(model_type="llama", hidden_size=64, num_hidden_layers=2,
                       intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=49152, max_position_embeddings=512, rms_norm_eps=1e-5,
                       rope_theta=10000.0, tie_word_embeddings=True),
}
# MoE shapes from the published config.json files (allenai/OLMoE-1B-7B-0924, Qwen/Qwen3-30B-A3B).
MOE_ARCHS = {
    "olmoe-1b-7b": dict(model_type="olmoe", hidden_size=2048, num_hidden_layers=16,
                        intermediate_size=1024, num_attention_heads=16, num_key_value_heads=16,
                        num_experts=64, num_experts_per_tok=8, norm_topk_prob=False,
                        vocab_size=50304, max_position_embeddings=4096, rope_theta=10000.0,
                        rms_norm_eps=1e-5, tie_word_embeddings=False),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48,
                          intermediate_size=6144, moe_intermediate_size=768, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                          vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
                          rms_norm_eps=1e-6, tie_word_embeddings=False),
    # Tiny shapes for tests (group size 32 divides every input dimension).
    "olmoe-tiny": dict(model_type="olmoe", hidden_size=64, num_hidden_layers=2, intermediate_size=64,
                       num_attention_heads=4, num_key_value_heads=4, num_experts=8,
                       num_experts_per_tok=2, norm_topk_prob=False, vocab_size=49152,
                       max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-5,
                       tie_word_embeddings=False),
    "qwen3-moe-tiny": dict(model_type="qwen3_moe", hidden_size=64, num_hidden_layers=2,
                           intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                           norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                           vocab_size=49152, max_position_embeddings=512, rope_theta=1000000.0,
                           rms_norm_eps=1e-6, tie_word_embeddings=False),
}
MOE_GROUP_SIZE = 32  # llama.cpp's Q4_1 / Q8_0 block length: the GGUF export is then lossless
DEFAULT_RANK = 128


def inverse_normal_cdf(p: float) -> float:
    """Phi^-1(p) for 0 < p < 1 (bisection on erf: exact to ~1e-12, no scipy)."""
    lo, hi = -12.0, 12.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if 0.5 * (1 + math.erf(mid / math.sqrt(2))) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def ffn_roles(config: dict) -> dict:
    """{"sparse": module whose output sets sparsity, ...} names for layer {i} of this architecture."""
    if config["model_type"] == "opt":
        return {"prefix": "model.decoder.layers.{i}.", "sparse": "fc1", "down": "fc2", "up": None}
    return {"prefix": "model.layers.{i}.mlp.", "sparse": "gate_proj", "down": "down_proj",
            "up": "up_proj"}


def _tokenizer_source() -> Path:
    return resolve_model(None, progress=False)


def _write_tokenizer(out: Path, vocab_size: int) -> int:
    """Copy the embedded tokenizer into `out`, padded to `vocab_size`; return its token count."""
    copy_tokenizer_files(_tokenizer_source(), out)
    tok = json.loads((out / "tokenizer.json").read_text())
    ids = set(tok["model"]["vocab"].values()) | {t["id"] for t in tok.get("added_tokens", [])}
    n = max(ids) + 1
    if vocab_size > n:
        # Placeholder tokens so every id the random lm_head can produce decodes to something.
        tok.setdefault("added_tokens", []).extend(
            {"id": i, "content": f"<|synthetic_{i}|>", "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True} for i in range(n, vocab_size))
        write_text_atomic(out / "tokenizer.json", json.dumps(tok, ensure_ascii=False))
        n = vocab_size
    return n


def _orthonormal_rows(rows: int, cols: int, key):
    """[rows, cols] float32 with orthonormal rows (rows <= cols), via QR of a Gaussian matrix."""
    rng = np.random.default_rng(key)
    q, _ = np.linalg.qr(rng.standard_normal((cols, rows)).astype(np.float32))
    return q.T.copy()


def synthetic_source(arch: str, out: Path, *, sparsity: float = 0.95, rank: int = DEFAULT_RANK,
                     seed: int = 0, dtype: str = "float16", progress: bool = True,
                     weight_sparsity: float = 0.0) -> dict:
    """The random weights of architecture `arch`, unevaluated, with `out` made an mlx-lm folder
    without weight files (config.json and the tokenizer).

    Every random draw is made here in one fixed order (MLX takes its key when an op is built), so
    the values depend only on the seed, however and whenever they are evaluated; a writer then
    computes each layer as it writes it (peak memory: about one layer). Only the predictor factors
    are computed now (a QR per layer; the progress bar counts them).
    weight_sparsity: fraction of every attention and FFN weight set to exactly 0 at uniformly random
    positions (unstructured pruning's shape, for ENDOR; the predictor then only approximates fc1).
    Returns {"config", "predictor": {layer: (A [rank, hidden], B [ffn, rank], bias [ffn])},
    "synthetic": label, "shards": {file name: {tensor name: unevaluated mx.array}}} (one shard
    for the top-level tensors, one per layer). float32 predictor factors are kept in memory
    (small: rank x (hidden+ffn)).
    """
    if arch not in ARCHS:
        raise FlashError(f"--synthetic {arch}: unknown architecture (choose from "
                         f"{', '.join([*ARCHS, *MOE_ARCHS])})")
    if not 0.0 < sparsity < 1.0:
        raise FlashError(f"--sparsity {sparsity}: must be between 0 and 1 (fraction of FFN neurons off)")
    if not 0.0 <= weight_sparsity < 1.0:
        raise FlashError(f"--weight-sparsity {weight_sparsity}: must be in [0, 1)")
    config = dict(ARCHS[arch])
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    ffn = config.get("ffn_dim") or config["intermediate_size"]
    rank = min(rank, hidden)
    out.mkdir(parents=True)
    n_tokens = _write_tokenizer(out, config["vocab_size"])
    vocab_note = None
    if n_tokens > config["vocab_size"]:
        vocab_note = (f"vocab_size {n_tokens} (the embedded tokenizer's) instead of "
                      f"{config['vocab_size']}: the tokenizer cannot be shrunk")
        config["vocab_size"] = n_tokens
    label = {"arch": arch, "sparsity": sparsity, "predictor_rank": rank, "seed": seed,
             "dtype": dtype, "note": "random weights in a real architecture's shape: "
                                     "for speed measurements only, never quality"}
    if vocab_note:
        label["vocab_note"] = vocab_note
    if weight_sparsity:
        label["weight_sparsity"] = weight_sparsity
    roles = ffn_roles(config)
    if config["model_type"] == "llama":
        config["mlp_bias"] = True
        config["hidden_act"] = "silu"
    else:
        config.update(activation_function="relu", do_layer_norm_before=True, enable_bias=True,
                      word_embed_proj_dim=hidden, tie_word_embeddings=True)
    config["synthetic"] = label
    target = getattr(mx, dtype)
    rng = np.random.default_rng(seed)
    mx.random.seed(seed)
    threshold = inverse_normal_cdf(sparsity)  # bias = -threshold: P(N(0,1) > threshold) = 1 - sparsity

    def normal(shape, std):
        return (mx.random.normal(shape) * std).astype(target)

    V = config["vocab_size"]
    attn_std = 1 / math.sqrt(hidden)
    if config["model_type"] == "opt":
        top = {"model.decoder.embed_tokens.weight": normal((V, hidden), 1.0),
               "model.decoder.embed_positions.weight": normal((config["max_position_embeddings"] + 2,
                                                              hidden), 0.1),
               "model.decoder.final_layer_norm.weight": mx.ones((hidden,), target),
               "model.decoder.final_layer_norm.bias": mx.zeros((hidden,), target)}
    else:
        top = {"model.embed_tokens.weight": normal((V, hidden), 1.0),
               "model.norm.weight": mx.ones((hidden,), target)}
        if not config["tie_word_embeddings"]:
            top["lm_head.weight"] = normal((V, hidden), attn_std)
    shards = {"model-top.safetensors": top}
    predictor = {}
    for i in tqdm(range(layers), desc=f"synthetic {arch} (predictors)", unit="layer",
                  disable=not progress, file=sys.stderr):
        p = roles["prefix"].format(i=i)
        A = _orthonormal_rows(rank, hidden, int(rng.integers(1 << 31)))
        B = rng.standard_normal((ffn, rank)).astype(np.float32)
        B /= np.linalg.norm(B, axis=1, keepdims=True)
        bias = np.full((ffn,), -threshold, np.float32)
        predictor[i] = (A, B, bias)
        w = {}
        if config["model_type"] == "opt":
            attn = p + "self_attn."
            for n in ("q_proj", "k_proj", "v_proj", "out_proj"):
                w[f"{attn}{n}.weight"] = normal((hidden, hidden), attn_std)
                w[f"{attn}{n}.bias"] = mx.zeros((hidden,), target)
            for n in ("self_attn_layer_norm", "final_layer_norm"):
                w[f"{p}{n}.weight"] = mx.ones((hidden,), target)
                w[f"{p}{n}.bias"] = mx.zeros((hidden,), target)
        else:
            lp = f"model.layers.{i}."
            kv = hidden // config["num_attention_heads"] * config["num_key_value_heads"]
            for n, rows in (("q_proj", hidden), ("k_proj", kv), ("v_proj", kv), ("o_proj", hidden)):
                w[f"{lp}self_attn.{n}.weight"] = normal((rows, hidden), attn_std)
            w[f"{lp}input_layernorm.weight"] = mx.ones((hidden,), target)
            w[f"{lp}post_attention_layernorm.weight"] = mx.ones((hidden,), target)
            w[f"{p}{roles['up']}.weight"] = normal((ffn, hidden), attn_std)
            w[f"{p}{roles['up']}.bias"] = mx.zeros((ffn,), target)
        w[f"{p}{roles['sparse']}.weight"] = (mx.array(B) @ mx.array(A)).astype(target)
        w[f"{p}{roles['sparse']}.bias"] = mx.array(bias).astype(target)
        # Down projection scaled so the FFN output has O(1) variance with (1 - sparsity) of neurons on.
        w[f"{p}{roles['down']}.weight"] = normal((hidden, ffn), 1 / math.sqrt((1 - sparsity) * ffn))
        w[f"{p}{roles['down']}.bias"] = mx.zeros((hidden,), target)
        if weight_sparsity:
            for k in [k for k, v in w.items() if k.endswith(".weight") and v.ndim == 2]:
                w[k] = mx.where(mx.random.uniform(shape=w[k].shape) < weight_sparsity, 0, w[k])
        shards[f"model-layer{i:03d}.safetensors"] = w
    write_config(out, config)
    return {"config": config, "predictor": predictor, "synthetic": label, "shards": shards}


def write_source_folder(arch: str, out: Path, *, progress: bool = True, **options) -> dict:
    """Write a random mlx-lm folder of architecture `arch` at `out` (one safetensors shard per
    layer); `options` as synthetic_source. Returns synthetic_source's dict without "shards"."""
    made = synthetic_source(arch, out, progress=progress, **options)
    shards = made.pop("shards")
    for name in tqdm(list(shards), desc=f"synthetic {arch}", unit="shard", disable=not progress,
                     file=sys.stderr):
        weights = shards.pop(name)
        mx.eval(weights)
        write_weights(out / name, weights)
    return made


def _load_order(tensors: dict) -> list:
    """The names of `tensors` in the order mx.load returns them from one safetensors file: the
    writer lists resident tensors in its source dict's order, so weights handed over in this
    order give the same resident.safetensors bytes as shards written and loaded back."""
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "names.safetensors")
        mx.save_safetensors(path, {name: mx.zeros((1,), mx.uint8) for name in tensors})
        return list(mx.load(path))


def write_synthetic_pack(arch: str, out, *, sparsity: float = 0.95, dtype: str = "float16",
                         quantize=None, group_size: int | None = None, rank: int = DEFAULT_RANK,
                         seed: int = 0, progress: bool = True, weight_sparsity: float = 0.0,
                         encoding: str = "dense") -> Path:
    """A flash pack of random weights shaped like `arch`, with an exact low-rank predictor
    (MoE shapes, MOE_ARCHS: write_synthetic_moe_pack, `quantize` bits, default 4, group size 32).
    group_size: None = 64 (dense) or 32 (MoE).

    Built in a temporary folder beside `out` and renamed into place. The random weights go to
    pack.write_pack unevaluated (synthetic_source): each layer is generated as it is written, never
    saved as a source shard (the pack's bytes are the same as converting written shards). The
    time is MLX's random draws and float32 matmul (CPU), which decide the bytes (OPT-6.7B, 50% zeros:
    docs/benchmarks.md). The manifest gets a top-level "synthetic" label. Returns `out`.
    """
    if arch in MOE_ARCHS:
        return write_synthetic_moe_pack(arch, out, bits=quantize or 4,
                                        group_size=group_size or MOE_GROUP_SIZE, seed=seed,
                                        progress=progress)
    group_size = group_size or 64
    out = Path(out).expanduser()
    t0 = time.perf_counter()
    with atomic_output_dir(out) as tmp:
        src = tmp / "source"
        made = synthetic_source(arch, src, sparsity=sparsity, rank=rank, seed=seed, dtype=dtype,
                                progress=progress, weight_sparsity=weight_sparsity)
        pack = tmp / "pack"
        # The weights go to the writer unevaluated: each layer is computed as it is written, with
        # no source shards written, read back and deleted (13 GB for OPT-6.7B float16).
        shards = made.pop("shards")
        weights = {k: shards[name][k] for name in sorted(shards) for k in _load_order(shards[name])}
        del shards
        write_pack(src, pack, dtype=dtype, quantize=quantize, group_size=group_size,
                   progress=progress, encoding=encoding, weights=weights)
        del weights
        shutil.rmtree(src)
        label = dict(made["synthetic"], quantize=quantize,
                     group_size=group_size if quantize else None,
                     seconds_to_build=round(time.perf_counter() - t0, 1))
        write_manifest(pack, {**read_manifest(pack).fields, "synthetic": label, "source": {"synthetic": arch}})
        write_predictor(pack, made["predictor"], made["config"])
        for f in pack.iterdir():  # the pack's files become the output folder itself
            f.rename(tmp / f.name)
        pack.rmdir()
    return out


def _random_quantized(rng, shape, std, bits, group_size) -> dict:
    """{"weight", "scales", "biases"} numpy arrays of an MLX affine-quantized [*lead, out, in] matrix:
    uniform random codes, per-group scales drawn around std / std(codes) (x0.5..1.5) and biases
    centring the codes, so the dequantized weights have mean ~0 and std ~`std`."""
    *lead, n_out, n_in = shape
    if n_in % group_size:
        raise FlashError(f"--group-size {group_size}: does not divide the input width {n_in}")
    rows = int(np.prod(lead, dtype=np.int64)) * n_out
    words = np.frombuffer(rng.bytes(rows * n_in * bits // 8), np.uint32)
    levels = 2 ** bits
    scale = std / math.sqrt((levels ** 2 - 1) / 12)
    groups = (*lead, n_out, n_in // group_size)
    scales = (scale * rng.uniform(0.5, 1.5, groups)).astype(np.float16)
    biases = (-scales.astype(np.float32) * (levels - 1) / 2).astype(np.float16)
    return {"weight": words.reshape(*lead, n_out, n_in * bits // 32), "scales": scales,
            "biases": biases}


def moe_tensor_shapes(config: dict) -> dict:
    """{mlx-lm tensor base name: (shape, std) for quantized linears, or (shape, "ones"/"router")}
    of a synthetic MoE model, in write order (top-level first, then each layer)."""
    hidden, n_layers = config["hidden_size"], config["num_hidden_layers"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    inter = config.get("moe_intermediate_size") or config["intermediate_size"]
    experts, vocab = config["num_experts"], config["vocab_size"]
    per_head_norm = config["model_type"] == "qwen3_moe"  # olmoe normalises the whole q / k
    out = {"model.embed_tokens": ((vocab, hidden), 1.0), "model.norm": ((hidden,), "ones"),
           "lm_head": ((vocab, hidden), 1 / math.sqrt(hidden))}
    for i in range(n_layers):
        lp = f"model.layers.{i}."
        a = lp + "self_attn."
        out.update({
            lp + "input_layernorm": ((hidden,), "ones"),
            lp + "post_attention_layernorm": ((hidden,), "ones"),
            a + "q_proj": ((heads * head_dim, hidden), 1 / math.sqrt(hidden)),
            a + "k_proj": ((kv * head_dim, hidden), 1 / math.sqrt(hidden)),
            a + "v_proj": ((kv * head_dim, hidden), 1 / math.sqrt(hidden)),
            a + "o_proj": ((hidden, heads * head_dim), 1 / math.sqrt(heads * head_dim)),
            a + "q_norm": ((head_dim if per_head_norm else heads * head_dim,), "ones"),
            a + "k_norm": ((head_dim if per_head_norm else kv * head_dim,), "ones"),
            lp + "mlp.gate": ((experts, hidden), "router"),
            lp + "mlp.switch_mlp.gate_proj": ((experts, inter, hidden), 1 / math.sqrt(hidden)),
            lp + "mlp.switch_mlp.up_proj": ((experts, inter, hidden), 1 / math.sqrt(hidden)),
            lp + "mlp.switch_mlp.down_proj": ((experts, hidden, inter), 1 / math.sqrt(inter)),
        })
    return out


def write_moe_source_folder(arch: str, out: Path, *, bits: int = 4, group_size: int = MOE_GROUP_SIZE,
                            seed: int = 0, progress: bool = True) -> dict:
    """Write a random, already quantized mlx-lm MoE folder of `arch` (MOE_ARCHS) at `out`.

    One safetensors shard for the top-level tensors and one per layer, generated and written
    tensor by tensor (peak memory: one layer's tensors; OLMoE-1B-7B ~0.25 GB, Qwen3-30B-A3B
    ~0.4 GB at 4 bits), with a progress bar in bytes. Returns {"config", "synthetic": label}.
    """
    if arch not in MOE_ARCHS:
        raise FlashError(f"--synthetic {arch}: not an MoE architecture ({', '.join(MOE_ARCHS)})")
    if bits not in (4, 8):
        raise FlashError(f"--quantize {bits}: synthetic MoE packs are written quantized (4 or 8)")
    config = dict(MOE_ARCHS[arch])
    out.mkdir(parents=True)
    n_tokens = _write_tokenizer(out, config["vocab_size"])
    label = {"arch": arch, "seed": seed, "quantize": bits, "group_size": group_size,
             "note": "random weights in a real MoE architecture's shape: for speed measurements "
                     "only, never quality; random routers (hit rates describe this random "
                     "model's routing, not a trained model's)"}
    if n_tokens > config["vocab_size"]:
        label["vocab_note"] = (f"vocab_size {n_tokens} (the embedded tokenizer's) instead of "
                               f"{config['vocab_size']}: the tokenizer cannot be shrunk")
        config["vocab_size"] = n_tokens
    config["quantization"] = {"group_size": group_size, "bits": bits}
    config["quantization_config"] = dict(config["quantization"])
    config["synthetic"] = label
    shapes = moe_tensor_shapes(config)

    def nbytes(shape, kind):
        n = int(np.prod(shape, dtype=np.int64))
        return 2 * n if isinstance(kind, str) else n * bits // 8 + n // group_size * 4

    shards = {}
    for name, spec in shapes.items():
        shard = (f"model-layer{int(name.split('.')[2]):03d}.safetensors"
                 if name.startswith("model.layers.") else "model-top.safetensors")
        shards.setdefault(shard, []).append((name, spec))
    rng = np.random.default_rng(seed)
    total = sum(nbytes(*spec) for spec in shapes.values())
    with tqdm(total=total, desc=f"synthetic {arch} ({bits}-bit)", unit="B", unit_scale=True,
              disable=not progress, file=sys.stderr) as bar:
        for shard, names in shards.items():
            tensors = {}
            for name, (shape, kind) in names:
                if kind == "ones":
                    tensors[f"{name}.weight"] = mx.ones(shape, mx.float16)
                elif kind == "router":
                    tensors[f"{name}.weight"] = mx.array(
                        (rng.standard_normal(shape, np.float32) / math.sqrt(shape[-1])).astype(np.float16))
                else:
                    q = _random_quantized(rng, shape, kind, bits, group_size)
                    tensors.update({f"{name}.{k}": mx.array(v) for k, v in q.items()})
                bar.update(nbytes(shape, kind))
            write_weights(out / shard, tensors)
            del tensors
    write_config(out, config)
    return {"config": config, "synthetic": label}


def write_synthetic_moe_pack(arch: str, out, *, bits: int = 4, group_size: int = MOE_GROUP_SIZE,
                             seed: int = 0, progress: bool = True) -> Path:
    """A flash pack of a random `bits`-bit MoE model shaped like `arch` (MOE_ARCHS).

    The quantized source is written beside `out`, converted (pack.write_pack streams it layer by
    layer) and deleted; disk needs about twice the pack's size while it runs (OLMoE-1B-7B 4-bit:
    a 5.2 GB pack, Qwen3-30B-A3B 4-bit: ~23 GB; float32 scales). Labelled synthetic in config and manifest.
    """
    out = Path(out).expanduser()
    t0 = time.perf_counter()
    with atomic_output_dir(out) as tmp:
        src = tmp / "source"
        made = write_moe_source_folder(arch, src, bits=bits, group_size=group_size, seed=seed,
                                       progress=progress)
        pack = tmp / "pack"
        # float32 floats (scales, biases, norms, routers; their values stay float16 numbers, so
        # the Q4_1 export is still exact): MLX's CPU gather_qmm with float16 scales is ~25x
        # slower than with float32 (8 experts of 1024 x 2048: 2.3 s vs 0.09 s, loaded machine)
        write_pack(src, pack, dtype="float32", progress=progress)
        shutil.rmtree(src)
        label = dict(made["synthetic"], seconds_to_build=round(time.perf_counter() - t0, 1),
                     float_dtype="float32 (float16 values)")
        write_manifest(pack, {**read_manifest(pack).fields, "synthetic": label,
                              "source": {"synthetic": arch}})
        for f in pack.iterdir():
            f.rename(tmp / f.name)
        pack.rmdir()
    return out


def analytic_capacity(n_neurons: int, active: float, max_window: int, z: float = 2.326) -> list:
    """Req_i for windows 1..max_window: 99th percentile (z = 2.326) of the union of active neurons
    over w tokens if tokens fired independently (Binomial(n, 1 - (1 - active)^w)); real text reuses
    neurons across tokens, so this is an upper bound."""
    caps = []
    for w in range(1, max_window + 1):
        p = 1 - (1 - active) ** w
        caps.append(int(min(n_neurons, math.ceil(n_neurons * p + z * math.sqrt(n_neurons * p * (1 - p))))))
    return caps


def write_predictor(pack: Path, predictor: dict, config: dict, max_window: int = 8) -> None:
    """Store the exact low-rank predictors in the pack, in mlx_flash.sparse.predictor's format
    (kind "low-rank", prob_threshold 0.5: predicted iff B (A x) + bias > 0, i.e. iff up x + b > 0)."""
    label = config["synthetic"]
    active = 1 - label["sparsity"]
    layers, factors = {}, {}
    for i, (A, B, bias) in predictor.items():
        n = B.shape[0]
        layers[i] = {"kind": "low-rank", "n_neurons": n, "rank": int(A.shape[0]), "threshold": 0.0,
                     "prob_threshold": 0.5,
                     "stats": {"note": "synthetic: exact by construction (up = B @ A)",
                               "designed_active_fraction": active},
                     "capacity": analytic_capacity(n, active, max_window)}
        factors[i] = {"A": mx.array(A), "B": mx.array(B), "bias": mx.array(bias)}
    activation = "relu" if config["model_type"] == "opt" else "silu"
    meta = {"activation": activation,
            "calibration": {"synthetic": True, "method": "exact low-rank factors of the synthetic "
                            "up/gate projection; capacity analytic (independent tokens, 99th pct)"}}
    save_predictors(pack, meta, layers, factors)


def is_synthetic(pack_dir) -> dict | None:
    """The pack's synthetic label, or None for a pack converted from a real model."""
    try:
        return read_manifest(pack_dir).synthetic
    except FlashError:
        return None
