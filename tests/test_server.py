"""python -m mlx_flash.server: mlx-lm's HTTP server over mlx_flash.load (flash packs included)."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from calibration_packs import tiny_llama_pack

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("args, message", [
    (["--mode", "flash", "--memory-budget", "abc"], "--memory-budget abc: expected a fraction"),
    (["--window", "0"], "--window 0: must be a whole number of tokens >= 1"),
    (["--model", "/nonexistent/model"], "--model /nonexistent/model: no such file or folder"),
    (["--adapter-path", "adapters"], "--adapter-path: not supported by mlx_flash.server"),
    (["--draft-model=small"], "--draft-model: not supported by mlx_flash.server"),
])
def test_bad_flags_exit_2_in_one_line_before_serving(args, message, capsys):
    from mlx_flash.server import main

    with pytest.raises(SystemExit) as e:
        main(args + ["--host", "256.256.256.256"])  # a regression fails to bind instead of serving
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and message in err[0]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port, path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_serves_a_flash_pack_as_the_library_generates(tiny_llama, tmp_path, text):
    """A completion from the server on a calibrated pack in flash mode is the greedy continuation
    mlx_flash.generate gives on the same pack and mode (same tokens), and the log names the plan."""
    import mlx_flash
    from mlx_flash.calibration import fit

    pack = tiny_llama_pack(tiny_llama, tmp_path, layers=4, intermediate=256)
    fit.calibrate(pack, [text], kind="gate-threshold", target_sparsity=0.5, progress=False)
    model, tokenizer = mlx_flash.load(str(pack), mode="flash", memory_budget=0.7)
    prompt = "the flash memory model reads"
    want = mlx_flash.generate(model, tokenizer, tokenizer.encode(prompt), max_tokens=6)
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mlx_flash.server", "--model", str(pack), "--mode", "flash",
                                 "--memory-budget", "0.7", "--port", str(port)], stdout=out, stderr=out, env=env)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if json.loads(r.read())["status"] == "ok":
                        break
            except OSError:
                pass
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        got = _post(port, "/v1/completions", {"prompt": prompt, "max_tokens": 6, "temperature": 0.0})
        assert got["choices"][0]["text"] == want
        assert got["usage"]["completion_tokens"] == 6
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert "mlx_flash: mode flash, budget" in log.read_text()
