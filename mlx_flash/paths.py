"""Where mlx-flash keeps files (the cache home), and crash-consistent writes: temporary path beside
the target, fsync, rename, fsync of the folder, so output appears whole or not at all.

One reader of our small JSON files (config.json, manifest.json, predictors.json): read_json_file.

A temporary name carries the writer's process id (`.NAME.tmp-PID-XXXX`), so a later writer of the
same target removes the temporaries of processes that no longer run (killed, power loss) and leaves
those of live ones alone. A full disk or any other OSError becomes one FlashError line naming the
file.
"""

import contextlib
import json
import os
import secrets
import shutil
import stat
from pathlib import Path

# Debian python3-doc's library pages: the offline real text that benches and pruning default to.
PYTHON_DOC_LIBRARY = "/usr/share/doc/python3*/html/_sources/library/*.rst.txt"
# Far above any config or metadata file we read, so a corrupt one fails here, not in a huge read.
MAX_JSON_BYTES = 256 << 20
# What a JSON document that is not an object holds, in JSON's own words (for read_json_file's message).
_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
               type(None): "null"}

from .errors import FlashError


def flash_home() -> Path:
    """`$MLX_FLASH_HOME`, default `~/.cache/mlx_flash`: converted models and machine profiles."""
    return Path(os.environ.get("MLX_FLASH_HOME", Path.home() / ".cache" / "mlx_flash"))


def atomic_output_dir(out: Path):
    """A temporary folder beside `out`, renamed to `out` on success (atomic_dir); `out` must not exist."""
    out = Path(out)
    if out.exists():
        raise FlashError(f"--out {out}: already exists; remove it or choose another path")
    return atomic_dir(out)


def fsync_file(path: Path) -> None:
    """Flush a written file's data (or a folder's entries: the renames inside it) to the device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and folder under `root`, folders last."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fsync_file(Path(dirpath) / name)
        fsync_file(Path(dirpath))


def _temp_prefix(target: Path) -> str:
    return f".{target.name}.tmp-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def clean_stale_temporaries(target: Path) -> list:
    """Remove `.NAME.tmp-PID-*` beside `target` whose PID no longer runs; returns what was removed."""
    target = Path(target)
    removed = []
    if not target.parent.is_dir():
        return removed
    prefix = _temp_prefix(target)
    for p in target.parent.iterdir():
        if not p.name.startswith(prefix):
            continue
        pid = p.name[len(prefix):].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or _pid_alive(int(pid)):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p)
    return removed


def temporary_path(target: Path) -> Path:
    """A fresh temporary name beside `target`, marked with this process id."""
    target = Path(target)
    return target.parent / f"{_temp_prefix(target)}{os.getpid()}-{secrets.token_hex(4)}"


def read_json_file(path, what: str = "JSON file") -> dict:
    """The object in the JSON file `path` (a model's config.json, a pack's manifest, predictors),
    read only once it is a regular file of at most MAX_JSON_BYTES (a FIFO would block the read, a
    device would never end). `what` names the file's role in the too-large message. Missing,
    unreadable, not a regular file, too large, not JSON, or not an object: one FlashError line
    '<path>: <reason>'."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise FlashError(f"{path}: not a regular file")
        if st.st_size > MAX_JSON_BYTES:
            raise FlashError(f"{path}: {st.st_size} bytes, too large for a {what} (at most "
                             f"{MAX_JSON_BYTES})")
        text = Path(path).read_bytes()
    except FileNotFoundError:
        raise FlashError(f"{path}: missing") from None
    except OSError as e:
        raise FlashError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        doc = json.loads(text)
    except RecursionError:
        raise FlashError(f"{path}: not JSON this reader can parse (nested too deeply)") from None
    except ValueError as e:  # UnicodeDecodeError is a ValueError
        raise FlashError(f"{path}: not JSON ({str(e)[:200]})") from None
    if not isinstance(doc, dict):
        raise FlashError(f"{path}: not a JSON object ({_JSON_KINDS[type(doc)]})")
    return doc


def write_error(e: BaseException, path) -> FlashError:
    """One FlashError line for a failed write (full disk, read-only folder, ...)."""
    if isinstance(e, OSError):
        name = e.filename or path
        return FlashError(f"{name}: cannot write ({e.strerror or e})")
    return FlashError(f"{path}: cannot write ({e}{_free_space(path)})")


def _free_space(path) -> str:
    try:
        st = os.statvfs(Path(path).parent)
        return f"; {st.f_bavail * st.f_frsize} bytes free there"
    except OSError:
        return ""


@contextlib.contextmanager
def atomic_dir(target: Path, *, replace=False):
    """Yield a temporary folder beside `target`; on success fsync it all and rename it to
    `target` (replacing an existing one if `replace`), on failure remove it. Stale temporaries
    of dead processes for the same target are removed first."""
    target = Path(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        clean_stale_temporaries(target)
        tmp = temporary_path(target)
        tmp.mkdir()
    except OSError as e:
        raise write_error(e, target) from None
    try:
        yield tmp
        tmp.chmod(0o755)
        fsync_tree(tmp)
        if replace and target.exists():
            old = temporary_path(target)
            os.rename(target, old)
            os.rename(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, target)
        fsync_file(target.parent)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise write_error(e, target) from None
        raise


def load_safetensors(path: Path) -> dict:
    """{name: mx.array} of the safetensors file `path`; a file MLX cannot read (truncated, not
    safetensors) as one FlashError naming it."""
    import mlx.core as mx

    try:
        return mx.load(str(path))
    except Exception as e:  # MLX raises RuntimeError/ValueError for bad files
        raise FlashError(f"{path}: unreadable safetensors ({e})") from None


def save_safetensors(path: Path, arrays: dict, metadata=None) -> None:
    """mx.save_safetensors with a full disk (MLX raises a bare RuntimeError) as one FlashError."""
    import mlx.core as mx

    try:
        mx.save_safetensors(str(path), arrays, metadata=metadata)
    except RuntimeError as e:
        raise write_error(e, path) from None


def write_file_atomic(path: Path, write, suffix: str = "") -> Path:
    """Write one file whole: `write(tmp)` fills a temporary path beside `path` (ending in
    `suffix`), then fsync, rename to `path`, fsync of the folder; on failure the temporary goes."""
    path = Path(path)
    tmp = temporary_path(path)
    tmp = tmp.with_name(tmp.name + suffix)
    try:
        write(tmp)
        fsync_file(tmp)
        os.replace(tmp, path)
        fsync_file(path.parent)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            if e.filename is not None and Path(e.filename) == tmp:
                e.filename = str(path)  # the temporary's name means nothing to the user
            raise write_error(e, path) from None
        raise
    return path


def write_text_atomic(path: Path, text: str) -> Path:
    """Write `text` to `path` whole (write_file_atomic)."""
    return write_file_atomic(path, lambda tmp: tmp.write_text(text))


def write_json_atomic(path: Path, doc, default=None) -> None:
    """Write JSON to `path` whole (write_file_atomic). default: as json.dumps' (e.g. str, for
    reports that hold paths)."""
    write_text_atomic(path, json.dumps(doc, indent=1, default=default))
