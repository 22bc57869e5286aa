"""The notebook API: load(), generate(), stream_generate()."""

import pytest

import mlx_flash
from mlx_flash.errors import FlashError


@pytest.fixture(scope="module")
def loaded(embedded_model_dir):
    return mlx_flash.load(str(embedded_model_dir))


def test_generate_matches_stream(loaded):
    model, tokenizer = loaded
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Name a color."}], add_generation_prompt=True)
    text = mlx_flash.generate(model, tokenizer, prompt, max_tokens=8)
    responses = list(mlx_flash.stream_generate(model, tokenizer, prompt, max_tokens=8))
    assert text == "".join(r.text for r in responses) and text
    last = responses[-1]
    assert last.generation_tokens == len(responses) <= 8
    assert last.prompt_tokens == len(prompt) and last.peak_memory > 0


def test_prompt_too_long(loaded):
    model, tokenizer = loaded
    with pytest.raises(FlashError, match="longer than the model's context"):
        next(mlx_flash.stream_generate(model, tokenizer, [1] * 9000, max_tokens=1))


def test_unknown_options():
    with pytest.raises(FlashError, match="--mode warp: unknown mode"):
        mlx_flash.load(mode="warp")
    with pytest.raises(TypeError, match="unknown options"):
        mlx_flash.load(windw=3)
