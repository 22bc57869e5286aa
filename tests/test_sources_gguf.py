"""GGUF import checked against an independent implementation: transformers + torch reading the
same file (its own GGUF parser, dequantizer and tokenizer builder). GGUF metadata is untrusted
input: values that disagree with the tensors the file holds give one FlashError line naming the key."""

import struct

import numpy as np
import pytest

import mlx.core as mx

from mlx_flash.errors import FlashError
from mlx_flash.sources.gguf import gguf_config, gguf_to_mlx, read_gguf_header, unpermute_rows

gguf = pytest.importorskip("gguf")
# the transformers reference (conftest.reference) is built once, in one test process
pytestmark = pytest.mark.xdist_group("gguf_reference")


def _dequantized(model, path):
    layer = model
    for part in path.split("."):
        layer = layer[int(part)] if part.isdigit() else getattr(layer, part)
    if hasattr(layer, "scales"):
        f32 = mx.float32  # dequantize in float32 so nothing is rounded on our side
        return np.array(mx.dequantize(layer.weight, layer.scales.astype(f32), layer.biases.astype(f32),
                                      layer.group_size, layer.bits))
    return np.array(layer.weight.astype(mx.float32))


def test_weights_equal_reference_dequantization(reference, ours):
    """Every weight, dequantized, equals transformers' dequantization of the GGUF block data.

    Q4_1/Q8_0 values are d*q+m with float16 d, m and small integer q: exact in float32 on both
    sides, so equality is exact. Covers llama.cpp's q/k row permutation (the known trap)."""
    ref_state = reference[1].state_dict()
    model = ours[1]
    checked = 0
    for name, ref in ref_state.items():
        if name == "lm_head.weight":  # tied to embed_tokens
            continue
        path = name.removesuffix(".weight")
        np.testing.assert_array_equal(_dequantized(model, path), ref.numpy(), err_msg=name)
        checked += 1
    assert checked == 2 + 30 * 9


def _fp16_ulp(x):
    return 2.0 ** (np.floor(np.log2(np.abs(x).max())) - 10)


def test_logits_and_greedy_match_reference(reference, ours):
    import torch

    tokenizer, model = ours
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. Flash memory is", add_special_tokens=False)
    with torch.no_grad():
        ref = reference[1](torch.tensor([ids])).logits[0].numpy()
    got = np.array(model(mx.array([ids]))[0].astype(mx.float32))
    # Our activations run in float16 (the dtype of the GGUF scales), so logits carry float16
    # rounding: allow 4 float16 ulps at the largest logit magnitude (0.0625 for |logit| < 32).
    np.testing.assert_allclose(got, ref, rtol=0, atol=4 * _fp16_ulp(ref))
    assert (got.argmax(-1) == ref.argmax(-1)).all()

    # Greedy continuation: 16 tokens agree.
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    with torch.no_grad():
        ref_out = reference[1].generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
    our_out = [int(t) for t, _ in zip((t for t, _ in generate_step(mx.array(ids), model, sampler=make_sampler(0.0))), range(16))]
    assert our_out == ref_out


def test_unpermute_inverts_llama_cpp_permutation():
    # llama.cpp's converter: reshape(heads, 2, d/2, ...).swapaxes(1, 2).reshape(...)
    heads, head_dim, cols = 3, 8, 5
    w = np.arange(heads * head_dim * cols, dtype=np.float32).reshape(heads * head_dim, cols)
    permuted = w.reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(np.array(unpermute_rows(mx.array(permuted), heads)), w)


# --- bad input -------------------------------------------------------------------------------

def _write_gguf(path, tensor_type, arch="llama"):
    """A tiny GGUF written by the independent `gguf` package writer."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    if tensor_type == gguf.GGMLQuantizationType.F32:
        writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    else:
        block_size, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
        raw = np.zeros((4, 256 // block_size * type_size), dtype=np.uint8)
        writer.add_tensor("token_embd.weight", raw, raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_quantization_is_named(tmp_path):
    path = _write_gguf(tmp_path / "k.gguf", gguf.GGMLQuantizationType.Q4_K)
    with pytest.raises(FlashError, match=r"k\.gguf.*Q4_K.*not import"):
        read_gguf_header(path)


def test_truncated_gguf_is_refused(tmp_path):
    path = _write_gguf(tmp_path / "t.gguf", gguf.GGMLQuantizationType.F32)
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(FlashError, match=r"t\.gguf: file is truncated: tensor 'token_embd.weight'"):
        read_gguf_header(path)
    path.write_bytes(data[:40])
    with pytest.raises(FlashError, match=r"t\.gguf: .*truncated"):
        read_gguf_header(path)


def test_corrupt_gguf_is_refused(tmp_path):
    path = tmp_path / "c.gguf"
    path.write_bytes(b"GGML" + b"\0" * 64)
    with pytest.raises(FlashError, match=r"c\.gguf: not a GGUF file"):
        read_gguf_header(path)
    good = _write_gguf(tmp_path / "g.gguf", gguf.GGMLQuantizationType.F32).read_bytes()
    bad = bytearray(good)
    bad[16:24] = (10**15).to_bytes(8, "little")  # absurd key count
    path.write_bytes(bytes(bad))
    with pytest.raises(FlashError, match=r"c\.gguf: corrupt GGUF header"):
        read_gguf_header(path)


def test_unsupported_architecture_is_named(tmp_path):
    from mlx_flash.sources.gguf import gguf_config

    path = _write_gguf(tmp_path / "a.gguf", gguf.GGMLQuantizationType.F32, arch="mamba")
    with pytest.raises(FlashError, match=r"a\.gguf: GGUF architecture 'mamba' is not supported"):
        gguf_config(read_gguf_header(path))


# ---- metadata checked against the tensors (a tiny GGUF written by the gguf package) ----

HIDDEN, FFN, VOCAB, LAYERS = 64, 96, 256, 2
BLOCK = {"attn_norm": (HIDDEN,), "ffn_norm": (HIDDEN,), "attn_q": (HIDDEN, HIDDEN),
         "attn_k": (HIDDEN // 2, HIDDEN), "attn_v": (HIDDEN // 2, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
         "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}


def write_tiny_gguf(path, layers=LAYERS):
    """A tiny float32 llama GGUF (random weights) written by the `gguf` package's writer."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_uint32("general.alignment", 32)
    w.add_tokenizer_model("gpt2")  # byte-level BPE with the 256 byte tokens and no merges
    w.add_token_list(byte_tokens())
    w.add_token_types([1] * 256)
    w.add_tensor("token_embd.weight", rng.standard_normal((VOCAB, HIDDEN), dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    for i in range(layers):
        for name, shape in BLOCK.items():
            w.add_tensor(f"blk.{i}.{name}.weight", rng.standard_normal(shape, dtype=np.float32) * 0.05)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def byte_tokens():
    """GPT-2's byte-to-unicode table: the 256 single-byte tokens of a byte-level BPE."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def patch_uint32(path, key, value, type_id=4):
    """Overwrite the uint32 (or other scalar) value of metadata `key` in place."""
    raw = bytearray(path.read_bytes())
    k = key.encode()
    at = raw.index(struct.pack("<Q", len(k)) + k) + 8 + len(k)
    assert struct.unpack_from("<I", raw, at)[0] == type_id
    fmt = {4: "<I", 6: "<f"}[type_id]
    struct.pack_into(fmt, raw, at + 4, value)
    path.write_bytes(bytes(raw))


@pytest.fixture
def tiny_gguf(tmp_path):
    return write_tiny_gguf(tmp_path / "tiny.gguf")


def test_tiny_gguf_reads(tiny_gguf):
    config, weights = gguf_to_mlx(tiny_gguf)
    assert config["num_hidden_layers"] == LAYERS and config["vocab_size"] == VOCAB
    assert weights["model.layers.1.mlp.up_proj.weight"].shape == (FFN, HIDDEN)


@pytest.mark.parametrize("key, value, type_id, match", [
    ("general.alignment", 0, 4, r"general\.alignment = 0, must be a power of two"),
    ("general.alignment", 48, 4, r"general\.alignment = 48"),
    ("llama.block_count", 1000, 4, r"llama\.block_count = 1000, but the file holds tensors for 2 blocks"),
    ("llama.block_count", 1, 4, r"llama\.block_count = 1, but the file holds tensors for 2 blocks"),
    ("llama.block_count", 0, 4, r"llama\.block_count = 0 is out of range"),
    ("llama.embedding_length", 32, 4, r"llama\.embedding_length = 32, but token_embd\.weight"),
    ("llama.feed_forward_length", 4096, 4, r"llama\.feed_forward_length = 4096, but blk\.0\.ffn_up"),
    ("llama.attention.head_count", 0, 4, r"llama\.attention\.head_count = 0 is out of range"),
    ("llama.attention.head_count", 5, 4, r"llama\.attention\.head_count = 5 .* does not divide"),
    ("llama.attention.layer_norm_rms_epsilon", float("nan"), 6, r"layer_norm_rms_epsilon = nan"),
])
def test_bad_metadata_is_one_line(tiny_gguf, key, value, type_id, match):
    patch_uint32(tiny_gguf, key, value, type_id)
    with pytest.raises(FlashError, match=match) as e:
        gguf_config(read_gguf_header(tiny_gguf))
    assert "\n" not in str(e.value) and "tiny.gguf" in str(e.value)


def test_bad_metadata_through_the_cli_is_one_line_exit_2(tiny_gguf):
    import subprocess
    import sys

    patch_uint32(tiny_gguf, "llama.block_count", 1000)
    p = subprocess.run([sys.executable, "-m", "mlx_flash.generate", "--model", str(tiny_gguf),
                        "--prompt", "hi", "--max-tokens", "1"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "block_count = 1000" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr


@pytest.mark.parametrize("name", ["blk.ffn_up.weight", "blk.x.ffn_up.weight", "blk.0.nope.weight", "what.weight"])
def test_malformed_tensor_names_are_one_line(name):
    from mlx_flash.sources.gguf import mlx_name

    with pytest.raises(FlashError, match="unknown GGUF tensor"):
        mlx_name(name)


def test_qwen3_moe_gguf_imports_experts_and_router(tmp_path):
    """llama.cpp's MoE names (ffn_gate_inp, ffn_*_exps [E, out, in]) -> mlx-lm's qwen3_moe."""
    import mlx.core as mx
    from conftest import write_tiny_moe
    from mlx.utils import tree_flatten

    from mlx_flash.models import build_model, load_model
    from mlx_flash.sources.gguf import _BLOCK_NAMES, _GLOBAL_NAMES, gguf_to_mlx

    src = write_tiny_moe(tmp_path / "src", "qwen3_moe", experts=4)
    model, config = load_model(src, lazy=False)
    to_gguf = {v: k for k, v in {**_BLOCK_NAMES, **_GLOBAL_NAMES}.items()}
    # llama.cpp's own MoE names, spelled out here (not read back from the module under test)
    to_gguf.update({"mlp.gate": "ffn_gate_inp", "mlp.switch_mlp.gate_proj": "ffn_gate_exps",
                    "mlp.switch_mlp.up_proj": "ffn_up_exps", "mlp.switch_mlp.down_proj": "ffn_down_exps"})
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "qwen3moe")
    for key, value in (("block_count", config["num_hidden_layers"]), ("context_length", 256),
                       ("embedding_length", config["hidden_size"]),
                       ("feed_forward_length", config["intermediate_size"]),
                       ("attention.head_count", 4), ("attention.head_count_kv", 2),
                       ("attention.key_length", 16), ("expert_count", 4), ("expert_used_count", 2),
                       ("expert_feed_forward_length", config["moe_intermediate_size"]),
                       ("vocab_size", config["vocab_size"])):
        writer.add_uint32(f"qwen3moe.{key}", value)
    writer.add_float32("qwen3moe.rope.freq_base", config["rope_theta"])
    writer.add_float32("qwen3moe.attention.layer_norm_rms_epsilon", config["rms_norm_eps"])
    for name, arr in tree_flatten(model.parameters()):
        base, _, suffix = name.rpartition(".")
        if base.startswith("model.layers."):
            _, _, layer, part = base.split(".", 3)
            gname = f"blk.{layer}.{to_gguf[part]}.{suffix}"
        else:
            gname = f"{to_gguf[base]}.{suffix}"
        writer.add_tensor(gname, np.array(arr))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cfg, weights = gguf_to_mlx(tmp_path / "m.gguf")
    assert cfg["model_type"] == "qwen3_moe" and cfg["num_experts"] == 4 and cfg["norm_topk_prob"]
    assert weights["model.layers.1.mlp.switch_mlp.gate_proj.weight"].shape == (4, 64, 64)
    imported = build_model(cfg, weights)
    imported.load_weights(list(weights.items()), strict=True)
    tokens = mx.array([[1, 7, 30, 99, 5]])
    np.testing.assert_array_equal(np.array(imported(tokens)), np.array(model(tokens)))
