"""python -m mlx_flash.prune (the CLI, run in-process): output folder, one-line errors, exit 2."""

import pytest

from mlx_flash.prune import main


@pytest.mark.parametrize("args,match", [
    (["--sparsity", "1.5"], "error: --sparsity 1.5: must be strictly between 0 and 1"),
    (["--sparsity", "0"], "error: --sparsity 0.0: must be strictly between 0 and 1"),
    (["--sparsity", "0.5", "--layers", "ffn,fc9"], "error: --layers fc9: the model has no such linear layers"),
])
def test_bad_input_is_one_line_exit_2(tiny_llama, tmp_path, capsys, args, match):
    src = tiny_llama("src")
    with pytest.raises(SystemExit) as e:
        main(["--model", str(src), "--method", "magnitude", "--no-eval", "--out", str(tmp_path / "o"), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1].startswith(match), err
    assert len([line for line in err if line.startswith("error")]) == 1
    assert not (tmp_path / "o").exists()


def test_magnitude_writes_a_folder(tiny_llama, tmp_path, capsys):
    src = tiny_llama("src")
    assert main(["--model", str(src), "--method", "magnitude", "--sparsity", "0.5", "--layers", "ffn",
                 "--no-eval", "--out", str(tmp_path / "o")]) == 0
    assert (tmp_path / "o" / "model.safetensors").is_file()
    assert "6 linear layers" in capsys.readouterr().err
