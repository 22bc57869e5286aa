"""A GGUF file -> an mlx-lm folder (model.safetensors, config.json, tokenizer files)."""

import json
import sys
from pathlib import Path

import mlx.core as mx
from tqdm import tqdm

from ..paths import atomic_output_dir, save_safetensors
from .gguf import gguf_to_mlx, read_gguf_header
from .gguf_tokenizer import write_tokenizer


def convert_gguf(gguf_path, out_dir, progress=True) -> Path:
    """Write `gguf_path` as an mlx-lm folder at `out_dir`: model.safetensors, config.json, tokenizer."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    header = read_gguf_header(gguf_path)
    config, weights = gguf_to_mlx(gguf_path)
    with atomic_output_dir(out_dir) as tmp:
        for name in tqdm(sorted(weights), desc=f"Converting {gguf_path.name}", unit="tensor",
                         disable=not progress, file=sys.stderr):
            mx.eval(weights[name])
        save_safetensors(tmp / "model.safetensors", weights, metadata={"format": "mlx"})
        write_tokenizer(header, tmp)
        meta = header.metadata
        for key in ("bos", "eos"):
            if f"tokenizer.ggml.{key}_token_id" in meta:
                config[f"{key}_token_id"] = meta[f"tokenizer.ggml.{key}_token_id"]
        config["source"] = {"format": "gguf", "file": gguf_path.name}
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return out_dir
