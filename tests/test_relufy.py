"""python -m mlx_flash.relufy: the CLI end to end on a tiny random llama (byte tokenizer): the output
folder loads, generates and converts; --curve; one-line errors with exit code 2."""

import json

import mlx.core as mx
import numpy as np
import pytest

from mlx_flash import relufy
from calibration_packs import write_byte_tokenizer, write_text


@pytest.fixture
def src(tiny_llama):
    folder = tiny_llama("src", vocab=256)
    write_byte_tokenizer(folder)
    return folder


@pytest.fixture
def texts(tmp_path):
    return [str(write_text(tmp_path / f"t{i}.txt", n_words=200, seed=i)) for i in range(3)]


def test_cli_writes_a_folder_that_loads_generates_and_converts(src, texts, tmp_path, capsys):
    import mlx_flash
    from mlx_flash.pack import write_pack

    out = tmp_path / "relufied"
    assert relufy.main(["--model", str(src), "--text", *texts[:2], "--eval-text", texts[2], "--steps", "3",
                        "--sequence-length", "32", "--checkpoint-every", "2", "--eval-tokens", "64",
                        "--activation", "fatrelu:0.01", "--distill", "0.5", "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "Wrote" in printed and "FFN sparsity" in printed
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "relu_llama" and config["hidden_act"] == "fatrelu"
    assert config["activation_threshold"] == 0.01 and "quantization" not in config
    report = json.loads((out / "relufication.json").read_text())
    # the default recipe: the layer-wise fit (all of this small text) is checkpoint step 0
    fitted = json.loads((out / "checkpoints" / "step-000000" / "trainer.json").read_text())["layerwise"]
    assert 0 < fitted["tokens"] <= 8192 and fitted["tokens"] % 32 == 0
    assert report["steps"] == 3 and report["tokens_trained"] == fitted["tokens"] + 3 * 32
    assert 0 < report["after"]["sparsity"] <= 1 and report["before"]["original"]["sparsity"] is None
    assert report["before"]["layerwise"]["ppl"] > 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000000", "step-000002", "step-000003"]

    model, tokenizer = mlx_flash.load(str(out))
    assert type(model.layers[0].mlp).__module__ == "mlx_flash.models.relu_llama"
    text = mlx_flash.generate(model, tokenizer, "the flash", max_tokens=5)
    assert isinstance(text, str)
    # a flash pack of it runs dense with the same logits as the folder
    pack = write_pack(out, tmp_path / "pack", progress=False)
    packed, _ = mlx_flash.load(str(pack), mode="dense")
    tokens = mx.array([[5, 6, 7, 8]])
    np.testing.assert_allclose(np.array(packed(tokens)), np.array(model(tokens)), rtol=1e-4, atol=1e-4)


def test_curve_measures_every_checkpoint(src, texts, tmp_path, capsys):
    out = tmp_path / "run"
    relufy.main(["--model", str(src), "--text", *texts[:2], "--eval-text", texts[2], "--steps", "3",
                 "--sequence-length", "32", "--checkpoint-every", "1", "--keep-checkpoints", "0",
                 "--out", str(out), "--quiet"])
    capsys.readouterr()
    assert relufy.main(["--curve", str(out), "--eval-text", texts[2], "--sequence-length", "32",
                        "--eval-tokens", "64", "--json", str(tmp_path / "c.json"), "--quiet"]) == 0
    table = capsys.readouterr().out
    assert "original (SiLU)" in table and "swapped, untrained" in table and "layer-wise fit" in table
    assert "step 3" in table
    rows = json.loads((tmp_path / "c.json").read_text())
    assert [r["step"] for r in rows] == ["original", "swapped", 0, 1, 2, 3]  # --keep-checkpoints 0: all
    fitted = rows[2]["tokens_trained"]
    assert fitted > 0 and [r["tokens_trained"] for r in rows] == [0, 0, fitted, fitted + 32, fitted + 64,
                                                                  fitted + 96]
    assert rows[0]["ppl_ratio"] == 1.0 and rows[0]["sparsity"] is None
    assert all(0 < r["sparsity"] < 1 for r in rows[1:])


def test_cli_passes_the_training_options(src, texts, tmp_path):
    out = tmp_path / "run"
    assert relufy.main(["--model", str(src), "--text", *texts[:2], "--eval-text", texts[2], "--steps", "1",
                        "--sequence-length", "32", "--activation", "cats", "--target-sparsity", "0.8",
                        "--sparsity-allocation", "sensitivity", "--allocation-tokens", "32",
                        "--hidden-distill", "0.5", "--no-compile", "--layerwise-tokens", "0",
                        "--out", str(out), "--quiet"]) == 0
    state = json.loads((out / "checkpoints" / "step-000001" / "trainer.json").read_text())
    assert state["hidden_distill"] == 0.5 and state["compiled"] is False
    assert state["sparsity_allocation"] == "sensitivity" and state["allocation"]["tokens"] == 32
    assert len(state["allocation"]["targets"]) == 2 and state["losses"][0]["hidden"] > 0


def test_product_recipe_skips_the_layerwise_fit_unless_asked(src, texts, tmp_path):
    """--activation product --target-sparsity S: per-layer thresholds on |silu(gate) up|, and by
    default no layer-wise fit (checkpoint step 0 is not written); --layerwise-tokens N runs it."""
    argv = ["--model", str(src), "--text", *texts[:2], "--eval-text", texts[2], "--steps", "1",
            "--sequence-length", "32", "--eval-tokens", "64", "--activation", "product",
            "--target-sparsity", "0.7", "--quiet"]
    assert relufy.main(argv + ["--out", str(tmp_path / "a")]) == 0
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["hidden_act"] == "product" and len(config["activation_threshold"]) == 2
    assert sorted(p.name for p in (tmp_path / "a" / "checkpoints").iterdir()) == ["step-000001"]
    report = json.loads((tmp_path / "a" / "relufication.json").read_text())
    assert "layerwise" not in report["before"] and 0.5 < report["after"]["sparsity"] < 0.9
    assert relufy.main(argv + ["--layerwise-tokens", "64", "--out", str(tmp_path / "b")]) == 0
    assert "step-000000" in {p.name for p in (tmp_path / "b" / "checkpoints").iterdir()}


def test_parser_reads_the_librarys_choices_without_importing_mlx():
    import subprocess
    import sys

    from mlx_flash.calibration import relufication as R

    actions = {a.dest: a for a in relufy.build_parser()._actions}
    assert actions["decay"].choices is R.DECAYS and actions["sparsity_allocation"].choices is R.ALLOCATIONS
    assert actions["keep_checkpoints"].default == R.KEEP_CHECKPOINTS
    # the CLI starts (parses, checks its flags) before MLX loads
    code = ("import sys, mlx_flash.relufy as r; r.build_parser().parse_args(['--decay', 'constant']); "
            "sys.exit('mlx.core' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.parametrize("args, message", [
    (["--text", "{t}", "--out", "o", "--hidden-distill", "-1"], "--hidden-distill -1"),
    (["--text", "{t}", "--eval-text", "{e}", "--out", "{o}", "--sparsity-allocation", "sensitivity"],
     "--sparsity-allocation sensitivity: needs --activation cats"),
    (["--text", "missing.txt", "--out", "o"], "--text missing.txt: no such file"),
    (["--text", "{t}", "--out", "o", "--activation", "gelu"], "--activation gelu"),
    (["--text", "{t}", "--out", "o", "--steps", "0"], "--steps 0"),
    (["--text", "{t}", "--out", "o", "--keep-checkpoints", "-1"], "--keep-checkpoints -1"),
    (["--text", "{t}"], "--out"),
    (["--text", "{t}", "--eval-text", "{e}", "--out", "{o}", "--resume"], "--resume"),
    (["--text", "{t}", "--out", "{o}"], "--text: too few files"),
    (["--curve", "{o}", "--eval-text", "{t}"], "--curve"),
])
def test_bad_input_is_one_line_and_exit_2(src, texts, tmp_path, capsys, args, message):
    args = [a.format(t=texts[0], e=texts[1], o=tmp_path / "empty") for a in args]
    with pytest.raises(SystemExit) as e:
        relufy.main(["--model", str(src), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and message in err[0], err
