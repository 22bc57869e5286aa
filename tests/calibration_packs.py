"""Tiny random flash packs with a byte tokenizer and calibration text, for the calibration, eval and
quality tests."""

import json

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from mlx_flash.pack import write_pack

WORDS = ("the flash memory model reads neurons from disk when a token needs them while attention "
         "weights stay resident and a small predictor guesses which rows of each layer matter").split()


def write_byte_tokenizer(folder):
    """A byte-level BPE tokenizer without merges: 256 ids, one per byte (any text encodes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))


CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"


def write_chat_template(folder):
    """A chat template kept apart from the tokenizer, as transformers saves it (chat_template.jinja)."""
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def write_text(path, n_words=400, seed=0):
    rng = np.random.default_rng(seed)
    path.write_text(" ".join(rng.choice(WORDS, n_words)) + "\n")
    return path


def tiny_llama_pack(tiny_llama, tmp_path, name="pack", **kwargs):
    """A tiny float32 llama flash pack (byte tokenizer, vocab 256)."""
    src = tiny_llama(f"{name}-src", vocab=256, **kwargs)
    write_byte_tokenizer(src)
    return write_pack(src, tmp_path / name, progress=False)


def tiny_cats_pack(tiny_llama, tmp_path, thresholds, name="cats", act="cats", **pack_kwargs):
    """A tiny CATS relu_llama flash pack (byte tokenizer, vocab 256, intermediate 96): the tiny
    llama's weights with h = silu(g) where |silu(g)| > thresholds[layer] else 0, times up x
    (act "product": h = silu(g) up x where |h| > thresholds[layer] else 0)."""
    src = tiny_llama(f"{name}-src", vocab=256, layers=len(thresholds), intermediate=96)
    write_byte_tokenizer(src)
    config = json.loads((src / "config.json").read_text())
    config.update(model_type="relu_llama", hidden_act=act, activation_threshold=list(thresholds))
    (src / "config.json").write_text(json.dumps(config))
    return write_pack(src, tmp_path / name, progress=False, **pack_kwargs)


def tiny_opt_pack(tmp_path, name="opt"):
    """A tiny float32 OPT flash pack (ReLU FFN with biases; byte tokenizer)."""
    from mlx_flash.models import opt

    config = {"model_type": "opt", "hidden_size": 64, "num_hidden_layers": 2, "ffn_dim": 128,
              "num_attention_heads": 4, "vocab_size": 256, "max_position_embeddings": 256}
    mx.random.seed(3)
    model = opt.Model(opt.ModelArgs.from_dict(config))
    # random biases so ReLU sparsity differs per neuron (zero-initialised biases would not)
    params = {k: (v + 0.1 * mx.random.normal(v.shape)) if v.ndim == 1 else v
              for k, v in tree_flatten(model.parameters())}
    src = tmp_path / f"{name}-src"
    src.mkdir()
    mx.save_safetensors(str(src / "model.safetensors"), params, metadata={"format": "mlx"})
    (src / "config.json").write_text(json.dumps(config))
    write_byte_tokenizer(src)
    return write_pack(src, tmp_path / name, progress=False)


def decode_logits(model, ids):
    """Logits of each position, one token per forward pass with a KV cache, each evaluated before
    the next step (as generation does: the flash FFN's cache rows change between steps)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    return np.stack([np.array(model(mx.array([[t]]), cache=cache)[0, -1]) for t in ids])


