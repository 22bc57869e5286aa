"""Load a flash pack as an mlx-lm model whose FFNs run as FlashConfig.mode says.

The model class comes from the pack's config (`get_model_classes`), resident weights from the
pack, and each layer's MLP is swapped for a `sparse.ffn.FlashFFN` at the seam of DESIGN.md:
mlx-lm's MLP object (`model.layers[i].mlp`, e.g. llama's gate/up/down) keeps its activation and
loses its projections; OPT's swap point `layer.mlp` gets a down(relu(up x)) module.
Statistics: `model.flash_stats` (sparse.stats.FlashStats).
"""

import functools
import os
import weakref
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from mlx.utils import tree_flatten

from ..config import FlashConfig
from ..cpu.patch import patch_layers
from ..errors import FlashError
from ..io import FlashLoader
from ..io.files import huge_page_bytes
from ..pack import load_resident
from ..sparse.budget import (budget_param, expected_read_seconds, plan_memory, priced_read_fractions,
                             resolve_budget, row_bytes)
from ..sparse.ffn import (CurrentRows, FlashFFN, FlashRuntime, RowDown, RowProjection, StreamPrefetcher,
                          UpDownMLP, check_mlp_shape, layout_key, sparse_layers_to_eval)
from ..sparse.neuron_cache import NeuronCache
from ..sparse.predictor import (activation_fn, cache_read_fraction, calibrated_capacity, load_predictors,
                                predicted_density, read_predictors_json, sparse_read_calls,
                                sparse_read_fraction)
from ..sparse.stats import FlashStats
from .auto import resolve_auto
from .loader import build_model, load_weights_checked


def build_flash_model(pack_dir, flash_config=None, *, predictors=None, capacity=None, density=None,
                      prefetch=True, lookahead=None):
    """The mlx-lm model of a flash pack with its FFNs swapped per mode (no tokenizer).

    predictors: {layer: callable(x) -> bool mask [..., n_neurons]} to use instead of the pack's
      (tests, experiments). capacity: {layer: neuron-cache rows} (Req_i) instead of calibration's.
    density: {layer: predicted fraction of neurons per token} for the per-layer flash plan
      (sparse/budget.py); default: the pack's calibration statistics when its predictors are
      used, none (every layer sparse, as before the per-layer plan) for predictors given here.
    prefetch: flash layers the plan streams whole are read ahead by a background reader (a ring
      of two streaming buffers, counted in the budget); False reads them in turn, as hybrid does.
    lookahead: with the pack's exact resident-gate predictors (convert --gate-bits, calibrate
      --kind gate-threshold), each sparse layer followed by a sparse layer reads that layer's
      lookahead neurons while it computes (FlashRuntime.set_lookahead; its buffers, two of
      Req_1 rows plus their staging, come out of the budget). None: off unless the environment
      sets MLX_FLASH_LOOKAHEAD=1 (idle, on the 88-minute CATS packs at 65%, it made flash slower:
      129.7 vs 108.6 ms/token, float16 resident; 67.8 vs 55.8, 8-bit resident; in the decode
      primitive too, 59.5-66.3 vs 48.4-63.8: docs/benchmarks.md).
    """
    pack = Path(pack_dir)
    cfg = flash_config or FlashConfig()
    loader = FlashLoader(pack, threads=cfg.threads)
    manifest = loader.manifest  # manifest.json and predictors.json are parsed once each
    pack_doc = functools.cache(lambda: read_predictors_json(pack, manifest))
    try:
        cfg, auto_note = resolve_auto(pack, manifest, cfg, predictors_doc=pack_doc)
        if any(b.kind != "neurons" for b in manifest.bundles):
            raise FlashError(f"{pack}: has MoE expert bundles; the dense FFN runtime needs neuron bundles")
        read_cost = measured = by_rows = overflow_rows = None
        if cfg.mode == "flash":
            if predictors is None:
                doc = pack_doc()
                predictors = pack_predictors(pack, manifest, doc)
                density = density if density is not None else predicted_density(pack, doc)
                calls = sparse_read_calls(pack, cfg.window, doc)
                if calls:  # calibration's real read sizes, priced with this machine's cost model now
                    measured, by_rows = priced_read_fractions(loader, calls)
                else:  # older packs: the prices stored at calibration time
                    measured = sparse_read_fraction(pack, cfg.window, doc)
                    by_rows = cache_read_fraction(pack, cfg.window, doc)
                # one token's predicted neurons (99th percentile), the largest over the layers
                overflow_rows = max(calibrated_capacity(pack, 1, doc).values(), default=None)
            capacity = capacity if capacity is not None else calibrated_capacity(pack, cfg.window, pack_doc())
            read_cost = lambda layer, k: expected_read_seconds(loader, layer, k)  # noqa: E731
        if lookahead is None:
            lookahead = os.environ.get("MLX_FLASH_LOOKAHEAD", "0") == "1"
        ahead_rows = (lookahead_rows(pack, manifest, predictors, pack_doc())
                      if cfg.mode == "flash" and lookahead else 0)
        budget = cfg.memory_budget
        # two lookahead buffers and the reader's staging, out of the budget
        ahead_buffer = ahead_rows * max(row_bytes(b) for b in manifest.bundles)
        ahead_bytes = 2 * ahead_buffer + huge_page_bytes(ahead_buffer) if ahead_rows else 0
        if ahead_bytes and budget is not None:
            budget = resolve_budget(budget, manifest) - ahead_bytes

        def plan_for(budget):
            return plan_memory(manifest, cfg.mode, budget,
                               predictor_bytes={i: _nbytes({i: p}) for i, p in (predictors or {}).items()}
                               if cfg.mode == "flash" else 0,
                               requested_capacity=capacity, density=density, read_cost=read_cost,
                               prefetch=prefetch, sparse_read_fraction=measured,
                               cache_read_fraction=by_rows, overflow_rows=overflow_rows)
        try:
            plan = plan_for(budget)
        except FlashError:
            if not ahead_bytes:
                raise
            ahead_rows = ahead_bytes = 0  # the buffers do not fit beside the minimum: no lookahead
            plan = plan_for(cfg.memory_budget)
        if ahead_bytes and plan.capacity:  # the plan shows the budget asked for, the buffers in it
            plan.lookahead = ahead_bytes
            if cfg.memory_budget is not None:
                plan.budget = resolve_budget(cfg.memory_budget, manifest)
                plan.budget_param = budget_param(cfg.memory_budget)
        # The thresholded model calibration measured, on every flash layer the plan keeps whole too.
        thresholds = activation_thresholds(predictors) if cfg.mode == "flash" else {}
        if cfg.mode == "flash" and (plan.resident_layers or plan.streamed_layers):
            predictors = {i: p for i, p in predictors.items() if i in plan.capacity}  # only sparse layers
        config, weights = load_resident(pack, manifest=manifest)
        model = build_model(config, weights)
        stats = FlashStats(plan)
        runtime = FlashRuntime(loader, stats, window=cfg.window, predictors=predictors,
                               overflow_rows=plan.overflow_rows, max_read_bytes=plan.overflow_stage)
        checked, kinds, currents = set(), {}, {}
        for entry in manifest.bundles:
            layer = entry.layer
            kind = ("resident" if layer in plan.resident_layers
                    else "encoded" if layer in plan.encoded_layers
                    else "sparse" if cfg.mode == "flash" and layer not in plan.streamed_layers
                    else "streamed")
            kinds[layer] = kind
            current = currents[layer] = _swap_ffn(model, entry, weights, runtime, kind, checked, config,
                                                  thresholds.get(layer))
            if getattr((predictors or {}).get(layer), "resident_gate", False):
                predictors[layer].share_gate(current.resident_gate)  # its gate rows: the model's, one copy
            if kind == "resident":
                runtime.caches[layer] = cache = NeuronCache(loader, layer, entry.count, plan.overflow_stage)
                cache.load(range(entry.count), step=0)
            elif kind == "encoded":
                runtime.held[layer] = loader.read_encoded(layer)[:2]
            elif kind == "sparse":
                runtime.caches[layer] = NeuronCache(loader, layer, plan.capacity[layer], plan.overflow_stage)
        if plan.streamed_layers and plan.prefetch:
            runtime.prefetcher = StreamPrefetcher(runtime, plan.streamed_layers)
        runtime.currents = currents
        runtime.eval_sparse = sparse_layers_to_eval(kinds, runtime.prefetcher is not None)
        load_weights_checked(model, weights, pack)
        if ahead_rows:
            runtime.set_lookahead(lookahead_pairs(model, kinds, predictors or {}, manifest), ahead_rows)
        patch_layers(model)
        model.flash_auto_note = auto_note
        model.flash_stats = stats
        model.flash_runtime = runtime
        stats.reset()
    except BaseException:
        loader.close()  # no half-built model keeps reader threads and open files
        raise
    # The model owns the loader: its threads, AIO contexts and files go when the model does.
    weakref.finalize(model, runtime.close)
    return model


def _module_at(root, path: str):
    node = root
    for part in path.split("."):
        node = node[int(part)] if isinstance(node, list) else getattr(node, part, None)
        if node is None:
            return None
    return node


def activation_thresholds(predictors) -> dict:
    """{layer: (threshold, act)} of the predictors that carry a positive activation threshold."""
    out = {}
    for i, p in (predictors or {}).items():
        t = float(getattr(p, "threshold", 0.0) or 0.0)
        if t > 0:
            out[i] = (t, activation_fn(getattr(p, "activation", "silu")))
    return out


def _swap_ffn(model, entry, weights, runtime, kind, checked, config, threshold=None):
    """Replace the MLP of `entry`'s layer by a FlashFFN; pops its resident tensors (down bias, a
    resident gate) and returns its CurrentRows.
    threshold: (activation threshold, act) of the thresholded model, or None."""
    layer = entry.layer
    modules, quant = {}, {}
    for c in entry.components:
        role, part = c.name.split(".", 1)
        if part == "weight":
            modules[role] = c.source.rsplit(".", 1)[0]
            if c.quantization:
                quant[role] = c.quantization
    resident_gate = None
    if entry.resident_gate:  # the gate is resident, quantized: not in the rows (CurrentRows)
        modules["gate"] = source = entry.resident_gate["source"]
        quant["gate"] = {k: entry.resident_gate[k] for k in ("group_size", "bits")}
        resident_gate = {part: weights.pop(f"{source}.{part}") for part in ("weight", "scales", "biases", "bias")
                         if f"{source}.{part}" in weights}
        if not {"weight", "scales", "biases"} <= set(resident_gate):
            raise FlashError(f"layer {layer}: the resident gate {source} is not in the resident tensors")
        mx.eval(resident_gate)
    parents = {m.rsplit(".", 1)[0] for m in modules.values()}
    if len(parents) != 1 or "up" not in modules or "down_t" not in modules:
        raise FlashError(f"layer {layer}: unsupported MLP shape (projections {sorted(modules.values())})")
    holder_path = parents.pop()
    holder = _module_at(model, holder_path)
    if holder is None:
        raise FlashError(f"{holder_path}: not found in the {config.get('model_type')} model")
    down_module = modules["down_t"]
    down_bias = weights.pop(f"{down_module}.bias", None)
    current = CurrentRows(quant, down_bias, resident_gate)
    if getattr(holder, "mlp", 0) is None:
        # OPT-style swap point: the layer computes fc2(relu(fc1 x)) itself unless mlp is set
        mlp = UpDownMLP(nn.relu)
        mlp.up, mlp.down = RowProjection("up", current), RowDown(current)
        for m in modules.values():
            delattr(holder, m.rsplit(".", 1)[1])
        parent, attr = holder, "mlp"
    else:
        mlp = holder
        for role, m in modules.items():
            attr_name = m.rsplit(".", 1)[1]
            if attr_name not in mlp:
                raise FlashError(f"{m}: unsupported MLP shape (no {attr_name} in {type(mlp).__name__})")
            mlp[attr_name] = RowDown(current) if role == "down_t" else RowProjection(role, current)
        parent_path, attr = holder_path.rsplit(".", 1)
        parent = _module_at(model, parent_path)
    if type(mlp) not in checked:
        check_mlp_shape(mlp, current, sorted(modules), config["hidden_size"], holder_path)
        checked.add(type(mlp))
    if threshold is not None and not masks_like_model(mlp, *threshold):
        current.set_threshold(*threshold, "gate" if "gate" in modules else "up")
    setattr(parent, attr, FlashFFN(mlp, current, layer, kind, runtime))
    return current


def masks_like_model(mlp, threshold: float, act) -> bool:
    """True when the model's own MLP already zeroes every hidden value the thresholded model
    would (|act(gate x)| <= threshold): relu_llama's CATS, |silu(g)| > t, with its own t at least
    `threshold`. Masking the gate's output first would then change nothing (silu(0) = 0), so the
    row projections skip it: fewer ops per sparse layer call, the same logits bit for bit.
    relu_llama's product threshold (|silu(g) u| > t, calibration's threshold its own t): the
    model's rule is the thresholded model, which no gate mask expresses."""
    own = float(getattr(mlp, "threshold", 0.0) or 0.0)
    return getattr(mlp, "hidden_act", None) in ("cats", "product") and act is nn.silu and own >= threshold


def lookahead_rows(pack: Path, manifest, predictors, doc=None) -> int:
    """Rows of each lookahead buffer: the median over the layers of one token's predicted neurons
    (calibration's Req_1), when every layer has the exact resident-gate predictor; else 0 (off).
    doc: the pack's predictors.json when already read."""
    if not predictors or len(predictors) < 2 or not all(
            getattr(p, "kind", None) == "gate-threshold" and getattr(p, "resident_gate", False)
            for p in predictors.values()):
        return 0
    if len({layout_key(b) for b in manifest.bundles}) != 1:
        return 0  # the two buffers serve every layer: one bundle layout
    req = sorted(calibrated_capacity(pack, 1, doc).values())
    return int(req[len(req) // 2])


def lookahead_pairs(model, kinds: dict, predictors: dict, manifest) -> dict:
    """{sparse layer i: (sparse layer i + 1, its post-attention RMSNorm weight / layer i's)} for
    consecutive sparse layers with the exact resident-gate predictor."""
    pairs = {}
    for i in sorted(kinds):
        j = i + 1
        if kinds.get(i) != "sparse" or kinds.get(j) != "sparse" or j not in predictors:
            continue
        norms = [getattr(model.layers[k], "post_attention_layernorm", None) for k in (i, j)]
        if any(n is None or "weight" not in n for n in norms):
            continue
        wi, wj = (n.weight.astype(mx.float32) for n in norms)
        scale = mx.where(mx.abs(wi) > 1e-6, wj / wi, mx.zeros_like(wi)).astype(norms[0].weight.dtype)
        mx.eval(scale)
        pairs[i] = (j, scale)
    return pairs


def pack_predictors(pack: Path, manifest=None, doc=None):
    """The pack's calibrated predictors {layer: predictor}; FlashError when it has none.
    manifest / doc: the pack's Manifest and predictors.json when already read."""
    predictors = load_predictors(pack, manifest, doc)
    if not predictors:
        raise FlashError(f"{pack}: --mode flash needs activation predictors and this pack has none; "
                         f"make them with python -m mlx_flash.calibrate --model {pack}")
    return predictors


def _nbytes(predictors) -> int:
    """Bytes of the predictors' arrays (0 for callables without parameters)."""
    total = 0
    for p in (predictors or {}).values():
        if isinstance(p, nn.Module):
            total += sum(v.nbytes for _, v in tree_flatten(p.parameters()))
        else:
            total += int(getattr(p, "nbytes", 0))
    return total
