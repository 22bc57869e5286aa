"""paths.py: the cache home and output folders that appear whole or not at all. Nothing
half-written survives a crash: real `kill -9` of a child process at many points of `convert` and of
the first GGUF run, then the next run succeeds and nothing stale remains. Full disks give one line.
Concurrent first runs on one GGUF take turns."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_flash.errors import FlashError
from mlx_flash.paths import (atomic_dir, atomic_output_dir, clean_stale_temporaries, flash_home,
                             load_safetensors, read_json_file, save_safetensors, temporary_path)


def test_failed_conversion_leaves_nothing(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with atomic_output_dir(out) as tmp:
            (tmp / "model.safetensors").write_bytes(b"partial")
            raise RuntimeError("disk full")
    assert list(tmp_path.iterdir()) == []


def test_existing_output_is_refused(tmp_path):
    with pytest.raises(FlashError, match="--out .*: already exists"):
        with atomic_output_dir(tmp_path):
            pass


def test_flash_home_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_FLASH_HOME", str(tmp_path / "home"))
    assert flash_home() == tmp_path / "home"
    monkeypatch.delenv("MLX_FLASH_HOME")
    assert flash_home().parts[-2:] == (".cache", "mlx_flash")


# MLX_FLASH_KILL_POINTS=24 for the full run (the suite keeps it shorter)
POINTS = int(os.environ.get("MLX_FLASH_KILL_POINTS", "12"))
ROOT = Path(__file__).resolve().parent.parent

# A child that imports once (mlx-lm's import takes seconds on a loaded machine), then forks one
# grandchild per request. The grandchild counts the calls that write (open for writing, write,
# fsync, rename, mkdir, safetensors saves, ...) and MLX evaluations, and SIGKILLs itself just
# before call number `kill_at`: a real kill -9, at a chosen point, with no finally blocks or
# atexit handlers run.
ZYGOTE = r"""
import builtins, json, os, shutil, signal, sys
sys.path.insert(0, %(tests)r)
import mlx.core as mx
from mlx_flash.convert import main as convert
from mlx_flash.sources.resolve import resolve_model
import mlx_flash.sources.gguf, mlx_flash.pack.writer, mlx_flash.sources.gguf_tokenizer  # noqa: F401
import mlx_flash.calibration.resident_quant  # noqa: F401  (convert imports it: mlx-lm, torch)

real_write = os.write

def hook(kill_at):
    calls = [0]
    def wrap(owner, name, writes=lambda *a, **k: True):
        real = getattr(owner, name)
        def counted(*a, **k):
            if writes(*a, **k):
                calls[0] += 1
                if calls[0] == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
            return real(*a, **k)
        setattr(owner, name, counted)
    for name in ("write", "pwrite", "fsync", "rename", "replace", "mkdir", "ftruncate", "unlink",
                 "rmdir", "chmod"):
        wrap(os, name)
    wrap(os, "open", lambda path, flags, *a, **k: bool(flags & (os.O_WRONLY | os.O_RDWR)))
    wrap(builtins, "open", lambda f, mode="r", *a, **k: any(c in mode for c in "wax+"))
    wrap(mx, "save_safetensors")
    wrap(mx, "eval")  # the conversion's compute steps: kill points between the writes too
    wrap(shutil, "copy2")
    return calls

print("ready", flush=True)
def start(req):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        calls = hook(req["kill_at"])
        try:
            if req["work"] == "convert":
                code = convert(req["args"])
            else:
                resolve_model(req["args"][0], progress=False)
                code = 0
        except BaseException as e:
            code = repr(e)
        real_write(w, json.dumps({"calls": calls[0], "code": code}).encode())
        os._exit(0)
    os.close(w)
    return pid, r

for line in sys.stdin:
    req = json.loads(line)
    children = [start(req) for _ in range(req.get("copies", 1))]  # concurrent runs
    results = []
    for pid, r in children:
        _, status = os.waitpid(pid, 0)
        with os.fdopen(r) as f:
            result = json.loads(f.read() or "{}")
        result["killed"] = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        results.append(result)
    result = dict(results[0], all=results)
    print(json.dumps(result), flush=True)
"""


class Zygote:
    """The forking child above: run(work, args, kill_at) -> {"killed", "calls", "code"}."""

    def __init__(self, home):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "MLX_FLASH_HOME": str(home)}
        self.p = subprocess.Popen([sys.executable, "-c", ZYGOTE % {"tests": str(ROOT / "tests")}],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                  cwd=ROOT)
        assert self.p.stdout.readline().strip() == "ready"

    def run(self, work, args, kill_at=0, copies=1):
        req = {"work": work, "args": args, "kill_at": kill_at, "copies": copies}
        self.p.stdin.write(json.dumps(req) + "\n")
        self.p.stdin.flush()
        return json.loads(self.p.stdout.readline())

    def close(self):
        self.p.stdin.close()
        self.p.wait(timeout=60)


def stale(folder):
    return sorted(p.name for p in Path(folder).iterdir() if ".tmp-" in p.name)


def kill_points(total):
    """POINTS distinct call numbers spread over 1..total."""
    return sorted({max(1, round(total * (k + 0.5) / POINTS)) for k in range(POINTS)})


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    """One forking child for the module's tests; MLX_FLASH_HOME is its own folder."""
    home = tmp_path_factory.mktemp("zygote_home")
    z = Zygote(home)
    z.home = home
    yield z
    z.close()


def test_kill_9_during_convert(tiny_llama, tmp_path, zygote):
    import shutil

    from mlx_flash.pack import load_pack_weights

    src = tiny_llama("src", layers=4, intermediate=256, hidden=128)
    out = tmp_path / "out" / "pack"
    args = ["--model", str(src), "--out", str(out)]
    z = zygote
    done = z.run("convert", args)
    assert done["code"] == 0 and not done["killed"] and done["calls"] >= 20
    shutil.rmtree(out)
    points = kill_points(done["calls"])
    left_behind = 0
    for k in points:
        assert z.run("convert", args, kill_at=k)["killed"]
        left_behind += bool(stale(out.parent))
        if out.exists():  # a complete pack or none at all
            load_pack_weights(out)
            shutil.rmtree(out)
        assert z.run("convert", args)["code"] == 0  # the next run succeeds...
        load_pack_weights(out)
        assert stale(out.parent) == []  # ...and removed what the killed one left
        shutil.rmtree(out)
    assert len(points) >= min(POINTS, 12) and left_behind >= len(points) // 2


def test_kill_9_during_first_gguf_run(tmp_path, monkeypatch, zygote):
    import shutil

    from test_sources_gguf import write_tiny_gguf

    from mlx_flash.sources.resolve import check_model_folder, resolve_model

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    home = zygote.home
    monkeypatch.setenv("MLX_FLASH_HOME", str(home))
    models = home / "models"
    z = zygote
    for _ in range(2):  # the second run counts the calls of a run that finds the lock file
        done = z.run("gguf", [str(gguf)])
        assert done["code"] == 0 and done["calls"] >= 20
        (folder,) = [p for p in models.iterdir() if not p.name.startswith(".")]
        shutil.rmtree(folder)
    points = kill_points(done["calls"])
    left_behind = 0
    for k in points:
        assert z.run("gguf", [str(gguf)], kill_at=k)["killed"]
        left_behind += bool(stale(models))
        folder = resolve_model(str(gguf), progress=False)  # the next run succeeds
        check_model_folder(folder)
        assert stale(models) == [] and sorted(p.name for p in models.iterdir()) == \
            sorted([folder.name, f".{folder.name}.lock"])
        shutil.rmtree(folder)
    assert len(points) >= min(POINTS, 12) and left_behind >= len(points) // 2


def test_damaged_gguf_cache_entry_is_converted_again(tmp_path, monkeypatch, capsys):
    from test_sources_gguf import write_tiny_gguf

    from mlx_flash.sources.resolve import resolve_model

    monkeypatch.setenv("MLX_FLASH_HOME", str(tmp_path / "home"))
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    folder = resolve_model(str(gguf), progress=False)
    st = folder / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])  # a power loss before the data hit disk
    assert resolve_model(str(gguf), progress=False) == folder
    assert "cached conversion is damaged" in capsys.readouterr().err
    import mlx_flash

    mlx_flash.load(str(gguf), progress=False)


def test_concurrent_first_runs_on_one_gguf(tmp_path, zygote):
    from test_sources_gguf import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "other.gguf")
    results = zygote.run("gguf", [str(gguf)], copies=3)["all"]
    assert [r["code"] for r in results] == [0, 0, 0], results
    assert stale(zygote.home / "models") == []


def test_stale_temporaries_of_live_processes_are_kept(tmp_path):
    target = tmp_path / "pack"
    mine = temporary_path(target)
    mine.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    theirs = tmp_path / f".pack.tmp-{dead.pid}-abcd"
    theirs.mkdir()
    (theirs / "half.bin").write_bytes(b"x")
    live = tmp_path / f".pack.tmp-{os.getppid()}-abcd"
    live.mkdir()
    assert clean_stale_temporaries(target) == [theirs]
    assert mine.exists() and live.exists() and not theirs.exists()


@pytest.fixture
def small_disk(tmp_path):
    """A 512 KiB tmpfs (root), else an injected ENOSPC."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mnt)],
                                            capture_output=True).returncode == 0:
        yield mnt
        subprocess.run(["umount", str(mnt)], check=True)
    else:
        pytest.skip("needs root to mount a small tmpfs (the injected-ENOSPC tests cover the rest)")


def test_full_disk_writing_a_pack_is_one_line(tiny_llama, small_disk):
    from mlx_flash.pack import write_pack

    src = tiny_llama("src", layers=4, intermediate=512, hidden=128)
    with pytest.raises(FlashError, match="cannot write") as e:
        write_pack(src, small_disk / "pack", progress=False)
    assert "\n" not in str(e.value) and stale(small_disk) == [] and not (small_disk / "pack").exists()


def test_full_disk_writing_safetensors_is_one_line(small_disk):
    import mlx.core as mx

    with pytest.raises(FlashError, match=r"resident.safetensors: cannot write .*bytes free"):
        save_safetensors(small_disk / "resident.safetensors", {"a": mx.zeros((1 << 20,))})


def test_full_disk_cli_convert_mlx_is_one_line_exit_2(tmp_path, small_disk, capsys):
    from test_sources_gguf import write_tiny_gguf

    from mlx_flash.convert import main

    big = write_tiny_gguf(tmp_path / "tiny.gguf", layers=8)
    with pytest.raises(SystemExit) as e:
        main(["--model", str(big), "--format", "mlx", "--out", str(small_disk / "out")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "cannot write" in err.strip().splitlines()[-1]
    assert stale(small_disk) == [] and not (small_disk / "out").exists()


def test_load_safetensors_reads_arrays_and_names_an_unreadable_file(tmp_path):
    import mlx.core as mx

    save_safetensors(tmp_path / "w.safetensors", {"a": mx.arange(3)})
    assert load_safetensors(tmp_path / "w.safetensors")["a"].tolist() == [0, 1, 2]
    (tmp_path / "bad.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(FlashError, match=r"bad\.safetensors: unreadable safetensors \("):
        load_safetensors(tmp_path / "bad.safetensors")


def test_atomic_dir_replaces_only_on_success(tmp_path):
    target = tmp_path / "t"
    with atomic_dir(target) as tmp:
        (tmp / "a").write_text("1")
    with pytest.raises(RuntimeError):
        with atomic_dir(target, replace=True) as tmp:
            (tmp / "a").write_text("2")
            raise RuntimeError("interrupted")
    assert (target / "a").read_text() == "1" and stale(tmp_path) == []
    with atomic_dir(target, replace=True) as tmp:
        (tmp / "a").write_text("3")
    assert (target / "a").read_text() == "3" and stale(tmp_path) == []


def test_write_json_atomic_takes_a_default_for_values_json_lacks(tmp_path):
    # bench reports hold paths: default=str writes them as text; without it nothing is left behind
    from mlx_flash.paths import write_json_atomic

    write_json_atomic(tmp_path / "r.json", {"pack": tmp_path, "n": 1}, default=str)
    assert json.loads((tmp_path / "r.json").read_text()) == {"pack": str(tmp_path), "n": 1}
    with pytest.raises(TypeError):
        write_json_atomic(tmp_path / "s.json", {"pack": tmp_path})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


def test_write_file_atomic_keeps_the_old_file_until_the_new_one_is_whole(tmp_path):
    from mlx_flash.paths import write_file_atomic, write_text_atomic

    path = tmp_path / "plot.png"
    path.write_text("old")
    seen = []

    def fail_midway(tmp):
        seen.append(tmp)
        tmp.write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        write_file_atomic(path, fail_midway, suffix=".png")
    assert seen[0].suffix == ".png"  # savefig / mx.save_safetensors read the format from it
    assert path.read_text() == "old" and list(tmp_path.iterdir()) == [path]
    write_text_atomic(path, "new")
    assert path.read_text() == "new" and list(tmp_path.iterdir()) == [path]
    with pytest.raises(FlashError, match="missing.*cannot write"):
        write_text_atomic(tmp_path / "missing" / "r.md", "table")


def test_read_json_file_returns_the_object(tmp_path):
    doc = {"model_type": "llama", "eos_token_id": [1, 2], "nested": {"a": None}}
    (tmp_path / "config.json").write_text(json.dumps(doc))
    assert read_json_file(tmp_path / "config.json") == doc
    assert read_json_file(str(tmp_path / "config.json"), "manifest") == doc


@pytest.mark.parametrize("content, reason", [
    (None, "missing"),
    ('{"model_type": "llama",', "not JSON ("),
    (b"\xff\xfe{}", "not JSON ("),
    ("[" * 100_000 + "]" * 100_000, "not JSON this reader can parse (nested too deeply)"),
    ('["llama"]', "not a JSON object (an array)"),
    ("null", "not a JSON object (null)"),
    ("4096", "not a JSON object (a number)"),
    ("1e400", "not a JSON object (a number)"),
    ('"llama"', "not a JSON object (a string)"),
    ("true", "not a JSON object (a boolean)"),
])
def test_read_json_file_bad_file_is_one_line_naming_it(tmp_path, content, reason):
    path = tmp_path / "config.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(FlashError) as e:
        read_json_file(path)
    assert str(e.value).startswith(f"{path}: {reason}") and "\n" not in str(e.value)


def test_read_json_file_refuses_what_is_not_a_regular_file_without_reading_it(tmp_path):
    from conftest import flash_error_within

    os.mkfifo(tmp_path / "fifo.json")
    (tmp_path / "dir.json").mkdir()
    for name in ("fifo.json", "dir.json"):
        path = tmp_path / name
        assert flash_error_within(lambda: read_json_file(path)) == f"{path}: not a regular file"


def test_read_json_file_too_large_or_unreadable_is_one_line(tmp_path, monkeypatch):
    import mlx_flash.paths as paths

    path = tmp_path / "manifest.json"
    path.write_text('{"format": "mlx-flash-pack"}')
    monkeypatch.setattr(paths, "MAX_JSON_BYTES", 16)
    with pytest.raises(FlashError) as e:
        read_json_file(path, "manifest")
    assert str(e.value) == f"{path}: 28 bytes, too large for a manifest (at most 16)"
    monkeypatch.setattr(paths, "MAX_JSON_BYTES", 28)
    assert read_json_file(path, "manifest") == {"format": "mlx-flash-pack"}

    def denied(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", denied)  # root reads any mode: fail the read itself
    with pytest.raises(FlashError) as e:
        read_json_file(path, "manifest")
    assert str(e.value) == f"{path}: cannot read (Permission denied)"
