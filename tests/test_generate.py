"""The CLI as users run it: `python -m mlx_flash.generate`, in a subprocess."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run(*args, stdin=None):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    # From the checkout's root, as the README's Quickstart runs it (so `-m` imports the checkout).
    return subprocess.run([sys.executable, "-m", "mlx_flash.generate", *args], capture_output=True,
                          text=True, env=env, input=stdin, timeout=300, cwd=REPO)


def test_quickstart_imports_the_kernels():
    # The Quickstart runs from the checkout, whose mlx_flash/ shadows any installed copy: the
    # compiled kernels must be importable from there (scripts/setup.sh installs editable, building
    # them in place). CI always has a compiler, so there a missing extension is a failure.
    code = "from mlx_flash.cpu import ops; print(ops.EXTENSION_AVAILABLE); print(ops.EXTENSION_ERROR)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    available, error = r.stdout.splitlines()
    if os.environ.get("CI") == "true":
        assert available == "True", f"CPU kernels not importable from the checkout: {error}"
    from mlx_flash.cpu import ops

    assert available == str(ops.EXTENSION_AVAILABLE)


def test_default_model_generates(embedded_model_dir):
    r = run("--prompt", "What is the capital of France?", "--max-tokens", "12")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "Prompt:" in r.stdout and "tokens-per-sec" in r.stdout and "Peak memory:" in r.stdout


def test_q8_activations_flag(embedded_model_dir):
    # int8 activations change the arithmetic, not the answer to an easy question. (Not the France
    # question: there "The" leads "L" by 0.08 logits, and both llama.cpp and this path say "L'Étoile")
    r = run("--prompt", "Name three colors.", "--max-tokens", "24", "--q8-activations")
    assert r.returncode == 0, r.stderr
    assert "red" in r.stdout.lower() and "blue" in r.stdout.lower()


@pytest.mark.parametrize("flag", [True, False])
def test_q8_activations_flag_reaches_the_kernels(embedded_model_dir, monkeypatch, capsys, flag):
    """The flag must switch the kernels' int8 activations on (and only with the flag): the answer
    test above passes whether or not it does."""
    from mlx_flash import api
    from mlx_flash.cpu import ops
    from mlx_flash.generate import main

    seen = []

    def record(*a, **k):
        seen.append(ops._q8x)
        return iter(())

    monkeypatch.setattr(api, "stream_generate", record)
    try:
        main(["--model", str(embedded_model_dir), "--prompt", "hi", "--max-tokens", "2"]
             + (["--q8-activations"] if flag else []))
    finally:
        ops.set_q8_activations(False)
    assert seen == [flag]


@pytest.mark.parametrize("flag", [True, False])
def test_no_kernels_flag_turns_the_cpu_kernels_off(embedded_model_dir, monkeypatch, flag):
    """--no-kernels: the one switch of the CPU kernels (dense layers and MoE experts alike)."""
    from mlx_flash import api
    from mlx_flash.cpu import ops
    from mlx_flash.generate import main

    if not ops.EXTENSION_AVAILABLE:
        pytest.skip("CPU kernels not built")
    seen = []

    def record(*a, **k):
        seen.append(ops.kernels_active())
        return iter(())

    monkeypatch.setattr(api, "stream_generate", record)
    try:
        main(["--model", str(embedded_model_dir), "--prompt", "hi", "--max-tokens", "2"]
             + (["--no-kernels"] if flag else []))
    finally:
        ops.set_kernels_enabled(True)
    assert seen == [not flag]


def test_sampling_is_seeded(embedded_model_dir):
    args = ("--model", str(embedded_model_dir), "--prompt", "Tell me a story", "--max-tokens", "10",
            "--temp", "0.9", "--top-p", "0.95", "--seed", "3")
    a, b = run(*args), run(*args)
    assert a.returncode == 0, a.stderr
    assert a.stdout.split("==========")[1] == b.stdout.split("==========")[1]


def test_top_k_1_and_min_p_1_sample_the_most_likely_token(embedded_model_dir):
    """At temperature 1.5 only the most likely token survives top-k 1 and min-p 1: the greedy text;
    without them the same seed samples another."""
    base = ("--model", str(embedded_model_dir), "--prompt", "Tell me a story", "--max-tokens", "12")
    text = lambda r: r.stdout.split("==========")[1]  # noqa: E731
    greedy = text(run(*base))
    hot = (*base, "--temp", "1.5", "--seed", "5")
    assert text(run(*hot, "--top-k", "1")) == greedy
    assert text(run(*hot, "--min-p", "1")) == greedy
    assert text(run(*hot)) != greedy


def test_ignore_chat_template_and_stdin(embedded_model_dir):
    r = run("--model", str(embedded_model_dir), "--prompt", "-", "--ignore-chat-template",
            "--max-tokens", "5", stdin="The capital of France is")
    assert r.returncode == 0, r.stderr
    assert "Prompt: 5 tokens" in r.stdout


@pytest.mark.parametrize("args, message", [
    (["--model", "/no/such/model"], "--model /no/such/model: no such file or folder"),
    (["--max-tokens", "0"], "--max-tokens 0: must be positive (or -1 for no limit)"),
    (["--top-p", "1.5"], "--top-p 1.5: must be in (0, 1]"),
])
def test_bad_flags_exit_2_one_line(args, message):
    r = run(*args)
    assert r.returncode == 2
    assert r.stderr.strip() == f"error: {message}"


def test_prompt_longer_than_context(embedded_model_dir):
    r = run("--model", str(embedded_model_dir), "--prompt", "word " * 9000, "--max-tokens", "1")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().startswith("error: --prompt: ") and "longer than the model's context of 8192" in r.stderr


def test_verbose_shows_traceback():
    r = run("--model", "/no/such/model", "--verbose")
    assert r.returncode == 2 and "Traceback" in r.stderr


@pytest.mark.parametrize("flags, match", [
    (["--temp", "nan"], "--temp nan: must be a finite number"),
    (["--temp", "inf"], "--temp inf: must be a finite number"),
    (["--seed", "-1"], r"--seed -1: must be in 0..2\^63-1"),
    (["--top-p", "nan"], r"--top-p nan: must be in \(0, 1\]"),
    (["--top-k", "-2"], r"--top-k -2: must be >= 0"),
    (["--min-p", "1.5"], r"--min-p 1.5: must be in \[0, 1\]"),
])
def test_bad_sampling_flags_are_one_line(flags, match, capsys):
    import re

    from mlx_flash.generate import main

    with pytest.raises(SystemExit) as e:
        main(["--model", "/nonexistent", *flags])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and re.search(match, err), err


def test_non_utf8_stdin_is_one_line(monkeypatch, capsys):
    import io

    from mlx_flash.generate import main

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9 \xff")))
    with pytest.raises(SystemExit) as e:
        main(["--model", "/nonexistent", "--prompt", "-"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "--prompt -: stdin is not UTF-8 text (byte 0xe9 at offset 3)" in err



def test_verbose_prints_the_read_cost_profile_of_a_flash_pack(llama_pack, tmp_path, monkeypatch, capsys):
    from mlx_flash.generate import main
    from mlx_flash.io.planner import save_cost
    from mlx_flash.io.read_cost import ReadCostCurve
    from mlx_flash.pack import read_manifest

    monkeypatch.setenv("MLX_FLASH_HOME", str(tmp_path / "home"))
    loaded = {"other_cpu_share": 0.62, "cpus": 2, "seconds": 5.0, "source": "proc_stat"}
    first = llama_pack / read_manifest(llama_pack)["bundles"][0]["file"]
    for engine in ("threads", "aio"):
        save_cost(first, 4, ReadCostCurve([4096, 65536], [1, 32], [[6e-5, 1e-4], [2e-5, 4e-5]], load=loaded,
                                          measured="2026-11-26T05:19:00"), engine)
    args = ["--model", str(llama_pack), "--mode", "hybrid", "--threads", "4", "--max-tokens", "2",
            "--ignore-chat-template"]
    line = f"read-cost profile {tmp_path / 'home' / 'io_profile.json'}: measured 2026-11-26T05:19:00, "
    assert main(args) == 0
    assert line not in capsys.readouterr().err  # only with --verbose (a loaded one warns anyway)
    assert main(args + ["--verbose"]) == 0
    err = capsys.readouterr().err
    assert line in err and "62% of 2 CPU(s)" in err.split(line)[1].splitlines()[0]
