"""GGUF export of MoE packs: lossless Q4_1 relayout, read back by MLX's own GGUF reader and by
llama.cpp (logits compared with ours)."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_flash.convert import main as convert_main
from mlx_flash.errors import FlashError
from mlx_flash.pack import load_pack_weights
from mlx_flash.sources import default_gguf_path, write_moe_gguf
from mlx_flash.sources.gguf import gguf_name, gguf_to_mlx, mlx_name
from mlx_flash.sources.gguf_export import mlx_to_q4_1

pytest.importorskip("gguf")


@pytest.fixture(scope="module", params=["olmoe-tiny", "qwen3-moe-tiny"])
def moe_pack(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("moe") / request.param
    assert convert_main(["--synthetic", request.param, "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def moe_gguf(moe_pack, tmp_path_factory):
    """The pack's GGUF export, shared by the tests that only read it (each export parses the
    embedded GGUF's tokenizer, 49152 tokens and their merges: ~5 s on one core)."""
    return write_moe_gguf(moe_pack, tmp_path_factory.mktemp("export") / "m.gguf", default_gguf_path())


def write_tokenizer_gguf(path):
    """A GGUF holding only a gpt2-style tokenizer: the 256 byte tokens and one merge."""
    import gguf
    from test_sources_gguf import byte_tokens

    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(byte_tokens())
    w.add_token_types([1] * 256)
    w.add_token_merges(["\u0120 t"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_q4_1_blocks_hold_the_same_values():
    rng = np.random.default_rng(0)
    w = mx.array(rng.standard_normal((3, 64)).astype(np.float32))
    q, s, b = mx.quantize(w.astype(mx.float16), group_size=32, bits=4)
    blocks = mlx_to_q4_1(np.array(q), np.array(s), np.array(b)).reshape(3, 2, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 4:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # Q4_1: byte j = codes j, j + 16
    ours = (d[..., None] * codes + m[..., None]).reshape(3, 64)
    ref = np.array(mx.dequantize(q, s, b, group_size=32, bits=4).astype(mx.float32))
    np.testing.assert_allclose(ours, ref, rtol=1e-3, atol=1e-3)


def test_q4_1_takes_float32_scales_only_when_they_are_float16_values():
    q = np.zeros((1, 4), np.uint32)
    exact = mlx_to_q4_1(q, np.array([[0.5]], np.float32), np.array([[-1.25]], np.float32))
    assert exact[0, :2].view(np.float16)[0] == 0.5
    with pytest.raises(FlashError, match="float16 cannot represent"):
        mlx_to_q4_1(q, np.array([[1 / 3]], np.float32), np.array([[0.0]], np.float32))


def test_gguf_names_invert_mlx_names():
    for name in ("blk.0.ffn_gate_exps.weight", "blk.11.ffn_gate_inp.weight", "blk.2.attn_q_norm.weight",
                 "token_embd.scales", "output.weight", "output_norm.weight"):
        assert gguf_name(mlx_name(name)) == name
    with pytest.raises(FlashError, match="no GGUF name"):
        gguf_name("model.layers.0.mlp.experts.weight")


def test_export_is_lossless(moe_pack, moe_gguf):
    out = moe_gguf
    config, weights = gguf_to_mlx(out)  # MLX's reader turns Q4_1 blocks back into affine triples
    _, pack = load_pack_weights(moe_pack)
    assert set(weights) == set(pack)
    for name, ref in pack.items():
        got = weights[name]
        if ref.dtype != mx.uint32:
            ref, got = ref.astype(mx.float32), got.astype(mx.float32)
        assert np.array_equal(np.array(got), np.array(ref)), name
    assert config["quantization"] == {"group_size": 32, "bits": 4}
    assert config["num_experts"] == 8 and config["num_experts_per_tok"] == 2
    assert not list(out.parent.glob(".*"))


def test_export_refuses_a_lossy_quantization(tmp_path):
    pack = tmp_path / "q8"
    assert convert_main(["--synthetic", "olmoe-tiny", "--quantize", "8", "--out", str(pack)]) == 0
    with pytest.raises(FlashError, match="8-bit group-32 quantization has no lossless"):
        write_moe_gguf(pack, tmp_path / "m.gguf", default_gguf_path())
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".*"))


def test_llama_cpp_runs_the_export_with_our_logits(moe_pack, moe_gguf):
    llama_cpp = pytest.importorskip("llama_cpp")
    from mlx_flash.config import FlashConfig
    from mlx_flash.models.moe import build_moe_model

    gguf_path = moe_gguf
    tokens = [1, 2, 3, 400, 5000, 17, 9, 33]
    ours = build_moe_model(moe_pack, FlashConfig(mode="dense"))(mx.array([tokens]))[0]
    ours = np.array(ours.astype(mx.float32))
    llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=64, logits_all=True, verbose=False,
                          n_threads=2)
    llm.eval(tokens)
    theirs = np.array(llm.scores[: len(tokens)])
    # llama.cpp multiplies Q4_1 weights by Q8_1-quantized activations: ~1% apart (measured
    # 0.009 olmoe, 0.010 qwen3moe); a wrong layout, router or norm gives O(1)
    assert np.linalg.norm(theirs - ours) / np.linalg.norm(ours) < 0.03


def test_gpt2_export_of_an_opt_pack_holds_its_tensors_and_lands_whole(tmp_path):
    """The llama.cpp peer's GGUF of an OPT-shaped pack (bench run --peers llama.cpp) holds the
    pack's tensors bit for bit and the embedded tokenizer padded to the pack's vocabulary; it
    lands whole or not at all; llama.cpp runs it."""
    import gguf

    from mlx_flash.sources.gguf_export import write_gpt2_gguf

    pack = tmp_path / "opt-tiny"
    assert convert_main(["--synthetic", "opt-tiny", "--out", str(pack)]) == 0
    out = write_gpt2_gguf(pack, tmp_path / "m.gguf", default_gguf_path())
    config, w = load_pack_weights(pack)
    reader = gguf.GGUFReader(out)
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 4 + 12 * config["num_hidden_layers"]
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == config["vocab_size"]
    fc1 = np.array(w["model.decoder.layers.1.fc1.weight"].astype(mx.float32))
    got = tensors["blk.1.ffn_up.weight"]
    assert np.array_equal(np.asarray(got.data, np.float32).reshape(fc1.shape), fc1)
    k = np.array(w["model.decoder.layers.0.self_attn.k_proj.weight"])
    qkv = np.asarray(tensors["blk.0.attn_qkv.weight"].data).reshape(3 * k.shape[0], -1)
    assert np.array_equal(qkv[k.shape[0]: 2 * k.shape[0]], k)
    assert not list(tmp_path.glob(".*"))
    (tmp_path / "blocked").mkdir()  # a folder where the file should go: one line naming it
    tokenizer = write_tokenizer_gguf(tmp_path / "tokenizer.gguf")  # read in ms, not ~5 s
    with pytest.raises(FlashError, match="blocked: cannot write"):
        write_gpt2_gguf(pack, tmp_path / "blocked", tokenizer)
    assert not list(tmp_path.glob(".*"))
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(out), n_ctx=64, verbose=False)
    tokens = [t for _, t in zip(range(3), llm.generate([1, 2, 3], top_k=1, temp=0.0))]
    assert len(tokens) == 3
