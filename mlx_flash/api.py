"""The Python API: load(), generate(), stream_generate(), FlashConfig."""

import gc
from dataclasses import fields

from .config import FlashConfig
from .errors import FlashError


def load(model=None, config: FlashConfig = None, *, progress: bool = True, **options):
    """Load a model -> (model, tokenizer).

    `model`: None (the embedded SmolLM2-135M-Instruct), a `.gguf` file, an mlx-lm / Hugging Face
    folder, or a hub repo id. `options` are FlashConfig fields (e.g. mode="dense").
    """
    # mlx-lm (with transformers) takes seconds to import: `import mlx_flash` stays instant
    from .models import load as load_model_and_tokenizer

    known = {f.name for f in fields(FlashConfig)}
    unknown = set(options) - known
    if unknown:
        raise TypeError(f"load() got unknown options {sorted(unknown)}; known: {sorted(known)}")
    config = config or FlashConfig(**options)
    return load_model_and_tokenizer(model, config, progress=progress)


def check_prompt_fits(model, n_prompt_tokens: int, max_tokens: int = 0) -> None:
    """Refuse a prompt that, with `max_tokens` generated tokens (-1: up to the context), does not
    fit the model's context instead of silently degrading past it."""
    from .models import context_length  # heavy (mlx-lm), see load

    limit = context_length(model)
    if limit is None:
        return
    if n_prompt_tokens > limit:
        raise FlashError(f"--prompt: {n_prompt_tokens} tokens, longer than the model's context of {limit} tokens")
    if max_tokens > 0 and n_prompt_tokens + max_tokens > limit:
        raise FlashError(f"--max-tokens {max_tokens}: the prompt's {n_prompt_tokens} tokens plus "
                         f"{max_tokens} exceed the model's context of {limit} tokens (at most "
                         f"{limit - n_prompt_tokens} fit)")


def check_token_ids(model, ids) -> None:
    """FlashError unless every id indexes the model's embedding table (a wrong id read past it)."""
    vocab = getattr(getattr(model, "args", None), "vocab_size", None)
    bad = [i for i in ids if not isinstance(i, int) or i < 0 or (vocab is not None and i >= vocab)]
    if bad:
        raise FlashError(f"prompt: token id {bad[0]!r} is outside the embedding table "
                         f"(0..{vocab - 1 if vocab else '?'})")


def encode_prompt(tokenizer, prompt: str, system_prompt=None, use_chat_template=True) -> list:
    """Token ids for a user prompt as `python -m mlx_flash.generate` sends it: through the chat
    template when the tokenizer has one (after `system_prompt`, if given)."""
    if use_chat_template and tokenizer.has_chat_template:
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": prompt})
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return tokenizer.encode(prompt)


def _prompt_ids(tokenizer, prompt):
    """Token ids of a prompt as mlx-lm's stream_generate makes them (a BOS unless already there)."""
    if not isinstance(prompt, str):
        return [int(i) for i in (prompt.tolist() if hasattr(prompt, "tolist") else prompt)]
    bos = getattr(tokenizer, "bos_token", None)
    return tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))


def stream_generate(model, tokenizer, prompt, max_tokens: int = 256, *, temp: float = 0.0,
                    top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, **kwargs):
    """Yield mlx-lm `GenerationResponse`s (text segment, token, tokens/s, peak memory in GB).

    `prompt` is a string (used as is: apply the chat template yourself, as with mlx-lm) or token ids.
    temp, top_p, top_k (0: off), min_p (0: off): mlx-lm's sampler (make_sampler); a `sampler=`
    given instead replaces them.
    """
    # heavy (mlx-lm), see load
    from mlx_lm.generate import stream_generate as mlx_lm_stream_generate
    from mlx_lm.sample_utils import make_sampler

    from .models import context_length

    prompt = _prompt_ids(tokenizer, prompt)
    check_token_ids(model, prompt)
    if max_tokens == -1:  # no limit: up to the end of the context
        limit = context_length(model)
        max_tokens = -1 if limit is None else max(0, limit - len(prompt))
    check_prompt_fits(model, len(prompt), max_tokens)
    sampler = kwargs.pop("sampler", None) or make_sampler(temp=temp, top_p=top_p, min_p=min_p, top_k=top_k)
    # Every token allocates a few hundred Python objects, so the cyclic GC runs often, and its full
    # passes walked the model's and tokenizer's ~10^6 long-lived objects: a sixth of the Python
    # thread's time in a profile of decoding. Freezing them for the generation skips that walk.
    gc.freeze()
    try:
        yield from mlx_lm_stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, sampler=sampler,
                                          **kwargs)
    finally:
        gc.unfreeze()


def generate(model, tokenizer, prompt, max_tokens: int = 256, **kwargs) -> str:
    """The whole completion of `prompt` as one string (see stream_generate for options)."""
    return "".join(r.text for r in stream_generate(model, tokenizer, prompt, max_tokens, **kwargs))
