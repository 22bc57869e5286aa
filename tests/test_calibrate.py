"""python -m mlx_flash.calibrate: writes predictors into the pack; bad input is one line, exit 2."""

import pytest

from mlx_flash import calibrate as calibrate_cli
from mlx_flash.sparse.predictor import read_predictors_json


def test_cli_writes_into_the_pack(llama_pack, text, capsys):
    assert calibrate_cli.main(["--model", str(llama_pack), "--text", str(text), "--rank", "4",
                              "--target-sparsity", "0.2", "--rank-per-layer", "1:8", "--quiet"]) == 0
    doc = read_predictors_json(llama_pack)
    assert doc["layers"]["0"]["rank"] == 4 and doc["layers"]["1"]["rank"] == 8
    assert doc["calibration"]["texts"] == ["calib.txt"]


def test_cli_bad_text_one_line_exit_2(llama_pack, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    # the CLI: one line, exit 2
    with pytest.raises(SystemExit) as e:
        calibrate_cli.main(["--model", str(llama_pack), "--text", str(empty)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "empty text" in err[0]
