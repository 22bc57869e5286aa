"""Limits and flags: generation stays inside the model's context, token ids inside the embedding
table, sampling flags finite; the CPU ops refuse out-of-range ids / row counts on the kernel and
on its MLX twin alike (they used to disagree or read past the table)."""

import io
import sys

import mlx.core as mx
import pytest

from mlx_flash.api import generate, stream_generate
from mlx_flash.cpu import ops
from mlx_flash.errors import FlashError


@pytest.fixture(scope="module")
def small_context_model(embedded_model_dir):
    from mlx_flash import load

    model, tokenizer = load(str(embedded_model_dir), progress=False)
    model.args.max_position_embeddings = 64  # a 64-token context, as the case
    return model, tokenizer


def test_prompt_plus_max_tokens_must_fit_the_context(small_context_model):
    model, tokenizer = small_context_model
    prompt = list(range(100, 161))  # 61 tokens
    with pytest.raises(FlashError, match=r"--max-tokens 40: the prompt's 61 tokens plus 40 exceed the model's context of 64 tokens \(at most 3 fit\)"):
        generate(model, tokenizer, prompt, max_tokens=40)
    assert len(list(stream_generate(model, tokenizer, prompt, max_tokens=-1))) <= 3
    assert len(list(stream_generate(model, tokenizer, prompt, max_tokens=3))) <= 3


def test_token_ids_past_the_embedding_table_are_refused(small_context_model):
    model, tokenizer = small_context_model
    vocab = model.args.vocab_size
    for bad in (vocab, 10 ** 9, -1):
        with pytest.raises(FlashError, match=f"token id {bad} is outside the embedding table"):
            generate(model, tokenizer, [1, 2, bad], max_tokens=2)


@pytest.mark.parametrize("flags, match", [
    (["--temp", "nan"], "--temp nan: must be a finite number"),
    (["--temp", "inf"], "--temp inf: must be a finite number"),
    (["--seed", "-1"], r"--seed -1: must be in 0..2\^63-1"),
    (["--top-p", "nan"], r"--top-p nan: must be in \(0, 1\]"),
])
def test_bad_sampling_flags_are_one_line(flags, match, capsys):
    from mlx_flash.generate import main

    with pytest.raises(SystemExit) as e:
        main(["--model", "/nonexistent", *flags])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1
    import re

    assert re.search(match, err), err


def test_non_utf8_stdin_is_one_line(monkeypatch, capsys):
    from mlx_flash.generate import main

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9 \xff")))
    with pytest.raises(SystemExit) as e:
        main(["--model", "/nonexistent", "--prompt", "-"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "--prompt -: stdin is not UTF-8 text (byte 0xe9 at offset 3)" in err


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "mlx-twin"])
def test_ops_refuse_out_of_range_inputs_on_both_paths(kernels):
    w, s, b = mx.quantize(mx.random.normal((16, 64), key=mx.random.key(0)), group_size=32, bits=4)
    half = mx.random.normal((8, 64), key=mx.random.key(1)).astype(mx.float16)
    x = mx.random.normal((1, 64), key=mx.random.key(2))
    was = ops.kernels_active()
    ops.set_kernels_enabled(kernels)
    try:
        for ids in ([0, 16], [-1], [2 ** 31 - 1]):
            with pytest.raises(ValueError, match="outside the table's rows 0..15"):
                ops.quantized_embedding(mx.array(ids), w, s, b, 32, 4)
        assert ops.quantized_embedding(mx.array([0, 15]), w, s, b, 32, 4).shape == (2, 64)
        for n in (-1, 9, 2.5, True):
            with pytest.raises(ValueError, match="must be an integer in 0..8"):
                ops.gather_matvec(x, half, n=n)
            with pytest.raises(ValueError, match="must be an integer in 0..8"):
                ops.gather_matvec_t(mx.ones((1, 8)), half, n=n)
        assert ops.gather_matvec(x, half, n=8).shape == (1, 8)
        assert ops.gather_matvec(x, half, n=0).shape == (1, 0)
    finally:
        ops.set_kernels_enabled(was)
