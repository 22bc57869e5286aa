"""Routing traces and next-layer expert prediction (EdgeMoE 3.3.2).

A `RoutingTrace` records, per token (in decode order) and per MoE layer, the experts the router
chose and the hidden-state lookahead's guess for the next MoE layer (that layer's router applied to
this layer's MoE input). Two predictors of layer l+1's experts, known before layer l+1 routes:
  lookahead  the next router on this layer's input (the residual stream changes slowly)
  profile    EdgeMoE's statistical profile from a calibration trace: P(expert at l+1 | experts
             at l, l-1); an exact key (both sets) when calibration saw it often enough, else the
             pairwise conditionals summed (P(e | e') over e' chosen at l and at l-1)
"""

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np


@dataclass
class RoutingTrace:
    """experts: int [tokens, moe layers, top_k]; lookahead: int [tokens, moe layers, width] (the
    guess for the NEXT layer made at each layer; the last layer's row is unused); layers: ids."""
    experts: np.ndarray
    lookahead: np.ndarray
    layers: list

    def accesses(self):
        """[(layer, experts)] in execution order: token by token, layer by layer."""
        return [(self.layers[j], self.experts[t, j].tolist())
                for t in range(self.experts.shape[0]) for j in range(len(self.layers))]


class _RouteRecorder(nn.Module):
    """Wraps a SwitchGLU: records its expert ids and the next router's guess on its input."""

    def __init__(self, switch, lookahead):
        super().__init__()
        self.switch, self._lookahead = switch, lookahead
        self.seen = []

    def __call__(self, x, indices):
        guess = self._lookahead(x) if self._lookahead is not None else None
        self.seen.append((indices, guess))
        return self.switch(x, indices)


def record_routing(model, tokens: np.ndarray, width: int, seq_len=256) -> RoutingTrace:
    """Run `model` (an mlx-lm MoE model, all experts resident) over `tokens` in sequences of
    `seq_len` and record its routing; `width` = experts the lookahead guesses per layer."""
    from .switch import router_lookahead, switch_glus

    found = [(i, *where) for i, where in sorted(switch_glus(model).items())]
    recorders = []
    for j, (i, parent, name, switch) in enumerate(found):
        ahead = router_lookahead(found[j + 1][1], width) if j + 1 < len(found) else None
        rec = _RouteRecorder(switch, ahead)
        setattr(parent, name, rec)
        recorders.append(rec)
    experts, guesses = [], []
    try:
        for s in range(0, len(tokens), seq_len):
            model(mx.array(tokens[s: s + seq_len])[None])
            got = [r.seen.pop() for r in recorders]
            mx.eval([g for pair in got for g in pair if g is not None])
            experts.append(np.stack([np.array(ind).reshape(-1, ind.shape[-1]) for ind, _ in got], 1))
            n = experts[-1].shape[0]
            guesses.append(np.stack([np.array(g).reshape(n, -1) if g is not None
                                     else np.full((n, width), -1) for _, g in got], 1))
    finally:
        for (i, parent, name, switch) in found:
            setattr(parent, name, switch)
    return RoutingTrace(np.concatenate(experts), np.concatenate(guesses), [f[0] for f in found])


class RoutingProfile:
    """EdgeMoE's statistical profile of a calibration trace (see module docstring)."""

    def __init__(self, trace: RoutingTrace, n_experts: int, min_count=3):
        self.layers, self.n = list(trace.layers), n_experts
        L = len(self.layers)
        ex = trace.experts
        self.pair1 = np.zeros((L, n_experts, n_experts))  # [l, e at l-1, e at l]
        self.pair2 = np.zeros((L, n_experts, n_experts))  # [l, e at l-2, e at l]
        self.marginal = np.zeros((L, n_experts))
        self.exact = {}
        self.min_count = min_count
        for j in range(L):
            onehot = np.zeros((ex.shape[0], n_experts))
            np.put_along_axis(onehot, ex[:, j], 1.0, axis=1)
            self.marginal[j] = onehot.sum(0)
            for back, table in ((1, self.pair1), (2, self.pair2)):
                if j - back >= 0:
                    prev = np.zeros_like(onehot)
                    np.put_along_axis(prev, ex[:, j - back], 1.0, axis=1)
                    table[j] = prev.T @ onehot
            if j >= 1:
                for t in range(ex.shape[0]):
                    key = (j, tuple(sorted(ex[t, j - 1])), tuple(sorted(ex[t, j - 2])) if j >= 2 else ())
                    self.exact.setdefault(key, np.zeros(n_experts))[ex[t, j]] += 1

    def scores(self, j, prev1, prev2) -> np.ndarray:
        """Estimated P(expert at MoE layer index j) given the experts at j-1 and j-2."""
        key = (j, tuple(sorted(prev1)), tuple(sorted(prev2)))
        hit = self.exact.get(key)
        if hit is not None and hit.sum() >= self.min_count:
            return hit / hit.sum()
        s = self.marginal[j] / max(self.marginal[j].sum(), 1) * 1e-3
        for table, prev in ((self.pair1, prev1), (self.pair2, prev2)):
            for e in prev:
                row = table[j, e]
                if row.sum():
                    s = s + row / row.sum()
        return s

    def predict(self, j, prev1, prev2, width) -> list:
        s = self.scores(j, prev1, prev2)
        return [int(e) for e in np.argsort(-s, kind="stable")[:width]]

    def predictor(self, width):
        """callable(layer, experts at layer) -> [(next layer, predicted experts)] for the runtime
        (remembers the previous call's experts as layer l-1's)."""
        state = {"prev": None}

        def predict_next(layer, experts):
            j = self.layers.index(layer)
            prev = state["prev"] if j > 0 else ()
            state["prev"] = list(experts)
            if j + 1 >= len(self.layers):
                return []
            return [(self.layers[j + 1], self.predict(j + 1, list(experts), list(prev or ()), width))]
        return predict_next


def predictions(trace: RoutingTrace, kind: str, width: int, profile: RoutingProfile = None):
    """int [tokens, layers, width]: predicted experts for each (token, MoE layer index >= 1)
    (row 0 of every token is -1: nothing precedes the first MoE layer)."""
    T, L, _ = trace.experts.shape
    out = np.full((T, L, width), -1)
    for t in range(T):
        for j in range(1, L):
            if kind == "lookahead":
                out[t, j, :] = trace.lookahead[t, j - 1, :width]
            else:
                prev2 = trace.experts[t, j - 2] if j >= 2 else ()
                out[t, j] = profile.predict(j, trace.experts[t, j - 1], prev2, width)
    return out


def recall_precision(trace: RoutingTrace, predicted: np.ndarray) -> tuple:
    """(recall, precision) of `predicted` [tokens, layers, width] against the routed experts,
    over MoE layers 1.. (recall = routed experts that were predicted / routed)."""
    actual = trace.experts[:, 1:]
    pred = predicted[:, 1:]
    hits = (pred[:, :, :, None] == actual[:, :, None, :]).any(-1).sum()
    return float(hits / actual.size), float(hits / pred.size)


def preload_plan(trace: RoutingTrace, predicted: np.ndarray):
    """The `preload` callable of moe.cache.simulate: after access step (token t, layer index j),
    the predictions for (t, j+1)."""
    L = len(trace.layers)

    def plan(step, layer, experts):
        t, j = divmod(step, L)
        if j + 1 >= L:
            return []
        return [(trace.layers[j + 1], predicted[t, j + 1].tolist())]
    return plan
