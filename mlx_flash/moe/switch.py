"""StreamedSwitchGLU: mlx-lm's SwitchGLU with its experts in an `ExpertStore` slot bank.

Same call as mlx-lm's `SwitchGLU(x, indices)`, so each architecture's router code runs unchanged;
the expert ids are mapped to bank slots and the products are the very gather_qmm / gather_mm calls
SwitchGLU makes, on the slot bank instead of the [E, ...] stack: logits are bit-identical to the
fully loaded model for every cache size and policy (tests/test_moe_switch.py).

One host synchronisation per MoE layer call: the expert ids (and, with the lookahead predictor,
the next layer's predicted ids, evaluated in the same `mx.eval`) must reach the host to read the
missing experts. The previous layer's expert products are evaluated by that same sync.

Two compute paths, chosen per call by the CPU kernels' own switch (`cpu.ops.kernels_active()`:
extension built, MLX_FLASH_KERNELS not 0 / `set_kernels_enabled`, default device CPU):
  kernels  every (token, choice) pair of the call in one kernel primitive reading the bank slots
           in place (cpu.ops.experts_swiglu; MLX's CPU gather_qmm is 10-25x slower per expert;
           SwiGLU experts, as mlx-lm's SwitchGLU defaults to). Equal to mlx-lm's SwitchGLU up to float
           summation order, and bit-identical across cache sizes, policies and predictors (each
           expert sees the same rows in the same order whatever slot holds it).
  MLX      mlx-lm's gather_qmm / gather_mm (Metal, float experts, widths the kernels lack, or the
           kernels off): bit-identical to mlx-lm's fully loaded model.
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import SwiGLU, SwitchGLU

from ..cpu import ops
from ..errors import FlashError


class StreamedSwitchGLU(nn.Module):
    """SwitchGLU over `store`'s bank for MoE layer `layer`.

    activation: the replaced SwitchGLU's activation (SwiGLU by default in mlx-lm).
    lookahead: optional callable(x) -> mx.array [..., width] of the next MoE layer's likely experts
      (the next router on this layer's input), preloaded while this layer computes.
    predict_next: optional callable(layer, experts at this layer) -> [(layer, [experts])] to
      preload (the statistical profile).
    on_route: optional callable(layer, ids np.ndarray, lookahead np.ndarray|None) (recording).
    """

    def __init__(self, store, layer, activation, *, lookahead=None, predict_next=None, on_route=None):
        super().__init__()
        self._store, self._layer, self.activation = store, layer, activation
        self._lookahead, self._predict_next, self._on_route = lookahead, predict_next, on_route
        self._next_layer = None
        layers = list(store.entries)
        i = layers.index(layer)
        self._next_layer = layers[i + 1] if i + 1 < len(layers) else None

    def _project(self, bank, role, x, idx, sorted_indices, width=None):
        q = self._store.quantization(role, width)
        if q is not None:
            y = mx.gather_qmm(x, bank[f"{role}.weight"], bank[f"{role}.scales"],
                              bank.get(f"{role}.biases"), rhs_indices=idx, transpose=True,
                              group_size=q["group_size"], bits=q["bits"], mode="affine",
                              sorted_indices=sorted_indices)
        else:
            y = mx.gather_mm(x, bank[f"{role}.weight"].swapaxes(-1, -2), rhs_indices=idx,
                             sorted_indices=sorted_indices)
        if f"{role}.bias" in bank:
            y = y + mx.expand_dims(bank[f"{role}.bias"][idx], -2)
        return y

    def __call__(self, x, indices):
        store = self._store
        # The previous call's product is evaluated in this sync too: its slots may be refilled
        # below, and a caller that does not feed each output into the next call (teacher-forced
        # tokens, a prompt chunk's last layer) has not made this layer's ids depend on it.
        pending = [*store.last_output]
        if self._lookahead is not None and self._next_layer is not None:
            ahead = self._lookahead(x)
            mx.eval(indices, ahead, *pending)
        else:
            ahead = None
            mx.eval(indices, *pending)
        store.host_syncs += 1
        ids = np.array(indices, copy=False)
        ahead_ids = np.array(ahead, copy=False) if ahead is not None else None
        if self._on_route is not None:
            self._on_route(self._layer, ids, ahead_ids)
        lut, banks, reads = store.assign(self._layer, ids)
        if not store.mixed:
            (width, bank), = banks.items()
            y = self._hits_while_reading(bank, width, x, ids, lut, reads)
        else:
            store.read(self._layer, reads)
            y = by_width(x, ids, store.width_of[self._layer], lambda w, xw, rows: self._switch(
                banks[w], w, xw, mx.array(lut[rows], dtype=indices.dtype)))
        if self._next_layer is not None:
            if ahead_ids is not None:
                store.preload(self._next_layer, _by_votes(ahead_ids))
            elif self._predict_next is not None:
                for layer, experts in self._predict_next(self._layer, np.unique(ids)):
                    store.preload(layer, experts)
        store.last_output = (y,)
        return y

    def _hits_while_reading(self, bank, width, x, ids, lut, reads):
        """SwitchGLU output of one width's bank with the missing experts read. A decode token on
        the kernels computes its cached experts while the missing ones are read (one kernel call
        each for the hits and the misses, a pair's row from the call that holds its expert: every
        expert still sees all its rows in one call, so the bits are the one-call ones)."""
        slots = lut[ids].astype(np.int32)
        missed = (np.isin(ids, np.concatenate([experts for experts, _, _ in reads]))
                  if reads else np.zeros(ids.shape, bool))
        overlap = (0 < missed.sum() < missed.size and ids.size == ids.shape[-1]
                   and self._kernel_ok(bank, width, x))
        if not overlap:
            self._store.read(self._layer, reads)
            return self._switch(bank, width, x, mx.array(slots))
        # slot -1 is outside the bank: the kernel skips those pairs (NaN rows, never selected)
        hits = self._switch(bank, width, x, mx.array(np.where(missed, -1, slots)))
        mx.async_eval(hits)
        self._store.read(self._layer, reads)
        late = self._switch(bank, width, x, mx.array(np.where(missed, slots, -1)))
        return mx.where(mx.array(missed)[..., None], late, hits)

    def _switch(self, bank, width, x, idx):
        """The body of mlx-lm's SwitchGLU.__call__, on bank slots `idx` instead of expert ids."""
        if self._kernel_ok(bank, width, x):
            return self._switch_kernels(bank, width, x, idx)
        shape = idx.shape
        x = mx.expand_dims(x, (-2, -3))
        do_sort = idx.size >= 64
        inv_order = None
        if do_sort:
            x, idx, inv_order = _gather_sort(x, idx)
        x_up = self._project(bank, "up", x, idx, do_sort, width)
        x_gate = self._project(bank, "gate", x, idx, do_sort, width)
        x = self._project(bank, "down", self.activation(x_up, x_gate), idx, do_sort, width)
        if do_sort:
            x = mx.unflatten(x[inv_order], 0, shape)
        return x.squeeze(-2)

    def _kernel_ok(self, bank, width, x) -> bool:
        """True when this call runs on the CPU kernels: kernels active, at most MAX_KERNEL_ROWS
        tokens, mlx-lm's SwiGLU activation, affine-quantized experts of a width and group size
        the kernels read, no biases."""
        q = self._store.quantization("up", width)
        return (q is not None and "up.bias" not in bank and "up.biases" in bank
                and isinstance(self.activation, SwiGLU) and ops.use_kernel(x)
                and ops.bank_ok(bank["up.weight"], bank["up.scales"], bank["up.biases"],
                                q["group_size"], q["bits"]))

    def _switch_kernels(self, bank, width, x, idx):
        """SwitchGLU output [..., k, hidden] as one kernel call for every (token, choice) pair
        (cpu.ops.experts_swiglu): pairs grouped by slot, tokens in order within a group, so a
        pair's result depends on which tokens its expert serves, never on the slot."""
        q = {role: self._store.quantization(role, width) for role in ("gate", "down")}
        banks = [tuple(bank[f"{role}.{part}"] for part in ("weight", "scales", "biases"))
                 for role in ("gate", "up", "down")]
        y = ops.experts_swiglu(x.reshape(-1, x.shape[-1]), idx.reshape(-1, idx.shape[-1]), *banks,
                               q["gate"]["group_size"], q["gate"]["bits"], q["down"]["group_size"],
                               q["down"]["bits"])
        return y.reshape(*idx.shape, y.shape[-1])


def by_width(x, ids: np.ndarray, width_of: np.ndarray, switch):
    """SwitchGLU output [..., k, hidden] of experts of mixed widths: the (token, choice) pairs
    grouped by their expert's width (host-side: `ids` int [..., k] are known), each group one
    SwitchGLU call `switch(width, x rows [m, hidden], expert ids [m, 1])` -> [m, 1, hidden], the
    rows put back in order. The resident reference and the streamed layer both run this."""
    k = ids.shape[-1]
    flat = ids.reshape(-1)
    widths = width_of[flat]
    xf = x.reshape(-1, x.shape[-1])
    outs, order = [], []
    for w in np.unique(widths).tolist():
        pos = np.flatnonzero(widths == w)
        order.append(pos)
        outs.append(switch(w, xf[mx.array(pos // k)], flat[pos][:, None]))
    inv = np.argsort(np.concatenate(order), kind="stable")
    y = mx.concatenate(outs, axis=0)[mx.array(inv)]
    return y.reshape(*ids.shape, y.shape[-1])


class ResidentMixedSwitchGLU(nn.Module):
    """An mlx-lm MoE layer holding every expert at its own bit width: one mlx-lm `SwitchGLU`
    (QuantizedSwitchLinear at that width) per width group, the calls grouped by `by_width`.
    The dense (IO-FREE) model of an "expert-bits" pack and the reference the streamed layer is
    bit-identical to. groups: {width: (expert ids, {component name: mx.array [n, ...]})}."""

    def __init__(self, switch, groups, n_experts):
        from mlx_lm.models.switch_layers import SwitchGLU

        super().__init__()
        self.activation = switch.activation
        self._width_of = np.zeros(n_experts, np.int64)
        self._local = np.zeros(n_experts, np.int64)
        self.switches = []
        for w, (ids, comps) in sorted(groups.items()):
            self._width_of[ids] = w
            self._local[ids] = np.arange(len(ids))
            out_dims, packed = comps["up.weight"].shape[1:]
            q = {"group_size": packed * 32 // w // comps["up.scales"].shape[-1], "bits": w}
            glu = SwitchGLU(packed * 32 // w, out_dims, len(ids), activation=switch.activation,
                            bias="up.bias" in comps)
            nn.quantize(glu, group_size=q["group_size"], bits=w)
            glu.load_weights([(f"{n.split('.')[0]}_proj.{n.split('.')[1]}", a)
                              for n, a in comps.items()], strict=True)
            self.switches.append(glu)
        self._index = {w: i for i, w in enumerate(sorted(groups))}

    def __call__(self, x, indices):
        mx.eval(indices)
        ids = np.array(indices)
        return by_width(x, ids, self._width_of, lambda w, xw, rows: self.switches[self._index[w]](
            xw, mx.array(self._local[rows], dtype=indices.dtype)))


def _gather_sort(x, indices):
    """mlx-lm switch_layers._gather_sort: tokens grouped by slot."""
    *_, m = indices.shape
    indices = indices.flatten()
    order = mx.argsort(indices)
    inv_order = mx.argsort(order)
    return x.flatten(0, -3)[order // m], indices[order], inv_order


def _by_votes(ahead_ids: np.ndarray) -> list:
    """Predicted experts ordered by how many tokens' lookahead chose them (most first), ties by
    their best rank in a token's guesses (`ahead_ids` [..., width], each row best first)."""
    by_rank = np.moveaxis(ahead_ids.reshape(-1, ahead_ids.shape[-1]), -1, 0).reshape(-1)
    values, first, counts = np.unique(by_rank, return_index=True, return_counts=True)
    order = np.lexsort((first, -counts))
    return [int(v) for v in values[order]]


def router_lookahead(block, width):
    """callable(x) -> top-`width` expert ids of `block`'s router applied to x (lazy), best first.

    block: the next layer's MoE block (mlx-lm: `.gate` is an nn.Linear router, or deepseek's
    MoEGate whose `.weight` is the router matrix).
    """
    gate = block.gate
    is_linear = isinstance(gate, (nn.Linear, nn.QuantizedLinear))

    def lookahead(x):
        logits = gate(x) if is_linear else x @ gate.weight.T
        top = mx.argpartition(-logits, kth=width - 1, axis=-1)[..., :width]
        best_first = mx.argsort(-mx.take_along_axis(logits, top, axis=-1), axis=-1)
        return mx.take_along_axis(top, best_first, axis=-1)
    return lookahead


def switch_glus(model, layers=None) -> dict:
    """{layer index: (parent module, attribute name, mlx-lm SwitchGLU)}: the SwitchGLU under each
    `model.layers[i]` that has one (mlx-lm names it `mlp.switch_mlp` or
    `block_sparse_moe.switch_mlp`). layers: indices that must each have exactly one (FlashError
    otherwise); None: every layer, those without one left out."""
    found, counts = {}, {}
    for i, block in enumerate(model.layers):
        for _, parent in block.named_modules():
            for name, child in parent.children().items():
                if isinstance(child, SwitchGLU):
                    found[i], counts[i] = (parent, name, child), counts.get(i, 0) + 1
    for layer in (layers if layers is not None else counts):
        if counts.get(layer, 0) != 1:
            raise FlashError(f"layer {layer}: expected one SwitchGLU, found {counts.get(layer, 0)}")
    return found if layers is None else {layer: found[layer] for layer in layers}


def swap_switch_glu(model, store, make_module=None):
    """Replace each MoE layer's mlx-lm SwitchGLU (switch_glus) with a StreamedSwitchGLU over
    `store`. make_module: optional callable(layer, switch_glu, moe_block) -> module (defaults to a
    plain StreamedSwitchGLU). Returns {layer: (moe block, new module)}.
    """
    out = {}
    for layer, (parent, name, switch) in switch_glus(model, store.entries).items():
        module = (make_module(layer, switch, parent) if make_module
                  else StreamedSwitchGLU(store, layer, switch.activation))
        setattr(parent, name, module)
        out[layer] = (parent, module)
    return out
