"""What a `--model` value points to: the embedded default, a local folder, a hub id or a GGUF file.

Every source ends up as a local mlx-lm folder (or flash pack) path: `resolve_model(value)`.
    resolve.py        the `--model` value -> a checked local folder (GGUF conversions cached)
    gguf.py           GGUF header and tensor parsing -> mlx-lm config + weights
    gguf_tokenizer.py the GGUF tokenizer -> Hugging Face tokenizer files
    gguf_convert.py   a GGUF file -> an mlx-lm folder, written atomically
"""

from .gguf_convert import convert_gguf
from .gguf_export import write_moe_gguf
from .resolve import default_gguf_path, is_gguf, resolve_model

__all__ = ["convert_gguf", "default_gguf_path", "is_gguf", "resolve_model", "write_moe_gguf"]
