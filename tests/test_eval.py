"""python -m mlx_flash.eval: JSON output and one-line errors (exit 2), on a tiny random pack."""

import json

import pytest

from calibration_packs import write_text

from mlx_flash import eval as eval_cli


def test_cli_json_and_errors(llama_pack, tmp_path, capsys):
    pack, text = llama_pack, write_text(tmp_path / "eval.txt", n_words=60, seed=11)
    out = tmp_path / "r.json"
    assert eval_cli.main(["ppl", "--model", str(pack), "--mode", "naive", "--text", str(text),
                    "--max-tokens", "40", "--sequence-length", "20", "--json", str(out), "--quiet"]) == 0
    r = json.loads(out.read_text())
    assert r["mode"] == "naive" and r["agreement"] == 1.0 and r["tokens"] == 2 * 19
    assert "Perplexity:" in capsys.readouterr().out
    short = tmp_path / "short.txt"
    short.write_text("tiny")
    for argv, message in [
        (["ppl", "--model", str(pack), "--text", str(short), "--quiet"], "short.txt: 4 tokens, need at least 256"),
        (["ppl", "--model", str(tmp_path), "--text", str(text), "--quiet"], "not a flash pack"),
        (["ppl", "--model", str(pack), "--text", str(text), "--sequence-length", "1000", "--quiet"],
         "--sequence-length 1000: longer than the model's context"),
        (["ppl", "--model", str(pack), "--mode", "flash", "--text", str(text), "--max-tokens", "64",
          "--sequence-length", "32", "--quiet"], "python -m mlx_flash.calibrate"),
    ]:
        with pytest.raises(SystemExit) as e:
            eval_cli.main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and message in err[0], err


def test_json_destination_checked_before_the_model_runs(llama_pack, tmp_path, capsys, monkeypatch):
    from mlx_flash import eval as eval_module

    monkeypatch.setattr(eval_module, "evaluate_ppl", lambda *a, **k: (_ for _ in ()).throw(AssertionError("ran")))
    text = write_text(tmp_path / "eval.txt", n_words=60, seed=11)
    for dest, message in [(tmp_path / "missing" / "r.json", "--json"), ("/proc/r.json", "--json /proc: cannot write into it")]:
        with pytest.raises(SystemExit) as e:
            eval_cli.main(["ppl", "--model", str(llama_pack), "--text", str(text), "--json", str(dest), "--quiet"])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and message in err[0], err
