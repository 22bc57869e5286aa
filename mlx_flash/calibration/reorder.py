"""Co-activation neuron order of a pack from its calibration pass (`calibrate --reorder`,
`bench reorder`).

Per layer, the thresholded model's activity on the calibration tokens (the neurons whose
|act| > t, as the predictors are fitted to) gives sparse/neuron_order.coactivation_order with as
many neurons per block as fit in one aligned read block; `reorder_neurons` then permutes the
pack's bundles on disk (pack/reorder.py) and the calibration model's FFN weights in memory, so
predictors fitted afterwards are in the new order. Stale predictors are removed first: they
index neurons by position.
"""

import mlx.core as mx
import numpy as np

from ..pack import read_manifest
from ..pack.reorder import reorder_pack
from ..sparse.neuron_order import bytes_per_token, chain_order, coactivation_order, frequency_order
from ..sparse.predictor import PREDICTORS_FILE, PREDICTORS_JSON
from .dense_pass import CalibrationData
from .fit import layer_activations, layer_threshold

MAX_ORDER_TOKENS = 4096  # activity rows the order is fitted on (cost grows with tokens x neurons)


def layer_activity(data: CalibrationData, layer: int, target_sparsity: float) -> np.ndarray:
    """bool [tokens, n]: the thresholded model's active neurons of `layer` on every calibration
    token (threshold from the training tokens, as calibrate_layer sets it)."""
    abs_act = layer_activations(data.ffns[layer], data.xs[layer], data.dtype)
    return abs_act > layer_threshold(data.ffns[layer], abs_act[: data.n_train], target_sparsity)


def neurons_per_block(entry: dict, alignment: int) -> int:
    return max(1, alignment // entry.stride)


def layer_orders(data: CalibrationData, target_sparsity: float, progress=False) -> dict:
    """{layer: co-activation order} fitted on the training tokens' activity."""
    from tqdm import tqdm

    manifest, out = data.manifest, {}
    entries = {b.layer: b for b in manifest.bundles}
    for i in tqdm(sorted(data.ffns), desc="neuron order", unit="layer", disable=not progress):
        active = layer_activity(data, i, target_sparsity)[: min(data.n_train, MAX_ORDER_TOKENS)]
        out[i] = coactivation_order(active, neurons_per_block(entries[i], manifest.alignment))
    return out


def _permute_rows(module, order):
    idx = mx.array(order)
    for name in ("weight", "scales", "biases", "bias"):
        if name in module:
            module[name] = module[name][idx]


def permute_ffn(ffn, order):
    """Permute a MaskedFFN's neurons in place: gate/up output rows, down input columns."""
    for proj in (ffn.gate, ffn.up):
        if proj is not None:
            _permute_rows(proj, order)
    ffn.down.weight = ffn.down.weight[:, mx.array(order)]  # dense_pass rebuilds down as a float Linear


def reorder_neurons(data: CalibrationData, orders: dict):
    """Apply orders to the pack on disk and to `data`'s model; removes the pack's predictors."""
    for name in (PREDICTORS_JSON, PREDICTORS_FILE):  # the json first: without it there are none
        (data.pack / name).unlink(missing_ok=True)
    reorder_pack(data.pack, orders)
    for i, order in orders.items():
        permute_ffn(data.ffns[i], order)
    data.manifest = read_manifest(data.pack)


def compare_orders(data: CalibrationData, target_sparsity: float, cost=None, progress=False) -> list:
    """Rows per layer: bytes the read planner reads per held-out token (and, with a `cost`, the
    seconds the memory plan prices them at) for the same active neurons under the pack's order,
    frequency order, co-activation order (calibrate --reorder's) and a nearest-neighbour chain
    (neuron_order.chain_order), all fitted on the training tokens."""
    from tqdm import tqdm

    manifest = data.manifest
    entries = {b.layer: b for b in manifest.bundles}
    rows = []
    for i in tqdm(sorted(data.ffns), desc="neuron order", unit="layer", disable=not progress):
        active = layer_activity(data, i, target_sparsity)
        fit, held = active[: min(data.n_train, MAX_ORDER_TOKENS)], active[data.n_train:]
        e = entries[i]
        kw = dict(offset=e.offset, align=manifest.alignment, cost=cost)
        orders = {"pack": np.arange(e.count), "frequency": frequency_order(fit),
                  "coactivation": coactivation_order(fit, neurons_per_block(e, manifest.alignment)),
                  "chain": chain_order(fit)}
        row = {"layer": i, "active": float(held.mean()), "stride": e.stride}
        for name, order in orders.items():
            row[name] = bytes_per_token(held, order, e.stride, **kw)
        rows.append(row)
    return rows
