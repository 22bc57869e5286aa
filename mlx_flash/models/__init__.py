"""The seam with mlx-lm: load a model with mlx-lm's utilities, then (per mode) swap its blocks.

Model classes come from our own modules first (architectures mlx-lm lacks, e.g. `opt`), then
from mlx-lm's registry.
"""

import importlib
import json
from pathlib import Path

from ..errors import FlashError
from .kernel_layers import patch_layers
from .source import resolve_model


def get_model_classes(config: dict):
    """(Model, ModelArgs) for a config's model_type: ours first, then mlx-lm's."""
    from mlx_lm.utils import _get_classes

    model_type = config.get("model_type")
    try:
        ours = importlib.import_module(f"{__name__}.{model_type}")
        if hasattr(ours, "Model") and hasattr(ours, "ModelArgs"):
            return ours.Model, ours.ModelArgs
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{model_type}":
            raise
    try:
        return _get_classes(config)
    except ValueError:
        raise FlashError(f"config.json: model_type {model_type!r} is not supported by mlx-lm or mlx-flash") from None


def load_model(path: Path, lazy: bool = True):
    """mlx-lm's loader with our class lookup; errors become one-line FlashErrors."""
    from mlx_lm.utils import load_model as mlx_lm_load_model

    try:
        model, config = mlx_lm_load_model(path, lazy=lazy, get_model_classes=get_model_classes)
    except FlashError as e:
        raise FlashError(f"{path}/{e}") from None
    except ValueError as e:
        if "parameters" in str(e) or "shape" in str(e):  # mlx-lm's weight/shape mismatch messages
            raise FlashError(f"{path}: weights do not match config.json ({e})") from None
        raise FlashError(f"{path}/config.json: {e}") from None
    return model, config


def load_tokenizer(path: Path):
    from mlx_lm.utils import load_tokenizer as mlx_lm_load_tokenizer

    config = json.loads((path / "config.json").read_text())
    eos = config.get("eos_token_id")
    try:
        return mlx_lm_load_tokenizer(path, eos_token_ids=eos if isinstance(eos, list) else None)
    except (OSError, ValueError) as e:
        raise FlashError(f"{path}: could not load the tokenizer ({e})") from None


def is_flash_pack(path: Path) -> bool:
    return (Path(path) / "manifest.json").is_file()


def load(model=None, flash_config=None, *, progress: bool = True):
    """Load `model` (None = embedded default, GGUF, folder, flash pack or hub repo id).

    Returns (model, tokenizer). A flash pack runs as `flash_config` says (models/flash.py);
    anything else loads dense, every weight resident.
    """
    path = resolve_model(model, progress=progress)
    if is_flash_pack(path):
        from .flash import load_flash

        return load_flash(path, flash_config)
    if flash_config is not None and (flash_config.mode != "dense" or flash_config.memory_budget is not None):
        flag = f"--mode {flash_config.mode}" if flash_config.mode != "dense" else "--memory-budget"
        raise FlashError(f"{flag}: needs a flash pack; {path} is a plain model folder "
                         f"(make one with python -m mlx_flash.convert --model {path} --out PACK)")
    nn_model, _ = load_model(path, lazy=False)
    patch_layers(nn_model)  # our CPU kernels where they apply (ops.py); weights untouched
    return nn_model, load_tokenizer(path)
