"""mlx_flash/blas.py: the float32 commands restart once with OpenBLAS preloaded on Linux, only when
it is installed, not preloaded yet and not turned off; never when called with arguments (tests)."""

import os
import subprocess
import sys

import pytest

from mlx_flash import blas


@pytest.fixture
def fake_openblas(tmp_path, monkeypatch):
    lib = tmp_path / "libblas.so.3"
    lib.write_bytes(b"")
    monkeypatch.setenv("MLX_FLASH_OPENBLAS", str(lib))
    return str(lib)


def test_restart_plan_preloads_the_installed_openblas_once(fake_openblas):
    lib, env = blas.restart_plan({"PATH": "/bin", "LD_PRELOAD": "/x/libother.so"}, "linux")
    assert lib == fake_openblas
    assert env["LD_PRELOAD"] == f"{fake_openblas} /x/libother.so" and env["PATH"] == "/bin"
    assert env[blas.RESTARTED] == "1"
    assert blas.restart_plan(env, "linux") is None  # restarted once: never again
    assert blas.restart_plan({}, "linux")[1]["LD_PRELOAD"] == fake_openblas


@pytest.mark.parametrize("environ, platform", [
    ({}, "darwin"),
    ({"MLX_FLASH_PRELOAD_BLAS": "0"}, "linux"),
    ({blas.RESTARTED: "1"}, "linux"),
    ({"LD_PRELOAD": "PRELOADED"}, "linux"),  # already preloaded (the test's own library)
    ({"LD_PRELOAD": "/y/a.so:PRELOADED"}, "linux"),
])
def test_no_restart_where_it_cannot_help(fake_openblas, environ, platform):
    environ = {k: v.replace("PRELOADED", fake_openblas) for k, v in environ.items()}
    assert blas.restart_plan(environ, platform) is None


def test_no_restart_without_openblas_installed(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_FLASH_OPENBLAS", str(tmp_path / "missing.so"))
    assert blas.openblas_path() is None and blas.restart_plan({}, "linux") is None


def test_a_caller_passing_arguments_is_never_restarted(fake_openblas, monkeypatch):
    monkeypatch.delenv(blas.RESTARTED, raising=False)
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("restarted"))
    blas.preload_openblas(["--model", "x"])


@pytest.mark.skipif(sys.platform != "linux", reason="LD_PRELOAD restarts are Linux-only")
def test_the_command_restarts_itself_with_openblas_mapped(monkeypatch):
    lib = os.environ.get("MLX_FLASH_OPENBLAS") or blas.openblas_path()
    if lib is None:
        pytest.skip("OpenBLAS is not installed here (Debian: apt-get install libopenblas0-pthread)")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", blas.RESTARTED)}
    code = "from mlx_flash.blas import preload_openblas, loaded_blas; preload_openblas(None); print(loaded_blas())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "restarting" not in out.stderr  # said only with --verbose
    assert os.path.realpath(lib) in out.stdout or lib in out.stdout  # mapped in the restarted process
    verbose = subprocess.run([sys.executable, "-c", code, "--verbose"], env=env, capture_output=True, text=True,
                             timeout=120)
    assert verbose.stderr.count("restarting with LD_PRELOAD=") == 1 and lib in verbose.stderr
    off = subprocess.run([sys.executable, "-c", code], env={**env, "MLX_FLASH_PRELOAD_BLAS": "0"},
                         capture_output=True, text=True, timeout=120)
    assert "restarting" not in off.stderr and lib not in off.stdout


def test_a_float32_command_restarts_and_then_reports_its_error_in_one_line(tmp_path):
    if sys.platform != "linux" or blas.openblas_path() is None:
        pytest.skip("needs Linux with OpenBLAS installed (Debian: apt-get install libopenblas0-pthread)")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", blas.RESTARTED)}
    out = subprocess.run([sys.executable, "-m", "mlx_flash.calibrate", "--model", str(tmp_path / "none"),
                          "--text", str(tmp_path / "t.txt")], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
