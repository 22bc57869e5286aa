"""Models: the mlx-lm seam (loader.py), flash packs as mlx-lm models (flash.py; MoE packs in
moe.py, experts streamed through the moe/ library), architectures mlx-lm lacks (opt.py). `load` is the one entry point: any `--model` value -> (model, tokenizer).
"""

from pathlib import Path

from ..config import AUTO_MODE
from ..cpu.patch import patch_layers
from ..errors import FlashError
from ..pack import read_manifest
from ..sources import resolve_model
from .flash import build_flash_model
from .moe import build_moe_model, is_moe_pack
from .loader import (build_model, context_length, get_model_classes, is_flash_pack, load_model,
                     load_tokenizer)

__all__ = ["build_flash_model", "build_moe_model", "build_model", "context_length", "get_model_classes",
           "is_flash_pack", "load", "load_model", "load_tokenizer"]


def load(model=None, flash_config=None, *, progress: bool = True):
    """Load `model` (None = embedded default, GGUF, folder, flash pack or hub repo id).

    Returns (model, tokenizer). A flash pack runs as `flash_config` says (models/flash.py; mode
    auto: models/auto.py, the choice's note in `model.flash_auto_note`); anything else loads
    dense, every weight resident.
    """
    path = resolve_model(model, progress=progress)
    if is_flash_pack(path):
        if is_moe_pack(read_manifest(path)):
            return build_moe_model(path, flash_config), load_tokenizer(Path(path))
        return build_flash_model(path, flash_config), load_tokenizer(Path(path))
    streamed = flash_config is not None and flash_config.mode not in ("dense", AUTO_MODE)
    if streamed or (flash_config is not None and flash_config.memory_budget is not None):
        budget = flash_config.memory_budget
        flag = (f"--mode {flash_config.mode}" if streamed
                else budget.param if budget.param.startswith("--") else budget.named())
        raise FlashError(f"{flag}: needs a flash pack; {path} is a plain model folder "
                         f"(make one with python -m mlx_flash.convert --model {path} --out PACK)")
    nn_model, _ = load_model(path, lazy=False)
    patch_layers(nn_model)  # our CPU kernels where they apply (cpu/ops.py); weights untouched
    return nn_model, load_tokenizer(path)
