"""python -m mlx_flash.chat: mlx-lm's terminal chat over mlx_flash.load."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from calibration_packs import tiny_llama_pack, write_chat_template

ROOT = Path(__file__).resolve().parents[1]


def chat(args, stdin, timeout=180):
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "mlx_flash.chat", *args], input=stdin, capture_output=True,
                          text=True, env=env, timeout=timeout)


@pytest.mark.parametrize("args, message", [
    (["--memory-budget", "abc"], "--memory-budget abc: expected a fraction"),
    (["--model", "/nonexistent/model"], "--model /nonexistent/model: no such file or folder"),
    (["--adapter-path=adapters"], "--adapter-path: not supported by mlx_flash.chat"),
])
def test_bad_flags_exit_2_in_one_line(args, message, capsys):
    from mlx_flash.chat import main

    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and message in err[0]


def test_answers_as_generate_does_and_quits(embedded_model_dir):
    """Greedy (mlx_lm.chat's default temperature 0): the answer is generate's on the same chat
    prompt; `q` ends the session with exit code 0."""
    import mlx_flash

    model, tokenizer = mlx_flash.load()
    question = "What is the capital of France?"
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    want = mlx_flash.generate(model, tokenizer, prompt, max_tokens=12).strip()
    r = chat(["--max-tokens", "12"], f"{question}\nq\n")
    assert r.returncode == 0, r.stderr
    assert want and want in r.stdout and "bye" in r.stdout


def test_flash_pack_under_a_budget_says_which_mode(tiny_llama, tmp_path, text):
    from mlx_flash.calibration import fit

    pack = tiny_llama_pack(tiny_llama, tmp_path, layers=4, intermediate=256)
    write_chat_template(pack)
    fit.calibrate(pack, [text], kind="gate-threshold", target_sparsity=0.5, progress=False)
    r = chat(["--model", str(pack), "--memory-budget", "0.7", "--max-tokens", "3"], "the flash\nq\n")
    assert r.returncode == 0, r.stderr
    assert "--mode auto: flash within " in r.stderr and "(--memory-budget 0.7)" in r.stderr
