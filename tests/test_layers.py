"""The layering contracts in pyproject.toml ([tool.importlinter]) hold, and would catch a break."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def lint_imports(root: Path, config: Path) -> subprocess.CompletedProcess:
    """`lint-imports` on the mlx_flash package under `root` (not imported: grimp reads the sources)."""
    code = ("import sys; from importlinter.cli import lint_imports; "
            f"sys.exit(lint_imports(config_filename={str(config)!r}, no_cache=True, no_logo=True))")
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True)


def test_contracts_are_kept():
    result = lint_imports(ROOT, ROOT / "pyproject.toml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_an_upward_import_breaks_the_layers(tmp_path):
    shutil.copytree(ROOT / "mlx_flash", tmp_path / "mlx_flash", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    paths = tmp_path / "mlx_flash" / "paths.py"
    paths.write_text(paths.read_text() + "\n\ndef _upward():\n    from .models import load  # noqa: F401\n")
    result = lint_imports(tmp_path, ROOT / "pyproject.toml")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "mlx_flash.paths -> mlx_flash.models" in result.stdout


def test_a_cycle_between_siblings_is_caught(tmp_path):
    shutil.copytree(ROOT / "mlx_flash", tmp_path / "mlx_flash", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    planner = tmp_path / "mlx_flash" / "io" / "planner.py"  # loader imports planner; now back too
    planner.write_text(planner.read_text() + "\n\ndef _cycle():\n    from .loader import FlashLoader  # noqa: F401\n")
    result = lint_imports(tmp_path, ROOT / "pyproject.toml")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "no import cycles" in result.stdout and "BROKEN" in result.stdout
