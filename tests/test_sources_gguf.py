"""GGUF import checked against an independent implementation: transformers + torch reading the
same file (its own GGUF parser, dequantizer and tokenizer builder)."""

import numpy as np
import pytest

import mlx.core as mx

from mlx_flash.errors import FlashError
from mlx_flash.sources.gguf import read_gguf_header, unpermute_rows

gguf = pytest.importorskip("gguf")


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
