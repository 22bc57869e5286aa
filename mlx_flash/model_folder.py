"""An mlx-lm model folder (model.safetensors, config.json, the source's tokenizer and chat-template
files) written crash-consistently: the one writer of the folders that pruning, relufication, the
MoE fine-tune, MoEfication, the peers' export and the GGUF import produce, so each loads through
mlx_flash.load and formats chat prompts as its source does. The synthetic source folders (one
shard per layer, a padded tokenizer) write their shards and config with write_weights and
write_config.
"""

import shutil
from pathlib import Path

from .paths import (atomic_dir, atomic_output_dir, read_json_file, save_safetensors, write_file_atomic,
                    write_json_atomic, write_text_atomic)

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
# What a tokenizer and its chat template need, as mlx-lm / transformers save them.
TOKENIZER_FILES = ("tokenizer*.json", "tokenizer.model", "special_tokens_map.json", "*.jinja",
                   "generation_config.json", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.json", "*.tiktoken")


def tokenizer_files(src) -> list:
    """The files of folder `src` that TOKENIZER_FILES names (sorted, each once)."""
    return sorted({f for pattern in TOKENIZER_FILES for f in Path(src).glob(pattern) if f.is_file()})


def copy_tokenizer_files(src, dst) -> list:
    """Copy `src`'s tokenizer and chat-template files into folder `dst`, each whole
    (paths.write_file_atomic); returns the names copied."""
    files = tokenizer_files(src)
    for f in files:
        write_file_atomic(Path(dst) / f.name, lambda tmp, f=f: shutil.copyfile(f, tmp))
    return [f.name for f in files]


def write_weights(path: Path, weights: dict) -> None:
    """Save {name: mx.array} as MLX-format safetensors at `path`, whole (paths.write_file_atomic)."""
    # the temporary keeps the .safetensors suffix, which mx.save_safetensors appends otherwise
    write_file_atomic(path, lambda tmp: save_safetensors(tmp, weights, metadata={"format": "mlx"}),
                      suffix=".safetensors")


def write_config(folder, config: dict) -> Path:
    """Write `config` as `folder`/config.json, whole (paths.write_json_atomic)."""
    path = Path(folder) / CONFIG_FILE
    write_json_atomic(path, config)
    return path


def read_config(folder) -> dict:
    """The object in `folder`/config.json (a model folder or pack): paths.read_json_file, whose
    FlashError names the file and the reason (missing, unreadable, not JSON, not an object)."""
    return read_json_file(Path(folder) / CONFIG_FILE, "model config")


def write_model_files(folder, weights: dict, config: dict, tokenizer_src, texts=None) -> Path:
    """Write an mlx-lm model into the existing `folder`: tokenizer files copied from folder
    `tokenizer_src` (None: the caller writes them, e.g. a GGUF's rebuilt tokenizer), `weights`
    as model.safetensors, `config` as config.json, and `texts`
    ({file name: text}, e.g. a README). Each file lands whole; the folder as a whole does not
    (a run's folder keeps its checkpoints beside the model): a new folder is write_model_folder's."""
    folder = Path(folder)
    if tokenizer_src is not None:
        copy_tokenizer_files(tokenizer_src, folder)
    for name, text in (texts or {}).items():
        write_text_atomic(folder / name, text)
    write_weights(folder / WEIGHTS_FILE, weights)
    write_config(folder, config)
    return folder


def write_model_folder(out, weights: dict, config: dict, tokenizer_src, *, texts=None,
                       replace=False) -> Path:
    """The mlx-lm model folder `out` (write_model_files), written into a temporary folder beside
    it, fsynced and renamed into place whole. `out` must not exist (FlashError naming --out)
    unless `replace`, which swaps an existing folder for the new one."""
    out = Path(out)
    with (atomic_dir(out, replace=True) if replace else atomic_output_dir(out)) as tmp:
        write_model_files(tmp, weights, config, tokenizer_src, texts)
    return out
