"""Llama with a ReLU-family FFN activation (a "relufied" llama), in mlx-lm's style.

mlx-lm's llama MLP hard-codes swiglu (silu(gate x) * up x) and ignores config.json's
`hidden_act`, so a relufied llama cannot be expressed in mlx-lm's own class. This model type
reuses mlx-lm's llama modules unchanged (attention, blocks, weight names: a llama checkpoint
loads as is) and swaps only each block's MLP for one whose activation config.json names:

    hidden_act "relu"     down(relu(gate x) * up x)
    hidden_act "fatrelu"  down(fatrelu(gate x) * up x), fatrelu(g) = g where g > t else 0,
                          t = activation_threshold: one number, or one per layer
                          (FATReLU, Song et al. 2024)
    hidden_act "drelu"    down(relu(gate x) * relu(up x))   (dReLU: both branches sparse)
    hidden_act "cats"     down(cats(gate x) * up x), cats(g) = silu(g) where |silu(g)| > t else 0,
                          t = activation_threshold as for fatrelu (CATS, Lee et al. 2024: the
                          SiLU kept, its small values silenced)
    hidden_act "product"  down(product(gate x, up x)), product(g, u) = silu(g) * u where
                          |silu(g) * u| > t else 0, t as for fatrelu: the SwiGLU hidden value
                          itself thresholded (what a neuron adds to the output, not its gate)

config.json: {"model_type": "relu_llama", "hidden_act": ..., "activation_threshold": t, ...plus
every llama field}. Neuron i of a layer is inactive (contributes nothing, its weights need not be
read) exactly where its hidden value h_i is 0.
"""

from dataclasses import dataclass
from typing import List, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama

from ..cpu.ops import cats, fatrelu

ACTIVATIONS = ("relu", "fatrelu", "drelu", "cats", "product")
THRESHOLDED = ("fatrelu", "cats", "product")  # activations with activation_threshold


@dataclass
class ModelArgs(llama.ModelArgs):
    hidden_act: str = "relu"
    activation_threshold: Union[float, List[float]] = 0.0

    def __post_init__(self):
        super().__post_init__()
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"relu_llama hidden_act {self.hidden_act!r} is not one of {', '.join(ACTIVATIONS)}")
        t = self.activation_threshold
        if isinstance(t, list) and len(t) != self.num_hidden_layers:
            raise ValueError(f"relu_llama activation_threshold has {len(t)} values for "
                             f"{self.num_hidden_layers} layers")
        if self.hidden_act not in THRESHOLDED and any(v != 0 for v in (t if isinstance(t, list) else [t])):
            raise ValueError(f"relu_llama activation_threshold {t} needs hidden_act fatrelu, cats or product")

    def layer_threshold(self, layer: int) -> float:
        t = self.activation_threshold
        return float(t[layer] if isinstance(t, list) else t)


def gated_hidden(gate: mx.array, up: mx.array, hidden_act: str, threshold: float = 0.0) -> mx.array:
    """The FFN hidden vector h (same shape as gate) from the gate and up projections' outputs."""
    if hidden_act == "relu":
        return nn.relu(gate) * up
    if hidden_act == "fatrelu":
        return fatrelu(gate, threshold) * up
    if hidden_act == "drelu":
        return nn.relu(gate) * nn.relu(up)
    if hidden_act == "cats":
        return cats(nn.silu(gate), threshold) * up
    if hidden_act == "product":
        return cats(nn.silu(gate) * up, threshold)
    raise ValueError(f"unknown hidden_act {hidden_act!r}")


class ActiveFractions:
    """Collects each MLP call's fraction of nonzero hidden values (a plain object, so it stays out
    of the parameter tree); `fractions` holds one scalar mx.array per call, in call order."""

    def __init__(self):
        self.fractions = []


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, threshold: float = 0.0):
        super().__init__()
        dim, hidden_dim, bias = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=bias)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=bias)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=bias)
        self.hidden_act, self.threshold = args.hidden_act, float(threshold)
        self.record = None  # an ActiveFractions while measuring sparsity, else None

    def __call__(self, x) -> mx.array:
        h = gated_hidden(self.gate_proj(x), self.up_proj(x), self.hidden_act, self.threshold)
        if self.record is not None:
            self.record.fractions.append(mx.mean((h != 0).astype(mx.float32)))
        return self.down_proj(h)


class Model(llama.Model):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        for i, layer in enumerate(self.model.layers):
            layer.mlp = MLP(args, args.layer_threshold(i))
