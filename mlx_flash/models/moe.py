"""Load an MoE flash pack as an mlx-lm model whose SwitchGLU experts stream from the pack.

Modes (FlashConfig.mode): dense = every expert resident (IO-FREE); naive = each layer call reads
its chosen experts (IO-EXP); hybrid = per-layer expert cache, no prediction; flash = the cache plus
predicted preloading of the next layer's experts (EdgeMoE 3.3).
The router, attention, norms, embeddings and shared experts are the pack's resident tensors.

Compute: where the CPU kernels run (`cpu.ops.kernels_active()`: Linux/CPU with the extension
built; MLX_FLASH_KERNELS=0 or `set_kernels_enabled(False)` turns them off, as for dense models)
the model's layers are patched onto them (`cpu.patch.patch_layers`) and the experts run on them
(moe.switch); dense mode then holds every expert in a slot bank read at load, so it is the same
kernel path with nothing streamed. Elsewhere (Metal, kernels off) mlx-lm's own ops run and every
mode is bit-identical to mlx-lm's fully loaded model.
"""

import weakref
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..config import FlashConfig, parse_memory_budget
from ..cpu import ops
from ..cpu.patch import patch_layers
from ..errors import FlashError
from ..io import FlashLoader
from ..moe.cache import split_slots_by_curves
from ..moe.store import ExpertStore, expert_layers, scratch_bank_bytes
from ..moe.switch import (ResidentMixedSwitchGLU, StreamedSwitchGLU, router_lookahead, switch_glus,
                          swap_switch_glu)
from ..pack import load_pack_weights, load_resident, read_layer_components, read_manifest
from .auto import resolve_auto
from .loader import build_model, load_weights_checked

PREDICTORS = ("lookahead", "profile", "none")


def is_moe_pack(manifest) -> bool:
    return any(b.kind == "experts" for b in manifest.bundles)


def top_k_of(config) -> int:
    """Experts each token is routed to, from an mlx-lm MoE config."""
    k = config.get("num_experts_per_tok") or config.get("moe_top_k") or config.get("top_k")
    if not k:
        raise FlashError(f"config.json: model_type {config.get('model_type')!r} has no "
                         f"num_experts_per_tok (not an MoE model mlx-flash knows)")
    return int(k)


def expert_slots(manifest, memory_budget, top_k) -> int:
    """Expert slots per MoE layer that `memory_budget` leaves after the resident tensors and,
    unless every expert fits, the prompt scratch bank (a prompt chunk routed to more experts than
    a layer's slots reads them into one layer's worth of experts; moe.store).

    None: every expert. FlashError naming --memory-budget when fewer than top_k slots remain.
    """
    layers = expert_layers(manifest)
    n_experts = max(e.count for e in layers.values())
    budget = parse_memory_budget(memory_budget)
    if budget is None:
        return n_experts
    resident = manifest.resident.length
    expert_bytes = sum(e.nbytes for e in layers.values())
    total = budget.bytes_for(resident + expert_bytes)
    # mixed widths: the mean block (each layer's slots are split over its widths)
    stride = -(-expert_bytes // sum(e.count for e in layers.values()))
    per_layer = max(0, total - resident) // stride // len(layers)
    if per_layer >= n_experts:
        return n_experts  # every expert has a slot: no call needs the scratch bank
    scratch = scratch_bank_bytes(layers)
    per_layer = max(0, total - resident - scratch) // stride // len(layers)
    if per_layer < top_k:
        raise FlashError(f"{budget.named()}: leaves {per_layer} expert slots per layer after "
                         f"{resident / 1e6:.1f} MB resident and the {scratch / 1e6:.1f} MB prompt "
                         f"scratch bank (one layer's experts); each token needs {top_k} "
                         f"({(top_k * stride * len(layers) + scratch + resident - total) / 1e6:.1f}"
                         f" MB more)")
    return per_layer


def naive_fits(manifest, memory_budget) -> None:
    """FlashError naming --memory-budget unless it holds the resident tensors and naive mode's
    one bank, the scratch bank of one layer's experts every layer call reads into."""
    budget = parse_memory_budget(memory_budget)
    if budget is None:
        return
    layers = expert_layers(manifest)
    resident = manifest.resident.length
    total = budget.bytes_for(resident + sum(e.nbytes for e in layers.values()))
    scratch = scratch_bank_bytes(layers)
    if resident + scratch > total:
        raise FlashError(f"{budget.named()}: {total / 1e6:.1f} MB cannot hold {resident / 1e6:.1f} MB "
                         f"resident and naive mode's {scratch / 1e6:.1f} MB expert bank (one "
                         f"layer's experts)")


def layer_slots(manifest, per_layer, top_k) -> dict:
    """{layer: slots} for `per_layer` slots per MoE layer on average: split by the pack's
    calibration routing statistics (`moe_routing`: each layer's hits at each size, written by
    convert --calib-text) so that layers whose routing spreads get more, else equal."""
    layers = expert_layers(manifest)
    routing = manifest.get("moe_routing")
    if not routing or per_layer >= max(e.count for e in layers.values()):
        return {layer: per_layer for layer in layers}
    sizes = [n for n in routing["sizes"] if n >= top_k]
    skip = len(routing["sizes"]) - len(sizes)
    curves = {layer: routing["hits"][str(layer)][skip:] for layer in layers}
    return split_slots_by_curves(curves, sizes, per_layer * len(layers))


def build_moe_model(pack_dir, flash_config=None, *, policy="layer", predictor="lookahead",
                    preload_width=None, capacity=None, future=None, profile=None, loader=None):
    """The mlx-lm model of an MoE pack with experts per `flash_config.mode` (no tokenizer).

    policy: eviction policy (moe.cache.POLICIES). predictor: "lookahead" (next router on this
    layer's input), "profile" (`profile`, a moe.predict.RoutingProfile) or "none"; flash mode only.
    preload_width: experts preloaded per layer, always (at most slots - top_k). Default: the
      next layer's top_k guesses are candidates and as many are read as one read per expert
      lands within the measured compute time of a layer (none when reads are slower: moe.store).
    capacity: slots per layer (int, or {layer: slots}) instead of the budget's. Without it a pack
      with calibration routing statistics splits the budget's slots over layers by them
      (`layer_slots`). future: access trace for policy "belady".
    The ExpertStore is `model.moe_store` (None in dense mode on mlx-lm's own ops; on the CPU
    kernels dense mode's store holds every expert, read at load).
    """
    pack = Path(pack_dir)
    cfg = flash_config or FlashConfig()
    manifest = read_manifest(pack)
    cfg, auto_note = resolve_auto(pack, manifest, cfg)
    layers = expert_layers(manifest)
    if not layers:
        raise FlashError(f"{pack}: no MoE expert blocks in the pack")
    config = manifest.config
    top_k = top_k_of(config)
    resident_bank = cfg.mode == "dense" and ops.kernels_active()
    if cfg.mode == "dense" and not resident_bank:
        model = (_dense_mixed(pack, manifest, layers) if any(e.groups for e in layers.values())
                 else _dense(pack))
        model.moe_store = None
        return model
    if resident_bank:  # IO-FREE on the kernel path: a slot for every expert, all read at load
        capacity = {layer: entry.count for layer, entry in layers.items()}
    if capacity is None and cfg.mode == "naive":  # no cache: every call reads into the scratch bank
        naive_fits(manifest, cfg.memory_budget)
        capacity = top_k
    if capacity is None:
        capacity = layer_slots(manifest, expert_slots(manifest, cfg.memory_budget, top_k), top_k)
    caps = capacity if isinstance(capacity, dict) else {layer: capacity for layer in layers}
    slots = min(caps.values())
    if slots < top_k:
        raise FlashError(f"{pack}: {slots} expert slots in a layer; each token needs {top_k}")
    _, weights = load_resident(pack, manifest=manifest)
    model = build_model(config, weights)
    for layer, entry in layers.items():
        n = _n_experts(config)
        if n is not None and entry.count != n:
            raise FlashError(f"{pack / entry.file}: {entry.count} experts in layer {layer}, "
                             f"config.json says {n}")
    owned = loader is None  # a loader made here is closed with the model; a given one is the caller's
    loader = loader or FlashLoader(pack, threads=cfg.threads)
    store = ExpertStore(loader, layers, caps,
                        policy=policy if cfg.mode not in ("naive", "dense") else "lru",
                        future=future if cfg.mode != "dense" else None, cache=cfg.mode != "naive")
    blocks = {}

    def make(layer, switch, block):
        blocks[layer] = block
        return StreamedSwitchGLU(store, layer, switch.activation)

    swapped = swap_switch_glu(model, store, make)
    load_weights_checked(model, weights, pack)
    patch_layers(model)
    if resident_bank:
        for layer, entry in layers.items():
            store.fill(layer, range(entry.count))
    # Preloads only use the slots beyond one token's experts: wider guesses evict experts the
    # cache would have hit (measured: 8 of 16 slots, width 6 read 3x the bytes of no preload).
    width = min(preload_width or top_k, slots - top_k)
    # How many of them are read: as many as the measured compute window hides (moe.store),
    # or all `preload_width` when it is given
    store.max_preload, store.adaptive = width, preload_width is None
    if cfg.mode == "flash" and predictor != "none" and width > 0:
        order = list(layers)
        for i, layer in enumerate(order[:-1]):
            module = swapped[layer][1]
            if predictor == "lookahead":
                module._lookahead = router_lookahead(blocks[order[i + 1]], width)
            elif predictor == "profile":
                if profile is None:
                    raise FlashError(f"{pack}: predictor 'profile' needs a routing profile")
                module._predict_next = profile.predictor(width)
            else:
                raise FlashError(f"--predictor {predictor}: choose from {', '.join(PREDICTORS)}")
    model.moe_store = store
    model.flash_auto_note = auto_note
    # The model owns its store (preload thread) and, when made here, the loader's threads and files.
    weakref.finalize(model, _close_streams, store, loader if owned else None)
    return model


def _close_streams(store, loader):
    store.close()
    if loader is not None:
        loader.close()


def _dense(pack):
    """mlx-lm's own model of the pack, every expert resident in its SwitchGLU."""
    config, weights = load_pack_weights(pack)
    model = build_model(config, weights)
    load_weights_checked(model, weights, pack)
    patch_layers(model)
    return model


def _dense_mixed(pack, manifest, layers):
    """Every expert resident at its own width (ResidentMixedSwitchGLU per MoE layer)."""
    _, weights = load_resident(pack, manifest=manifest)
    model = build_model(manifest.config, weights)
    groups = {layer: {g.bits: (np.asarray(g.experts), read_layer_components(pack, g))
                      for g in entry.groups} for layer, entry in layers.items()}
    for layer, (parent, name, switch) in switch_glus(model, layers).items():
        setattr(parent, name, ResidentMixedSwitchGLU(switch, groups[layer], layers[layer].count))
    # the experts are loaded already; the strict load checks that the rest is the pack's
    weights.update((k, v) for k, v in tree_flatten(model.parameters()) if ".switches." in k)
    load_weights_checked(model, weights, pack)
    patch_layers(model)
    return model


def _n_experts(config):
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if config.get(key):
            return int(config[key])
    return None

