"""OPT in mlx-lm's style vs transformers' OPTForCausalLM on tiny random models (float32, CPU)."""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

torch = pytest.importorskip("torch", reason="parity tests need torch (the reference OPT runs in transformers)")
transformers = pytest.importorskip("transformers", reason="parity tests need transformers' OPTForCausalLM")

from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache  # noqa: E402
from mlx_lm.utils import load_model  # noqa: E402

from mlx_flash.models import opt  # noqa: E402

# Both sides are float32. Logits are |x| <~ 10 after 2 layers of <=128-term dot products, LayerNorms
# and a softmax; torch and MLX sum in different orders, so each dot product differs by ~sqrt(K) ulp
# (~1e-6 relative) and the layers compound that to the ~1e-5 we observe. 1e-4 leaves a 10x margin
# while any real mistake (a position off by one, a missing bias or norm) moves logits by >1e-2.
ATOL = 1e-4
VOCAB = 100

VARIANTS = {
    # name: OPTConfig overrides
    "pre_ln": dict(do_layer_norm_before=True),  # opt-125m, 1.3b, 6.7b, ... layout
    "pre_ln_projected": dict(do_layer_norm_before=True, word_embed_proj_dim=32),
    "post_ln_projected": dict(do_layer_norm_before=False, word_embed_proj_dim=32),  # opt-350m layout
    "post_ln": dict(do_layer_norm_before=False),
    "no_bias_no_affine_untied": dict(
        enable_bias=False, layer_norm_elementwise_affine=False, tie_word_embeddings=False
    ),
}


def hf_opt(seed=0, **overrides):
    """A seeded random OPTForCausalLM (eager attention, eval mode) with every parameter perturbed."""
    config = dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, ffn_dim=128, num_attention_heads=4,
        max_position_embeddings=64, eos_token_id=None,  # no eos: greedy runs never stop early
        attn_implementation="eager",  # the reference: plain matmul-softmax-matmul
    )
    config.update(overrides)
    torch.manual_seed(seed)
    model = transformers.OPTForCausalLM(transformers.OPTConfig(**config)).eval()
    # HF's init (std 0.02, zero biases, unit norms) gives near-uniform logits that hide mistakes;
    # larger random weights, biases and norm affines make every parameter matter.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
            else:
                p.add_(torch.randn_like(p) * 0.2)
    return model


def to_mlx(hf_model, weights=None):
    """Our Model built from the HF config and loaded (strictly) from its state dict."""
    if weights is None:
        weights = {k: mx.array(v.numpy()) for k, v in hf_model.state_dict().items()}
    model = opt.Model(opt.ModelArgs.from_dict(hf_model.config.to_dict()))
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    mx.eval(model.parameters())
    return model


def hf_logits(hf_model, ids, attention_mask=None):
    with torch.no_grad():
        out = hf_model(torch.tensor(ids), attention_mask=attention_mask)
    return out.logits.numpy()


def token_ids(batch, length, seed=1):
    return np.random.default_rng(seed).integers(0, VOCAB, size=(batch, length))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(variant):
    hf = hf_opt(**VARIANTS[variant])
    model = to_mlx(hf)
    ids = token_ids(3, 24)
    ours = np.array(model(mx.array(ids)))
    ref = hf_logits(hf, ids)
    assert ours.shape == ref.shape == (3, 24, VOCAB)
    assert np.abs(ref).max() > 1.0  # logits far from uniform, so the tolerance is meaningful
    np.testing.assert_allclose(ours, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", ["pre_ln_projected", "post_ln_projected"])
def test_kv_cache_decoding_matches_full_sequence(variant):
    hf = hf_opt(**VARIANTS[variant])
    model = to_mlx(hf)
    ids = mx.array(token_ids(2, 20, seed=2))
    full = model(ids)

    cache = make_prompt_cache(model)
    steps = [model(ids[:, :7], cache=cache)]  # a prompt, then one token at a time
    for t in range(7, 20):
        steps.append(model(ids[:, t : t + 1], cache=cache))
    stepped = mx.concatenate(steps, axis=1)
    assert cache[0].offset == 20
    np.testing.assert_allclose(np.array(stepped), np.array(full), atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", ["pre_ln", "post_ln_projected"])
def test_greedy_generation_matches_transformers(variant):
    hf = hf_opt(seed=3, **VARIANTS[variant])
    model = to_mlx(hf)
    prompt = token_ids(1, 9, seed=4)
    n_new = 12
    with torch.no_grad():
        expected = hf.generate(torch.tensor(prompt), max_new_tokens=n_new, do_sample=False)
    expected = expected[0, prompt.shape[1]:].tolist()
    assert len(expected) == n_new

    ours = [int(tok) for tok, _ in generate_step(mx.array(prompt[0]), model, max_tokens=n_new)]
    assert ours == expected


def test_input_embeddings_match_transformers_inputs_embeds():
    """mlx-lm's input_embeddings, like HF's inputs_embeds, replace embed_tokens (before project_in)."""
    hf = hf_opt(**VARIANTS["post_ln_projected"])
    model = to_mlx(hf)
    embeds = np.random.default_rng(6).normal(size=(2, 11, 32)).astype(np.float32)
    ours = np.array(model(None, input_embeddings=mx.array(embeds)))
    with torch.no_grad():
        ref = hf(inputs_embeds=torch.tensor(embeds)).logits.numpy()
    np.testing.assert_allclose(ours, ref, atol=ATOL, rtol=0)


def test_left_padded_batch_matches_transformers():
    """mlx-lm's BatchKVCache left-pads; positions must restart at 0 after the padding, as in HF."""
    hf = hf_opt(**VARIANTS["pre_ln_projected"])
    model = to_mlx(hf)
    ids = token_ids(2, 10, seed=5)
    padding = [0, 4]
    mask = np.ones_like(ids)
    mask[1, : padding[1]] = 0
    ids[1, : padding[1]] = 1  # OPT's pad token; masked anyway

    cache = [BatchKVCache(left_padding=padding) for _ in model.layers]
    prompt = model(mx.array(ids[:, :8]), cache=cache)
    step = model(mx.array(ids[:, 8:9]), cache=cache)
    ours = np.array(mx.concatenate([prompt, step], axis=1))

    ref = hf_logits(hf, ids[:, :9], attention_mask=torch.tensor(mask[:, :9]))
    for row, pad in enumerate(padding):
        np.testing.assert_allclose(ours[row, pad:], ref[row, pad:], atol=ATOL, rtol=0)


def test_sanitize_hub_names_and_idempotent():
    """Hub OPT files name tensors "decoder.*" (saved from OPTModel); mlx-lm re-sanitizes on reload."""
    hf = hf_opt(**VARIANTS["pre_ln"])
    state = {k: mx.array(v.numpy()) for k, v in hf.state_dict().items()}
    hub_style = {k.removeprefix("model."): v for k, v in state.items() if k != "lm_head.weight"}
    assert "decoder.layers.0.fc1.weight" in hub_style

    model = to_mlx(hf, weights=hub_style)
    ids = token_ids(1, 12)
    np.testing.assert_allclose(np.array(model(mx.array(ids))), hf_logits(hf, ids), atol=ATOL, rtol=0)

    ours = dict(tree_flatten(model.parameters()))
    assert model.sanitize(ours).keys() == ours.keys()
    expected = {k for k in state if k != "lm_head.weight"}  # tied: lm_head is embed_tokens
    assert ours.keys() == expected


def test_loads_hf_save_pretrained_folder_with_mlx_lm(tmp_path):
    """A transformers save_pretrained folder loads through mlx-lm's load_model with our classes."""
    hf = hf_opt(**VARIANTS["post_ln_projected"], tie_word_embeddings=False)
    hf.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "opt"

    model, _ = load_model(tmp_path, get_model_classes=lambda config: (opt.Model, opt.ModelArgs))
    ids = token_ids(2, 16)
    np.testing.assert_allclose(np.array(model(mx.array(ids))), hf_logits(hf, ids), atol=ATOL, rtol=0)


class ReluFFN(nn.Module):
    """What swap code does: own fc1/fc2 elsewhere and be called as mlp(x)."""

    def __init__(self, fc1, fc2, scale=1.0):
        super().__init__()
        self.up, self.down, self.scale = fc1, fc2, scale

    def __call__(self, x):
        return self.scale * self.down(nn.relu(self.up(x)))


def test_ffn_swap_point():
    hf = hf_opt(**VARIANTS["pre_ln"])
    model = to_mlx(hf)
    ids = mx.array(token_ids(2, 12))
    dense = np.array(model(ids))

    layer = model.layers[1]
    assert layer.mlp is None and isinstance(layer.fc1, nn.Linear) and isinstance(layer.fc2, nn.Linear)
    fc1, fc2 = layer.fc1, layer.fc2
    layer.mlp = ReluFFN(fc1, fc2)
    del layer.fc1, layer.fc2
    names = dict(tree_flatten(model.parameters())).keys()
    assert "model.decoder.layers.1.fc1.weight" not in names
    assert "model.decoder.layers.1.mlp.up.weight" in names
    # Same ops on the same arrays: bit-identical, the exactness the sparse path is tested against.
    np.testing.assert_array_equal(np.array(model(ids)), dense)

    layer.mlp = ReluFFN(fc1, fc2, scale=0.5)  # the swapped module really is the one being called
    assert np.abs(np.array(model(ids)) - dense).max() > 1e-2


def test_config_errors():
    with pytest.raises(ValueError, match="activation_function 'gelu'"):
        opt.ModelArgs.from_dict(dict(
            model_type="opt", hidden_size=64, num_hidden_layers=2, ffn_dim=128,
            num_attention_heads=4, vocab_size=VOCAB, activation_function="gelu",
        ))
