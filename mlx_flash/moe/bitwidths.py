"""Expert-wise bit widths (EdgeMoE 3.2): how much each expert loses at each width, and which width
each expert gets under an average-bits target.

Importance proxy: the squared error an expert's quantization puts into the layer's output, summed
over the calibration tokens routed to it (each weighted by its router weight squared when known;
calibration passes 1, the router weights being applied outside mlx-lm's SwitchGLU),

    err[e, b] = sum_t  w_te^2 * || expert_e^b(x_t) - expert_e(x_t) ||^2  /  sum_t,e w_te^2 || expert_e(x_t) ||^2

relative to the energy of the layer's expert outputs: activations grow with depth, and the raw
error ranked late layers' experts first while the loss is, if anything, more sensitive to early
ones (measured on the derived model: Spearman -0.27 raw against the loss change).

so an expert that is rarely chosen, or whose weights quantize well, is cheap to narrow. EdgeMoE
measures importance by narrowing one expert and measuring the loss change; that costs a forward
pass per (expert, width), the proxy one layer-local matmul per expert and width.
`calibration.expert_bits.validate_importance` measures the rank correlation of the two.
"""

import heapq

import mlx.core as mx
import numpy as np

from ..errors import FlashError

WIDTHS = (2, 3, 4, 8)  # EdgeMoE's choices; MLX quantizes at 2, 3, 4, 5, 6 and 8 bits


def quantize_dequantize(w: mx.array, bits: int, group_size: int) -> mx.array:
    """w [..., in] as MLX's affine quantization at `bits` stores it (float32 values)."""
    q = mx.quantize(w, group_size=group_size, bits=bits)
    return mx.dequantize(*q, group_size=group_size, bits=bits).astype(mx.float32)


def expert_output(x, gate, up, down, activation):
    """[tokens, hidden] of one SwiGLU expert: down(activation(up x, gate x)) (mlx-lm's order)."""
    return activation(x @ up.T, x @ gate.T) @ down.T


def quantization_errors(x: np.ndarray, ids: np.ndarray, weights: np.ndarray, experts: dict,
                        activation, group_size: int, widths=WIDTHS, quantized=None) -> np.ndarray:
    """err [experts, len(widths)] of one MoE layer (module docstring).

    x: float32 [tokens, hidden] the layer's SwitchGLU input; ids: int [tokens, k] routed experts;
    weights: float [tokens, k] their router weights (ones if unknown); experts: {"gate", "up",
    "down"}: float mx.array [E, out, in] stacks. quantized: {bits: {"gate", "up", "down": float
    [E, out, in]}} the stacks as the pack will hold them at each width (moe/quantize.py);
    default `mx.quantize`'s.
    """
    n = experts["up"].shape[0]
    err = np.zeros((n, len(widths)))
    energy = 0.0
    for e in range(n):
        rows, col = np.nonzero(ids == e)
        if rows.size == 0:
            continue
        xe = mx.array(x[rows])
        w2 = mx.array(weights[rows, col].astype(np.float32) ** 2)
        mats = {r: experts[r][e].astype(mx.float32) for r in ("gate", "up", "down")}
        ref = expert_output(xe, mats["gate"], mats["up"], mats["down"], activation)
        energy += float(mx.sum(w2 * mx.sum(ref * ref, axis=-1)))
        for j, b in enumerate(widths):
            if quantized is None:
                qm = {r: quantize_dequantize(m, b, group_size) for r, m in mats.items()}
            else:
                qm = {r: quantized[b][r][e] for r in mats}
            y = expert_output(xe, qm["gate"], qm["up"], qm["down"], activation)
            err[e, j] = float(mx.sum(w2 * mx.sum((y - ref) ** 2, axis=-1)))
    return err / max(energy, 1e-30)


def input_moments(x: np.ndarray, ids: np.ndarray, experts: dict, activation) -> dict:
    """{"x": [E, hidden, hidden], "h": [E, ffn, ffn]} float64: each expert's second moment
    sum_t v_t v_t^T of its routed tokens' inputs x_t (gate and up's input) and of its float
    hidden activations h_t = activation(up x_t, gate x_t) (down's input): GPTQ's H."""
    n = experts["up"].shape[0]
    hid, ffn = experts["up"].shape[2], experts["up"].shape[1]
    hx, hh = np.zeros((n, hid, hid)), np.zeros((n, ffn, ffn))
    for e in range(n):
        rows = np.flatnonzero((ids == e).any(-1))
        if rows.size == 0:
            continue
        xe = mx.array(x[rows])
        h = activation(xe @ experts["up"][e].astype(mx.float32).T,
                       xe @ experts["gate"][e].astype(mx.float32).T)
        hx[e], hh[e] = np.array(xe.T @ xe), np.array(h.T @ h)  # float32 sums, float64 kept
    return {"x": hx, "h": hh}


SOLVERS = ("knapsack", "greedy")


def assign_widths(errors: dict, target_bits: float, sizes: dict = None, widths=WIDTHS,
                  solver: str = "knapsack") -> dict:
    """{layer: [bits of each expert]} minimising the summed error under a mean of `target_bits`
    per expert weight (weighted by `sizes` {layer: [weights per expert]}, default equal).

    errors: {layer: err [experts, len(widths)]} (`quantization_errors`, or any additive cost).
    solver "knapsack": the exact minimum (`knapsack_widths`; equal sizes only). "greedy": every
    expert starts at the narrowest width and the step with the largest error drop per added bit of
    the total is taken while the budget allows; it misses a wide step whose first increment gains
    little (2 -> 3 cheap, 3 -> 8 worth it), which the knapsack does not.
    """
    widths = tuple(sorted(widths))
    if not widths[0] <= target_bits <= widths[-1]:
        raise FlashError(f"--expert-bits {target_bits:g}: must be within {widths[0]}..{widths[-1]}")
    if solver not in SOLVERS:
        raise FlashError(f"--expert-assign {solver}: not one of {', '.join(SOLVERS)}")
    if solver == "knapsack":
        if sizes and len({float(s) for ss in sizes.values() for s in ss}) > 1:
            raise FlashError("--expert-assign knapsack: experts of one size only")
        return knapsack_widths(errors, target_bits, widths)
    keys = [(layer, e) for layer, err in errors.items() for e in range(err.shape[0])]
    size = {k: float(sizes[k[0]][k[1]]) if sizes else 1.0 for k in keys}
    budget = target_bits * sum(size.values())
    level = {k: 0 for k in keys}
    used = widths[0] * sum(size.values())

    def step(k):
        j = level[k]
        if j + 1 >= len(widths):
            return None
        cost = (widths[j + 1] - widths[j]) * size[k]
        gain = errors[k[0]][k[1], j] - errors[k[0]][k[1], j + 1]
        return (-gain / cost, k, cost)

    heap = [s for s in map(step, keys) if s is not None]
    heapq.heapify(heap)
    while heap:
        _, k, cost = heapq.heappop(heap)
        if used + cost > budget + 1e-9:
            continue  # a cheaper step of another expert may still fit
        used += cost
        level[k] += 1
        nxt = step(k)
        if nxt is not None:
            heapq.heappush(heap, nxt)
    return {layer: [widths[level[(layer, e)]] for e in range(err.shape[0])]
            for layer, err in errors.items()}


def knapsack_widths(errors: dict, target_bits: float, widths=WIDTHS) -> dict:
    """{layer: [bits of each expert]} with the least summed error whose mean width is at most
    `target_bits` (experts of equal size): the exact multiple-choice knapsack, by dynamic
    programming over the bits added above the narrowest width (at most (max - min width) x
    experts states; ~3k x 480 for the derived model, milliseconds)."""
    widths = tuple(sorted(widths))
    keys = [(layer, e) for layer, err in errors.items() for e in range(err.shape[0])]
    extra = [w - widths[0] for w in widths]
    cap = int(np.floor((target_bits - widths[0]) * len(keys) + 1e-9))
    cost = np.zeros(cap + 1)  # least error of the experts so far using at most c extra bits
    choice = np.zeros((len(keys), cap + 1), np.int8)
    for i, (layer, e) in enumerate(keys):
        err = errors[layer][e]
        best = np.full(cap + 1, np.inf)
        for j, x in enumerate(extra):
            if x > cap:
                break
            cand = np.full(cap + 1, np.inf)
            cand[x:] = cost[: cap + 1 - x] + err[j]
            take = cand < best
            best[take], choice[i, take] = cand[take], j
        cost = best
    level, c = {}, cap
    for i in range(len(keys) - 1, -1, -1):  # walk the choices back from the full budget
        j = int(choice[i, c])
        level[keys[i]] = j
        c -= extra[j]
    return {layer: [widths[level[(layer, e)]] for e in range(err.shape[0])]
            for layer, err in errors.items()}


def mean_bits(assignment: dict, sizes: dict = None) -> float:
    """Mean width per expert weight of an assignment (weighted by `sizes`, default equal)."""
    num = den = 0.0
    for layer, bits in assignment.items():
        for e, b in enumerate(bits):
            s = float(sizes[layer][e]) if sizes else 1.0
            num, den = num + b * s, den + s
    return num / den
