"""Where mlx-flash keeps files: the cache home, and output folders that appear whole or not at all."""

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from .errors import FlashError


def flash_home() -> Path:
    """`$MLX_FLASH_HOME`, default `~/.cache/mlx_flash`: converted models and machine profiles."""
    return Path(os.environ.get("MLX_FLASH_HOME", Path.home() / ".cache" / "mlx_flash"))


@contextlib.contextmanager
def atomic_output_dir(out: Path):
    """Yield a temporary folder beside `out`; rename it to `out` on success, delete it on failure."""
    out = Path(out)
    if out.exists():
        raise FlashError(f"--out {out}: already exists; remove it or choose another path")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        tmp.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary folder
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def fsync_file(path) -> None:
    """Flush a written file's data to the device (before renaming it into place)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
