"""The seam with mlx-lm: model classes, building a model from a config, loading a folder.

Model classes come from our own modules first (architectures mlx-lm lacks, e.g. `opt`), then
from mlx-lm's registry. Every model mlx-flash runs is built here: `load_model` for an mlx-lm
folder (mlx-lm's loader with our class lookup), `build_model` for a config and weights already in
memory (flash packs, calibration's dense float32 model).
"""

import importlib
import logging
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
# mlx-lm 0.32 has no public class lookup: `_get_classes` is load_model's own default for
# `get_model_classes`; used here only, so an mlx-lm upgrade touches one line.
from mlx_lm.utils import _get_classes
from mlx_lm.utils import load_model as mlx_lm_load_model
from mlx_lm.utils import load_tokenizer as mlx_lm_load_tokenizer

from ..errors import FlashError
from ..model_folder import read_config


def mlx_lm_model_classes(config: dict):
    """(Model, ModelArgs) from mlx-lm's own registry, or None when mlx-lm lacks the model_type."""
    try:
        return _get_classes(config)
    except ValueError:
        return None


def own_model_classes(model_type):
    """(Model, ModelArgs) of this package's own module for `model_type` (relu_llama, opt), or None."""
    package = __name__.rsplit(".", 1)[0]
    try:
        ours = importlib.import_module(f"{package}.{model_type}")
    except ModuleNotFoundError as e:
        if e.name != f"{package}.{model_type}":
            raise
        return None
    return (ours.Model, ours.ModelArgs) if hasattr(ours, "Model") and hasattr(ours, "ModelArgs") else None


def get_model_classes(config: dict):
    """(Model, ModelArgs) for a config's model_type: ours first, then mlx-lm's."""
    model_type = config.get("model_type")
    classes = own_model_classes(model_type) or mlx_lm_model_classes(config)
    if classes is None:
        raise FlashError(f"config.json: model_type {model_type!r} is not supported by mlx-lm or mlx-flash")
    return classes


def build_model(config: dict, weights: dict | None = None):
    """The mlx-lm model for `config` (weights not loaded). With a "quantization" config, the
    modules whose `scales` are in `weights` become quantized layers (per-module overrides kept)."""
    model_class, args_class = get_model_classes(config)
    try:
        model = model_class(args_class.from_dict(config))
    except (ValueError, TypeError, KeyError) as e:
        raise FlashError(f"config.json: {e}") from None
    if q := config.get("quantization"):
        def quantized(path, module):
            if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
                return False
            own = q.get(path)
            return own if isinstance(own, dict) else True

        nn.quantize(model, group_size=q["group_size"], bits=q["bits"], class_predicate=quantized)
    return model


def load_weights_checked(model, weights: dict, pack) -> None:
    """Load a pack's `weights` into `model` (built by build_model) strictly, evaluated; a
    mismatch is one FlashError naming the pack's resident.safetensors."""
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise FlashError(f"{pack}/resident.safetensors: does not match the model ({e})") from None
    mx.eval(model.parameters())


def load_model(path: Path, lazy: bool = True):
    """mlx-lm's loader with our class lookup; errors become one-line FlashErrors."""
    try:
        model, config = mlx_lm_load_model(path, lazy=lazy, get_model_classes=get_model_classes)
    except FlashError as e:
        raise FlashError(f"{path}/{e}") from None
    except ValueError as e:
        if "parameters" in str(e) or "shape" in str(e):  # mlx-lm's weight/shape mismatch messages
            raise FlashError(f"{path}: weights do not match config.json ({e})") from None
        raise FlashError(f"{path}/config.json: {e}") from None
    return model, config


class _OwnModelTypeNotice(logging.Filter):
    """Drops transformers' warning that a config.json of `model_type` is read as a generic config:
    its tokenizer load reads config.json, and for a model type of this package that transformers
    does not know (relu_llama) the warning, printed at every load, says nothing about the tokenizer."""

    def __init__(self, model_type: str):
        super().__init__()
        self.notice = f"You are using a model of type `{model_type}` to instantiate"

    def filter(self, record) -> bool:
        return not record.getMessage().startswith(self.notice)


def load_tokenizer(path: Path):
    """mlx-lm's tokenizer wrapper for a folder or pack (eos ids from its config.json)."""
    config = read_config(path)
    eos = config.get("eos_token_id")
    model_type = config.get("model_type")
    notice = _OwnModelTypeNotice(model_type) if isinstance(model_type, str) and own_model_classes(model_type) else None
    hf_config_log = logging.getLogger("transformers.configuration_utils")
    if notice is not None:
        hf_config_log.addFilter(notice)
    try:
        return mlx_lm_load_tokenizer(path, eos_token_ids=eos if isinstance(eos, list) else None)
    except (OSError, ValueError) as e:
        raise FlashError(f"{path}: could not load the tokenizer ({e})") from None
    finally:
        if notice is not None:
            hf_config_log.removeFilter(notice)


def context_length(model):
    """The model's context window in tokens (None when its config does not say)."""
    args = getattr(model, "args", None)
    return getattr(args, "max_position_embeddings", None) or getattr(args, "context_length", None)


def is_flash_pack(path: Path) -> bool:
    return (Path(path) / "manifest.json").is_file()
