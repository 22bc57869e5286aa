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


def test_greedy_generate_equals_an_argmax_loop(loaded):
    """Independent of mlx-lm's generation loop: greedy decoding by hand, one token per step
    through a KV cache, gives the same tokens as generate()."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = loaded
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Name a color."}], add_generation_prompt=True)
    got = [r.token for r in mlx_flash.stream_generate(model, tokenizer, prompt, max_tokens=8)]
    cache, ids, want = make_prompt_cache(model), prompt, []
    for _ in range(len(got)):
        logits = model(mx.array([ids]), cache=cache)[0, -1]
        ids = [int(mx.argmax(logits).item())]
        want.append(ids[0])
    assert got == want


def test_prompt_plus_max_tokens_must_fit_the_context(loaded):
    model, tokenizer = loaded
    old = model.args.max_position_embeddings
    model.args.max_position_embeddings = 64  # a 64-token context, as in the case
    try:
        prompt = list(range(100, 161))  # 61 tokens
        with pytest.raises(FlashError, match=r"--max-tokens 40: the prompt's 61 tokens plus 40 exceed "
                                             r"the model's context of 64 tokens \(at most 3 fit\)"):
            mlx_flash.generate(model, tokenizer, prompt, max_tokens=40)
        assert len(list(mlx_flash.stream_generate(model, tokenizer, prompt, max_tokens=-1))) <= 3
        assert len(list(mlx_flash.stream_generate(model, tokenizer, prompt, max_tokens=3))) <= 3
    finally:
        model.args.max_position_embeddings = old


def test_token_ids_past_the_embedding_table_are_refused(loaded):
    model, tokenizer = loaded
    vocab = model.args.vocab_size
    for bad in (vocab, 10 ** 9, -1):
        with pytest.raises(FlashError, match=f"token id {bad} is outside the embedding table"):
            mlx_flash.generate(model, tokenizer, [1, 2, bad], max_tokens=2)


def test_prompt_too_long(loaded):
    model, tokenizer = loaded
    with pytest.raises(FlashError, match="longer than the model's context"):
        next(mlx_flash.stream_generate(model, tokenizer, [1] * 9000, max_tokens=1))


def test_unknown_options():
    with pytest.raises(FlashError, match="--mode warp: unknown mode"):
        mlx_flash.load(mode="warp")
    with pytest.raises(TypeError, match="unknown options"):
        mlx_flash.load(windw=3)


def test_generate_stays_callable_after_the_cli_module_is_imported(loaded):
    # importing the `generate` CLI module rebinds the package attribute `mlx_flash.generate` to it
    import importlib

    from mlx_flash import api

    model, tokenizer = loaded
    importlib.import_module("mlx_flash.generate")
    assert mlx_flash.generate(model, tokenizer, "Hello", max_tokens=3) == api.generate(model, tokenizer, "Hello",
                                                                                       max_tokens=3)


def test_encode_prompt_is_the_chat_template_of_a_user_turn(loaded):
    # generate and bench kernels --generate both send prompts through this
    from mlx_flash.api import encode_prompt

    _, tokenizer = loaded
    user = [{"role": "user", "content": "Name a color."}]
    assert encode_prompt(tokenizer, "Name a color.") == tokenizer.apply_chat_template(user, add_generation_prompt=True)
    system = [{"role": "system", "content": "Be brief."}]
    assert encode_prompt(tokenizer, "Name a color.", "Be brief.") == tokenizer.apply_chat_template(
        system + user, add_generation_prompt=True)
    assert encode_prompt(tokenizer, "Name a color.", use_chat_template=False) == tokenizer.encode("Name a color.")


def test_console_scripts_name_cli_mains():
    """Every [project.scripts] entry of pyproject.toml is an importable CLI main."""
    import importlib
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib", reason="tomllib (reading pyproject.toml) is Python 3.11+")

    scripts = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]["scripts"]
    assert {"mlx-flash-generate", "mlx-flash-chat", "mlx-flash-server"} <= set(scripts)
    for name, target in scripts.items():
        module, func = target.split(":")
        assert callable(getattr(importlib.import_module(module), func)), name
