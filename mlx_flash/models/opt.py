"""OPT (Meta's Open Pre-trained Transformer), the main model of "LLM in a flash", in mlx-lm's style.

mlx-lm has no OPT, so this file follows its model-file conventions (`ModelArgs` from config.json,
plain `nn.Module`s, `Model(inputs, cache, input_embeddings)` -> logits, `sanitize`, `layers`) and
keeps Hugging Face's module names, so checkpoint names map onto it unchanged:

    model.decoder.embed_tokens              token embeddings, (vocab_size, word_embed_proj_dim)
    model.decoder.embed_positions           learned positions, (max_position_embeddings + 2, hidden);
                                            position p is row p + 2 (OPT's offset)
    model.decoder.project_in / project_out  only when word_embed_proj_dim != hidden_size (opt-350m)
    model.decoder.layers.{i}.self_attn.{q,k,v,out}_proj, .self_attn_layer_norm
    model.decoder.layers.{i}.fc1 / .fc2     the FFN, see below
    model.decoder.layers.{i}.final_layer_norm
    model.decoder.final_layer_norm          only for pre-LN models (all sizes but opt-350m)
    lm_head                                 only when tie_word_embeddings is false

The FFN of layer i is `model.model.decoder.layers[i].fc1` and `.fc2` (== `model.layers[i].fc1/.fc2`,
nn.Linear, weights (ffn_dim, hidden) and (hidden, ffn_dim), parameter names
`model.decoder.layers.{i}.fc1.weight` / `.bias` etc.), computed as `fc2(relu(fc1(x)))` on the
(pre-LN: normalised) residual stream. Its swap point is `model.layers[i].mlp`: None means the dense
fc1/fc2 above; set it to a module called as `mlp(x) -> (B, L, hidden)` to replace the whole FFN
(e.g. a sparse, flash-loaded one), then `del layer.fc1, layer.fc2` so the dense weights leave the
parameter tree. The layer norms and residual stay in the decoder layer either way.
"""

from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import BaseModelArgs, create_attention_mask, scaled_dot_product_attention

# OPTLearnedPositionalEmbedding: row p + 2 holds position p (rows 0, 1 are fairseq's padding legacy).
POSITION_OFFSET = 2


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    ffn_dim: int
    num_attention_heads: int
    vocab_size: int
    max_position_embeddings: int = 2048
    word_embed_proj_dim: Optional[int] = None
    do_layer_norm_before: bool = True
    _remove_final_layer_norm: bool = False
    activation_function: str = "relu"
    enable_bias: bool = True
    layer_norm_elementwise_affine: bool = True
    tie_word_embeddings: bool = True

    def __post_init__(self):
        if self.word_embed_proj_dim is None:
            self.word_embed_proj_dim = self.hidden_size
        if self.activation_function != "relu":
            raise ValueError(
                f"config.json: OPT activation_function {self.activation_function!r} is not supported "
                "(only 'relu', which every OPT size uses)"
            )
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"config.json: hidden_size {self.hidden_size} is not divisible by "
                f"num_attention_heads {self.num_attention_heads}"
            )


class OPTAttention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = args.num_attention_heads
        self.scale = (dim // self.n_heads) ** -0.5
        self.q_proj = nn.Linear(dim, dim, bias=args.enable_bias)
        self.k_proj = nn.Linear(dim, dim, bias=args.enable_bias)
        self.v_proj = nn.Linear(dim, dim, bias=args.enable_bias)
        self.out_proj = nn.Linear(dim, dim, bias=args.enable_bias)

    def __call__(self, x: mx.array, mask=None, cache: Optional[Any] = None) -> mx.array:
        B, L, _ = x.shape
        queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        queries = queries.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        keys = keys.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        values = values.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        output = scaled_dot_product_attention(
            queries, keys, values, cache=cache, scale=self.scale, mask=mask
        )
        return self.out_proj(output.transpose(0, 2, 1, 3).reshape(B, L, -1))


class OPTDecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim, affine = args.hidden_size, args.layer_norm_elementwise_affine
        self.do_layer_norm_before = args.do_layer_norm_before
        self.self_attn = OPTAttention(args)
        self.self_attn_layer_norm = nn.LayerNorm(dim, affine=affine)
        self.fc1 = nn.Linear(dim, args.ffn_dim, bias=args.enable_bias)
        self.fc2 = nn.Linear(args.ffn_dim, dim, bias=args.enable_bias)
        self.final_layer_norm = nn.LayerNorm(dim, affine=affine)
        # Swap point for the whole FFN (see the module docstring); None = dense fc2(relu(fc1(x))).
        self.mlp = None

    def __call__(self, x: mx.array, mask=None, cache: Optional[Any] = None) -> mx.array:
        pre_ln = self.do_layer_norm_before
        r = self.self_attn(self.self_attn_layer_norm(x) if pre_ln else x, mask, cache)
        h = x + r
        if not pre_ln:
            h = self.self_attn_layer_norm(h)

        f = self.final_layer_norm(h) if pre_ln else h
        if self.mlp is None:
            r = self.fc2(nn.relu(self.fc1(f)))
        else:
            r = self.mlp(f)
        out = h + r
        if not pre_ln:
            out = self.final_layer_norm(out)
        return out


class OPTDecoder(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim, word_dim = args.hidden_size, args.word_embed_proj_dim
        self.embed_tokens = nn.Embedding(args.vocab_size, word_dim)
        self.embed_positions = nn.Embedding(args.max_position_embeddings + POSITION_OFFSET, dim)
        if word_dim != dim:
            self.project_in = nn.Linear(word_dim, dim, bias=False)
            self.project_out = nn.Linear(dim, word_dim, bias=False)
        self.layers = [OPTDecoderLayer(args) for _ in range(args.num_hidden_layers)]
        if args.do_layer_norm_before and not args._remove_final_layer_norm:
            self.final_layer_norm = nn.LayerNorm(dim, affine=args.layer_norm_elementwise_affine)

    def __call__(self, inputs: mx.array, cache=None, input_embeddings: Optional[mx.array] = None):
        h = input_embeddings if input_embeddings is not None else self.embed_tokens(inputs)
        L = h.shape[1]
        if cache is None:
            cache = [None] * len(self.layers)

        # Position of each new token = tokens already cached. A BatchKVCache's per-row offset starts
        # at -left_padding, so real tokens start at 0; padding (masked out) is clamped to -1 as in
        # HF's cumsum(mask) - 1, so it never indexes below row 0 of embed_positions.
        offset = mx.array(cache[0].offset if cache[0] is not None else 0)
        positions = mx.maximum(mx.arange(L) + offset[..., None], -1)

        if "project_in" in self:
            h = self.project_in(h)
        h = h + self.embed_positions(positions + POSITION_OFFSET)

        mask = create_attention_mask(h, cache[0])
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, cache=c)

        if "final_layer_norm" in self:
            h = self.final_layer_norm(h)
        if "project_out" in self:
            h = self.project_out(h)
        return h


class OPTModel(nn.Module):
    """HF's OPTModel: only holds the decoder, kept so parameter names match checkpoints."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.decoder = OPTDecoder(args)

    def __call__(self, inputs: mx.array, cache=None, input_embeddings: Optional[mx.array] = None):
        return self.decoder(inputs, cache, input_embeddings)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = OPTModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.word_embed_proj_dim, args.vocab_size, bias=False)

    def __call__(
        self,
        inputs: mx.array,
        cache=None,
        input_embeddings: Optional[mx.array] = None,
    ):
        out = self.model(inputs, cache, input_embeddings)
        if self.args.tie_word_embeddings:
            return self.model.decoder.embed_tokens.as_linear(out)
        return self.lm_head(out)

    def sanitize(self, weights):
        """HF checkpoint names -> ours. Idempotent, so mlx-lm-saved OPT folders load too."""
        sanitized = {}
        for name, value in weights.items():
            # Hub OPT checkpoints were saved from OPTModel: "decoder.*" without the "model." prefix.
            if name.startswith("decoder."):
                name = "model." + name
            sanitized[name] = value
        if self.args.tie_word_embeddings:
            sanitized.pop("lm_head.weight", None)
        return sanitized

    @property
    def layers(self):
        return self.model.decoder.layers
