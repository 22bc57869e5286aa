"""`--mode auto` (the default): which mode, within which memory budget, a flash pack runs with when
the user named no mode.

Dense when every weight fits the budget: the user's --memory-budget, or, without one, AUTO_SHARE of
the memory this process can still take (host_memory.available_memory). Otherwise the pack runs
within that budget: flash (LLM in a flash, or EdgeMoE's expert cache for an MoE pack) when its
FFN can predict activations (calibrated predictors; MoE packs need none), else hybrid (whole
layers held as the budget allows, the rest read per token).
"""

from dataclasses import replace

from ..config import AUTO_MODE, FlashConfig, MemoryBudget
from ..host_memory import available_memory
from ..sparse.budget import fmt_bytes, layer_bytes, resident_bytes, resolve_budget
from ..sparse.predictor import read_predictors_json

# of the available memory, for weights when no --memory-budget is given: the rest is left to the
# KV cache, activations and the OS
AUTO_SHARE = 0.8


def dense_bytes(manifest) -> int:
    """Memory every weight of the pack takes resident (dense mode)."""
    return resident_bytes(manifest) + sum(layer_bytes(b) for b in manifest.bundles)


def resolve_auto(pack, manifest, config: FlashConfig, available=None,
                 predictors_doc=None) -> tuple[FlashConfig, str | None]:
    """(the FlashConfig to run with, a one-line note of the choice, or None when none is worth
    telling: a concrete mode given, or dense because everything fits). `available()` ->
    (bytes, source) or None; default host_memory.available_memory. `predictors_doc()`: the
    pack's predictors.json or None, when the caller reads it anyway (default: read here)."""
    if config.mode != AUTO_MODE:
        return config, None
    need = dense_bytes(manifest)
    budget = config.memory_budget
    if budget is not None:
        limit = resolve_budget(budget, manifest)
        why = budget.named()
    else:
        room = (available or available_memory)()
        if room is None:  # nothing tells how much memory there is: load everything, as mlx-lm does
            return replace(config, mode="dense"), None
        limit = int(AUTO_SHARE * room[0])
        why = f"{AUTO_SHARE:.0%} of {fmt_bytes(room[0])} available, {room[1]}"
        # errors name it so: "--mode auto (80% of 1.2 GB available, MemAvailable) 0.96 GB: below ..."
        budget = MemoryBudget(nbytes=limit, param=f"--mode auto ({why})", value=fmt_bytes(limit))
    if need <= limit:
        return replace(config, mode="dense"), None
    moe = any(b.kind == "experts" for b in manifest.bundles)
    doc = predictors_doc or (lambda: read_predictors_json(pack, manifest))
    mode = "flash" if moe or doc() is not None else "hybrid"
    note = (f"--mode auto: {mode} within {fmt_bytes(limit)} ({why}): the pack's weights take "
            f"{fmt_bytes(need)}")
    if mode == "hybrid":
        note += f"; python -m mlx_flash.calibrate --model {pack} gives it predictors for flash mode"
    return replace(config, mode=mode, memory_budget=budget), note
