"""Every script and notebook in examples/ runs (CI executes them here)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES_DIR = Path(__file__).parent.parent / "examples"
EXAMPLES = sorted(EXAMPLES_DIR.glob("*.py"))
NOTEBOOKS = sorted(EXAMPLES_DIR.glob("*.ipynb"))


@pytest.mark.parametrize("script", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(script, embedded_model_dir, tmp_path):
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                       cwd=tmp_path, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip()
    if script.name == "chat.py":  # default question: the capital of France
        assert "Paris" in r.stdout and "tokens/s" in r.stdout
    if script.name == "server_client.py":  # the same question, through the HTTP server
        assert "Paris" in r.stdout and "completion tokens" in r.stdout


def notebook_outputs(nb) -> tuple[str, set]:
    """All text a run of `nb` printed, and the MIME types of its rich outputs."""
    text, mime = [], set()
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            text.append(out.get("text", ""))
            mime.update(out.get("data", {}))
            text.append(out.get("data", {}).get("text/plain", ""))
    return "".join(text), mime


@pytest.mark.slow
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(notebook, embedded_model_dir, tmp_path, monkeypatch):
    import nbclient  # the test extra installs both
    import nbformat

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(notebook, as_version=4)
    # Raises CellExecutionError, with the failing cell and its traceback, if any cell fails.
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    text, mime = notebook_outputs(nb)
    if notebook.name == "quickstart.ipynb":
        assert "Memory plan: mode flash" in text and "MB read/token" in text
        assert "image/png" in mime  # the budget sweep's plot
