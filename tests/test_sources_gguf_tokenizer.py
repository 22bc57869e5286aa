"""GGUF tokenizer (sources/gguf_tokenizer.py) checked against transformers' tokenizer built from the
same GGUF, and against llama.cpp when installed."""

import pytest

pytest.importorskip("gguf")
# the transformers reference (conftest.reference) is built once, in one test process
pytestmark = pytest.mark.xdist_group("gguf_reference")

SAMPLE_TEXTS = [
    "Hello world! The year 2024 had 366 days; 1234567 is a number.",
    "  leading spaces\n\nnew\tlines and trailing   ",
    "café naïve façade — “quotes” … 日本語 中文 한국어 Ελληνικά русский",
    "emoji 🙂👍🏽 and symbols ©®™ ∑ ∫ √",
    "def f(x):\n    return x ** 2  # comment\nprint(f(3.14159))",
    "<|im_start|>user\nWhat's up?<|im_end|>\n<|im_start|>assistant\n",
    "I'm sure they've said we'll go, but you'd think it's ALL CAPS's fault.",
    "URLs like https://example.com/path?q=1&r=2 and e-mails like a.b@c.org",
    "Numbers: 0 00 007 3.5e-10 -42 +17 1,000,000 and dates 2026-11-23.",
    "The LLM in a flash paper stores FFN neurons on flash and loads them on demand.",
]


def test_tokenizer_ids_match_reference(reference, ours):
    ref_tok, our_tok = reference[0], ours[0]
    for text in SAMPLE_TEXTS:
        assert our_tok.encode(text, add_special_tokens=False) == ref_tok.encode(text, add_special_tokens=False), text
        ids = our_tok.encode(text, add_special_tokens=False)
        assert our_tok.decode(ids) == text


# Text with a non-ASCII numeric character after a space. SmolLM's pre-tokenizer (llama.cpp
# `tokenizer.ggml.pre = smollm`, HF `Digits(individual_digits=True)`) isolates every numeric
# character; transformers' GGUF tokenizer builder ignores `pre` for this model and keeps " ½"
# together, so it is no reference here. llama.cpp itself is (test below, when installed).
NUMERIC_TEXT = "a recipe: ½ cup, ¾ spoon, Ⅻ o'clock and ² squared"


def test_numeric_characters_split_like_llama_cpp(ours):
    tok = ours[0]
    ids = tok.encode(" ½", add_special_tokens=False)
    assert [tok.decode([i]) for i in ids] == [" ", "½"]
    assert tok.decode(tok.encode(NUMERIC_TEXT, add_special_tokens=False)) == NUMERIC_TEXT


def test_tokenizer_ids_match_llama_cpp(embedded_gguf, ours):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama.cpp reference needs `pip install .[peers]`")
    llm = llama_cpp.Llama(model_path=str(embedded_gguf), vocab_only=True, verbose=False)
    for text in SAMPLE_TEXTS + [NUMERIC_TEXT]:
        ref = llm.tokenize(text.encode(), add_bos=False, special=True)
        assert ours[0].encode(text, add_special_tokens=False) == ref, text


def test_chat_template_matches_reference(reference, ours):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    ref = reference[0].apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours[0].apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == ref
