"""A GGUF file -> an mlx-lm folder (model.safetensors, config.json, tokenizer files)."""

import json
import sys
from pathlib import Path

import mlx.core as mx
from tqdm import tqdm

from ..model_folder import write_model_files
from ..paths import atomic_output_dir
from .gguf import gguf_to_mlx, read_gguf_header
from .gguf_tokenizer import write_tokenizer


def convert_gguf(gguf_path, out_dir, progress=True) -> Path:
    """Write `gguf_path` as an mlx-lm folder at `out_dir` (model_folder.write_model_files: each
    file whole, the folder renamed into place whole): model.safetensors, config.json, and the
    tokenizer rebuilt from the GGUF's metadata."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    header = read_gguf_header(gguf_path)
    config, weights = gguf_to_mlx(gguf_path)
    meta = header.metadata
    for key in ("bos", "eos"):
        if f"tokenizer.ggml.{key}_token_id" in meta:
            config[f"{key}_token_id"] = meta[f"tokenizer.ggml.{key}_token_id"]
    config["source"] = {"format": "gguf", "file": gguf_path.name}
    # keys sorted at every level, as this folder's config.json has always listed them
    config = json.loads(json.dumps(config, sort_keys=True))
    with atomic_output_dir(out_dir) as tmp:
        for name in tqdm(sorted(weights), desc=f"Converting {gguf_path.name}", unit="tensor",
                         disable=not progress, file=sys.stderr):
            mx.eval(weights[name])
        write_tokenizer(header, tmp)
        write_model_files(tmp, weights, config, tokenizer_src=None)
    return out_dir
