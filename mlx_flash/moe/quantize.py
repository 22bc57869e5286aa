"""Expert quantizers that write MLX's affine format (so the runtime reads them unchanged).

MLX stores a weight w [out, in] at `bits` as w ~ scale * q + bias per group of `group_size`
inputs, q an unsigned `bits`-bit integer packed little-endian into uint32 words. `mx.quantize`
picks each group's scale and bias from its min and max and then moves them so that 0.0 is exact;
these quantizers pick them to minimise the error instead and round with error compensation:

- "minmax": scale = (max - min) / (2^bits - 1), bias = min. Exact for weights that already sit on
  such a grid: the derived MoE's gate/up rows come from SmolLM2's Q4_1 blocks (32 inputs, d * q +
  m), which `mx.quantize` at 4 bits does not reproduce (its zero snap moves the grid).
- "clip": minmax with the range shrunk by the ratio in `CLIP_RATIOS` whose rounding error,
  weighted by each input's mean square on the calibration tokens, is least (per output row and
  group).
- "gptq": GPTQ (Frantar et al. 2022) per expert with the routed inputs' second moment
  H = sum_t x_t x_t^T: columns are rounded in order and each one's rounding error is spread over
  the columns not yet rounded (H^-1's Cholesky factor), each group's scale/bias chosen as "clip"
  does when the group starts. Needs H.
- "gptq-fit": GPTQ's integers, then every row's scales and biases refit to the least error on the
  routed inputs, (w_hat - w)^T H (w_hat - w) (`refit_scales_biases`: a closed-form solve).
  (Taking the min..max grid's refit integers per row where that error is lower was measured
  worse end to end on the derived model: all-4-bit held-out perplexity 197.04 -> 201.50.)
- "gptq-cd": "gptq-fit", then the same error lowered further by coordinate descent on the
  integers (`descend_integers`: each weight in turn moves one step up or down when that lowers
  its row's error, QuantEase-style, Behdin et al. 2023), the scales and biases refit after each
  of `CD_ROUNDS` rounds. GPTQ rounds each column once, in order, against the columns not yet
  rounded; the descent revisits every column against all the others. Never raises the error.

All work in float64 NumPy on one MoE layer's stack of experts at a time ([E, out, in]).
"""

import mlx.core as mx
import numpy as np

from ..errors import FlashError

METHODS = ("mlx", "minmax", "clip", "gptq", "gptq-fit", "gptq-cd")
CLIP_RATIOS = tuple(np.round(np.linspace(1.0, 0.7, 13), 4))
GPTQ_DAMP = 0.01  # added to H's diagonal, as a fraction of its mean (the GPTQ paper's default)
CD_ROUNDS, CD_SWEEPS = 2, 2  # "gptq-cd": refits, and passes over the columns between refits


def pack_bits(q: np.ndarray, bits: int) -> np.ndarray:
    """uint32 [..., n * bits / 32] of unsigned integers q [..., n] < 2^bits, MLX's packing: a
    little-endian bit stream (value j at bits j*bits .. j*bits + bits - 1 of the row)."""
    q = np.asarray(q, dtype=np.uint64)
    n = q.shape[-1]
    if (n * bits) % 32:
        raise FlashError(f"{n} values of {bits} bits do not fill whole uint32 words")
    stream = ((q[..., :, None] >> np.arange(bits, dtype=np.uint64)) & 1).astype(np.uint8)
    words = stream.reshape(*q.shape[:-1], n * bits // 32, 32)
    return np.packbits(words, axis=-1, bitorder="little").view("<u4").reshape(
        *q.shape[:-1], n * bits // 32)


def group_params(w: np.ndarray, bits: int, ratios=(1.0,), weight=None) -> tuple:
    """(scale, bias) [..., 1] of groups w [..., group_size]: the range [min, max] shrunk by each
    ratio in turn, keeping the one with the least rounding error (times `weight`
    [..., group_size] when given)."""
    maxq = 2 ** bits - 1
    hi, lo = w.max(-1, keepdims=True), w.min(-1, keepdims=True)
    best = None
    for r in ratios:
        s = np.maximum((hi - lo) * r / maxq, 1e-12)
        b = lo * r if r != 1.0 else lo
        err = (np.clip(np.round((w - b) / s), 0, maxq) * s + b - w) ** 2
        err = (err if weight is None else err * weight).sum(-1, keepdims=True)
        if best is None:
            best = [err, s, b]
        else:
            keep = err < best[0]
            best = [np.where(keep, err, best[0]), np.where(keep, s, best[1]),
                    np.where(keep, b, best[2])]
    return best[1], best[2]


def round_to_grid(w: np.ndarray, bits: int, group_size: int, ratios=(1.0,), col_weight=None):
    """(q int [E, out, in], scale, bias [E, out, in / group_size]) of w [E, out, in] rounded to
    the nearest grid point of each group (no error compensation)."""
    e, out, n = w.shape
    wg = w.reshape(e, out, n // group_size, group_size)
    cw = None if col_weight is None else col_weight.reshape(e, 1, n // group_size, group_size)
    s, b = group_params(wg, bits, ratios, cw)
    q = np.clip(np.round((wg - b) / s), 0, 2 ** bits - 1)
    return q.reshape(e, out, n).astype(np.int64), s[..., 0], b[..., 0]


def gptq_factor(hessian: np.ndarray) -> dict:
    """GPTQ's per-expert inverse factor of hessian [E, in, in] (shared by every matrix and width
    that reads the same inputs): {"u": upper Cholesky factor of (H + damping)^-1, "diag": H's
    diagonal, "dead": inputs no routed token uses}."""
    h = hessian.astype(np.float64).copy()
    n = h.shape[-1]
    dead = np.einsum("eii->ei", h) == 0  # their weights do not matter: zeroed, H made invertible
    h[:, np.arange(n), np.arange(n)] += np.where(dead, 1.0, 0.0)
    diag = np.einsum("eii->ei", h).copy()
    h[:, np.arange(n), np.arange(n)] += GPTQ_DAMP * diag.mean(-1, keepdims=True)
    # row j of the factor spreads column j's rounding error over the later columns
    u = np.swapaxes(np.linalg.cholesky(np.linalg.inv(h)), 1, 2)
    return {"u": u, "diag": diag, "dead": dead}


def gptq(w: np.ndarray, factor: dict, bits: int, group_size: int, ratios=CLIP_RATIOS):
    """(q int [E, out, in], scale, bias [E, out, in / group_size]) of w [E, out, in] by GPTQ with
    each expert's `gptq_factor` of its input second moment (module docstring)."""
    w = w.astype(np.float64).copy()
    e, out, n = w.shape
    maxq = 2 ** bits - 1
    u, diag = factor["u"], factor["diag"]
    w[np.broadcast_to(factor["dead"][:, None, :], w.shape)] = 0.0
    q = np.zeros(w.shape, np.int64)
    scales = np.zeros((e, out, n // group_size))
    biases = np.zeros_like(scales)
    for g in range(0, n, group_size):
        s, b = group_params(w[:, :, g: g + group_size], bits, ratios, diag[:, None, g: g + group_size])
        s, b = s[..., 0], b[..., 0]
        scales[:, :, g // group_size], biases[:, :, g // group_size] = s, b
        end = g + group_size
        errs = np.zeros((e, out, group_size))
        for j in range(g, end):
            qj = np.clip(np.round((w[:, :, j] - b) / s), 0, maxq)
            q[:, :, j] = qj
            errs[:, :, j - g] = err = (w[:, :, j] - (qj * s + b)) / u[:, j, j][:, None]
            w[:, :, j + 1: end] -= err[:, :, None] * u[:, None, j, j + 1: end]
        # the group's errors reach the later columns in one product (GPTQ's lazy batch update)
        w[:, :, end:] -= errs @ u[:, g:end, end:]
    return q, scales, biases


def refit_scales_biases(w: np.ndarray, q: np.ndarray, scales: np.ndarray, biases: np.ndarray,
                        hessian: np.ndarray, group_size: int, ridge: float = 1e-6) -> tuple:
    """(scales, biases) [E, out, in / group_size] float64 that minimise each output row's error
    on the routed inputs, (w_hat - w)^T H (w_hat - w) with w_hat = scale * q + bias per group,
    for fixed integers q [E, out, in] (GPTQ's). w [E, out, in]; hessian [E, in, in] (H).

    The error is quadratic in the row's 2 * groups scales and biases, so the optimum is one small
    linear solve per row; a ridge (`ridge` times the system's mean diagonal) toward the given
    scales/biases keeps groups whose q is constant, or whose inputs no token uses, where they were.
    The given scales/biases are a feasible point, so the error never grows.
    """
    e, out, n = w.shape
    g = n // group_size
    s_new, b_new = np.empty(scales.shape), np.empty(biases.shape)
    for i in range(e):
        h = hessian[i].astype(np.float64)
        qi = q[i].astype(np.float64)
        hw = w[i].astype(np.float64) @ h                                    # [out, in]
        # t[r, g1, j] = sum over inputs k of group g1 of q[r, k] H[k, j]
        t = np.einsum("rgk,gkj->rgj", qi.reshape(out, g, group_size), h.reshape(g, group_size, n))
        t = t.reshape(out, g, g, group_size)
        m = np.empty((out, 2 * g, 2 * g))
        m[:, :g, :g] = (t * qi.reshape(out, 1, g, group_size)).sum(-1)     # scale x scale
        m[:, :g, g:] = t.sum(-1)                                            # scale x bias
        m[:, g:, :g] = np.swapaxes(m[:, :g, g:], 1, 2)
        m[:, g:, g:] = h.reshape(g, group_size, g, group_size).sum((1, 3))  # bias x bias
        v = np.concatenate([(qi * hw).reshape(out, g, group_size).sum(-1),
                            hw.reshape(out, g, group_size).sum(-1)], axis=-1)
        theta0 = np.concatenate([scales[i], biases[i]], axis=-1).astype(np.float64)
        lam = ridge * np.maximum(np.einsum("rii->r", m) / (2 * g), 1e-30)[:, None]
        m[:, np.arange(2 * g), np.arange(2 * g)] += lam
        theta = np.linalg.solve(m, (v + lam * theta0)[..., None])[..., 0]
        s_new[i], b_new[i] = theta[:, :g], theta[:, g:]
    return s_new, b_new


def descend_integers(w: np.ndarray, q: np.ndarray, scales: np.ndarray, biases: np.ndarray,
                     hessian: np.ndarray, bits: int, group_size: int, sweeps: int = CD_SWEEPS):
    """(q int [E, out, in], moves) with each row's error (w_hat - w)^T H (w_hat - w) lowered by
    coordinate descent on the integers, scales [E, out, in / group_size] and biases fixed:
    `sweeps` passes over the columns, each weight moving one step (within 0..2^bits - 1) when
    that lowers the error; stops early after a pass without a move. w [E, out, in]; hessian
    [E, in, in]. The gradient H (w_hat - w) is kept up to date row by row as weights move."""
    maxq = 2 ** bits - 1
    q = q.astype(np.int64).copy()
    s = np.repeat(scales, group_size, axis=-1)
    grad = np.einsum("eon,enm->eom", q * s + np.repeat(biases, group_size, axis=-1) - w, hessian)
    diag = np.einsum("eii->ei", hessian)
    moves = 0
    for _ in range(sweeps):
        moved = 0
        for j in range(w.shape[-1]):
            sj, gj, hjj = s[:, :, j], grad[:, :, j], diag[:, j][:, None]
            best = np.zeros_like(sj)
            step = np.zeros(sj.shape, np.int64)
            for d in (-1, 1):
                qn = q[:, :, j] + d
                change = 2 * d * sj * gj + sj * sj * hjj  # the error's change for that move
                take = (qn >= 0) & (qn <= maxq) & (change < best)
                best, step = np.where(take, change, best), np.where(take, d, step)
            e_idx, o_idx = np.nonzero(step)
            if e_idx.size:
                moved += e_idx.size
                q[e_idx, o_idx, j] += step[e_idx, o_idx]
                grad[e_idx, o_idx] += (step[e_idx, o_idx] * sj[e_idx, o_idx])[:, None] * hessian[e_idx, j]
        moves += moved
        if not moved:
            break
    return q, moves


def quantize_experts(w, bits: int, group_size: int, method: str = "mlx", hessian=None,
                     factor=None) -> tuple:
    """(packed uint32, scales, biases) mx.arrays of the expert stack w [E, out, in] in MLX's affine
    format (as `mx.quantize` returns them; scales/biases in w's float dtype), by `method`
    (module docstring; "mlx" is `mx.quantize`). hessian [E, in, in]: the routed inputs' second
    moment ("gptq" needs it or its `gptq_factor` `factor`, "gptq-fit" and "gptq-cd" need it; "clip" weights
    its errors by its diagonal when given)."""
    if method == "mlx":
        return mx.quantize(w, group_size=group_size, bits=bits)
    if method not in METHODS:
        raise FlashError(f"--expert-quantizer {method}: not one of {', '.join(METHODS)}")
    dtype = w.dtype
    wn = np.array(w.astype(mx.float32), dtype=np.float64)
    if method.startswith("gptq"):
        if hessian is None and (factor is None or method != "gptq"):
            raise FlashError(f"--expert-quantizer {method}: needs calibration text (--calib-text)")
        factor = factor or gptq_factor(hessian)
        q, s, b = gptq(wn, factor, bits, group_size)
        if method != "gptq":
            s, b = refit_scales_biases(wn, q, s, b, hessian, group_size)
        if method == "gptq-cd":
            for _ in range(CD_ROUNDS):  # (unused inputs: H's rows and columns are 0 there)
                q, _ = descend_integers(wn, q, s, b, hessian, bits, group_size)
                s, b = refit_scales_biases(wn, q, s, b, hessian, group_size)
    elif method == "clip":
        col = None if hessian is None else np.einsum("eii->ei", hessian)
        q, s, b = round_to_grid(wn, bits, group_size, CLIP_RATIOS, col)
    else:
        q, s, b = round_to_grid(wn, bits, group_size)
    return (mx.array(pack_bits(q, bits)), mx.array(s.astype(np.float32)).astype(dtype),
            mx.array(b.astype(np.float32)).astype(dtype))


def dequantize_experts(packed, scales, biases, bits: int, group_size: int) -> mx.array:
    """float32 [E, out, in] of a quantized stack, as the runtime's kernels see it."""
    return mx.dequantize(packed, scales, biases, group_size=group_size, bits=bits).astype(mx.float32)
