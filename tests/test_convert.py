"""python -m mlx_flash.convert: sources -> flash pack, or GGUF -> mlx-lm folder; atomically."""

import json
import re

import pytest

from mlx_flash.convert import main
from mlx_flash.errors import FlashError


@pytest.mark.parametrize("named", [True, False])  # without --model: the embedded model, as generate's default
def test_convert_embedded_gguf(embedded_gguf, tmp_path, named):
    out = tmp_path / "smol"
    assert main(["--model", str(embedded_gguf)] * named + ["--out", str(out), "--format", "mlx"]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 32
    assert config["quantization"]["model.embed_tokens"] == {"bits": 8, "group_size": 32}
    assert config["tie_word_embeddings"] is True
    tok = json.loads((out / "tokenizer_config.json").read_text())
    assert tok["eos_token"] == "<|im_end|>" and "chat_template" in tok
    assert [p.name for p in tmp_path.iterdir()] == ["smol"]  # no temporary leftovers

    from mlx_lm import load as mlx_lm_load

    model, tokenizer = mlx_lm_load(str(out))
    assert tokenizer.encode("Hello") and model.args.num_hidden_layers == 30


def test_convert_to_pack_from_gguf_and_folder(embedded_gguf, tiny_llama, tmp_path):
    from mlx_flash.pack import read_manifest

    assert main(["--model", str(embedded_gguf), "--out", str(tmp_path / "p1")]) == 0
    manifest = read_manifest(tmp_path / "p1")
    assert manifest["config"]["num_hidden_layers"] == 30
    assert (tmp_path / "p1" / "tokenizer.json").is_file()
    src = tiny_llama("f", dtype="float32")
    assert main(["--model", str(src), "--out", str(tmp_path / "p2"), "--dtype", "float16",
                 "--quantize", "8", "--group-size", "32"]) == 0
    assert read_manifest(tmp_path / "p2")["config"]["quantization"]["bits"] == 8


@pytest.mark.parametrize("down_bits, requantized", [("8", True), ("16", False)])
def test_down_bits_flag(tiny_llama, tmp_path, down_bits, requantized):
    from mlx_flash.pack import read_manifest

    src = tiny_llama("q", quantize=(4, 32), intermediate=128)
    assert main(["--model", str(src), "--out", str(tmp_path / "p"), "--down-bits", down_bits]) == 0
    assert read_manifest(tmp_path / "p")["down_requantized"] is requantized


def test_existing_output_is_refused(embedded_gguf, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--model", str(embedded_gguf), "--out", str(tmp_path)])
    assert e.value.code == 2
    assert "already exists" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["missing", "not_gguf", "truncated"])
def test_bad_source_exit_2_one_line(bad, embedded_gguf, tmp_path, capsys):
    src = tmp_path / "src.gguf"
    if bad == "not_gguf":
        src = tmp_path / "src.bin"
        src.write_bytes(b"hello")
    elif bad == "truncated":
        src.write_bytes(embedded_gguf.read_bytes()[: 8 << 20])
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        main(["--model", str(src), "--out", str(out), "--format", "mlx"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and str(src) in err and len(err.splitlines()) == 1
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == (
        [] if bad == "missing" else [src.name])


def test_convert_expert_bits_measures_widths_on_text_and_refuses_bad_flags(text, tmp_path, capsys):
    from calibration_packs import write_byte_tokenizer
    from conftest import write_tiny_moe

    from mlx_flash.pack import read_manifest

    # a byte tokenizer: 256 logits per token (SmolLM2's 49152 made the KL, the layer losses and
    # the tuning steps most of this test's 38 s)
    src = write_tiny_moe(tmp_path / "src", "mixtral", experts=4, layers=2, vocab=256)
    write_byte_tokenizer(src)
    # 512 of the text's ~2350 byte tokens: about the ~400 SmolLM2 tokens it held
    args = ["--model", str(src), "--group-size", "32", "--calib-text", str(text), "--calib-tokens", "512"]
    assert main(args + ["--expert-bits", "3", "--expert-importance", "layer-loss",
                        "--out", str(tmp_path / "p")]) == 0
    m = read_manifest(tmp_path / "p")
    widths = [b for entry in m.bundles for b in entry.expert_bits]
    assert len(widths) == 8 and sum(widths) <= 24 and set(widths) <= {2, 3, 4, 8}
    routing = m.get("moe_routing")  # calibration routing statistics for the per-layer slots
    assert routing["sizes"] == [2, 3, 4] and set(routing["hits"]) == {"0", "1"}
    err = capsys.readouterr().err
    assert "expert bits on" in err and "--expert-importance layer-loss: KL" in err
    assert "  layer 1: " in err
    # every expert at one width by the chosen quantizer (the all-4-bit reference of docs/moe.md)
    assert main(args + ["--expert-bits", "4", "--expert-widths", "4", "--expert-quantizer", "clip",
                        "--expert-assign", "greedy", "--out", str(tmp_path / "p4")]) == 0
    assert {b for e in read_manifest(tmp_path / "p4").bundles for b in e.expert_bits} == {4}
    # --expert-bits' own default: 8192 calibration tokens (all ~2350 of this text), not 2048
    n_text = len(text.read_bytes())
    assert 2048 < n_text < 8192
    assert main(args[:-2] + ["--expert-bits", "4", "--expert-widths", "4", "--out", str(tmp_path / "pd")]) == 0
    assert f"expert bits on {n_text} calibration tokens" in capsys.readouterr().err
    assert main(args + ["--expert-bits-tolerance", "1e9", "--out", str(tmp_path / "pt")]) == 0
    assert {b for e in read_manifest(tmp_path / "pt").bundles for b in e.expert_bits} == {2}
    assert "--expert-bits-tolerance 1e+09%" in capsys.readouterr().err
    assert main(args + ["--expert-bits", "3", "--expert-tune", "2", "--expert-tune-lr-width", "2=3",
                        "--expert-tune-int-lr", "0.3", "--expert-importance", "layer-loss-frozen",
                        "--out", str(tmp_path / "pk")]) == 0
    err = capsys.readouterr().err
    assert "--expert-tune 2: KL from the float model" in err
    assert "--expert-importance layer-loss-frozen: KL" in err and "bits with routing frozen" in err
    assert "learning rate x3 at 2 bits)" in err
    # a validation split after the tuning range scored at every checkpoint; the best one is kept
    assert main(["--model", str(src), "--group-size", "32", "--calib-text", str(text), str(text),
                 "--calib-tokens", "512", "--expert-bits", "3", "--expert-tune", "3",
                 "--expert-tune-tokens", "300", "--expert-tune-val-tokens", "256", "--expert-tune-every", "2",
                 "--out", str(tmp_path / "pv")]) == 0
    err = capsys.readouterr().err
    assert "--expert-tune step 2: validation perplexity " in err
    assert re.search(r"--expert-tune-val-tokens 256: validation perplexity \(1 windows of 256 after "
                     r"the first 300 --calib-text tokens\) at steps 0: [\d.]+, 2: [\d.]+, 3: [\d.]+; "
                     r"the pack keeps step [023]\n", err), err
    step0 = re.search(r"at steps 0: ([\d.]+),", err).group(1)
    # without --expert-tune: the rounded experts scored on the same split, step 0's figure
    assert main(["--model", str(src), "--group-size", "32", "--calib-text", str(text), str(text),
                 "--calib-tokens", "512", "--expert-bits", "3", "--expert-tune-tokens", "300",
                 "--expert-tune-val-tokens", "256", "--out", str(tmp_path / "pr")]) == 0
    err = capsys.readouterr().err
    assert (f"--expert-tune-val-tokens 256: validation perplexity {step0} (1 windows of 256 after "
            "the first 300 --calib-text tokens; experts rounded, not tuned)") in err, err
    for bad, flag in ((["--expert-bits", "9"], "--expert-bits 9"),
                      (["--expert-bits", "3", "--group-size", "128"], "--group-size 128"),
                      (["--expert-bits", "3", "--expert-bits-tolerance", "5"], "--expert-bits-tolerance"),
                      (["--expert-widths", "4"], "--expert-widths"),
                      (["--expert-tune", "2"], "--expert-tune"),
                      (["--expert-bits", "3", "--expert-tune-lr-width", "2=3"],
                       "--expert-tune-lr-width"),
                      (["--expert-bits", "3", "--expert-tune", "2", "--expert-tune-lr-width", "5=3"],
                       "--expert-tune-lr-width 5=3"),
                      (["--expert-bits", "3", "--expert-tune", "2", "--expert-tune-lr-width", "2"],
                       "--expert-tune-lr-width 2"),
                      (["--expert-bits", "3", "--expert-tune", "2", "--expert-quantizer", "mlx"],
                       "--expert-tune"),
                      (["--expert-bits", "3", "--expert-widths", "4"], "--expert-bits 3"),
                      (["--expert-tune-val-tokens", "256"], "--expert-tune-val-tokens"),
                      (["--expert-bits", "3", "--expert-tune", "2", "--expert-tune-val-tokens", "100"],
                       "--expert-tune-val-tokens 100"),
                      (["--expert-bits", "3", "--expert-tune", "2", "--expert-tune-val-tokens", "4096"],
                       "--expert-tune-val-tokens 4096: needs at least"),
                      (["--expert-bits", "3", "--expert-tune", "2", "--expert-tune-every", "0"],
                       "--expert-tune-every 0"),
                      (["--expert-bits", "3", "--expert-tune-int-lr", "0.1"], "--expert-tune-int-lr"),
                      (["--expert-bits", "3", "--expert-tune", "2", "--expert-tune-int-lr", "-1"],
                       "--expert-tune-int-lr -1: must be > 0")):
        with pytest.raises(SystemExit) as e:
            main(args + bad + ["--out", str(tmp_path / "q")])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2
        assert flag in err and len(err.splitlines()) == 1, err
    with pytest.raises(SystemExit) as e:
        main(["--model", str(src), "--expert-bits", "3", "--out", str(tmp_path / "q")])
    assert e.value.code == 2 and "--calib-text" in capsys.readouterr().err


def test_convert_tokenizes_calib_text_once_and_slices_it(embedded_model_dir, text, tmp_path,
                                                          monkeypatch, capsys):
    """Calibration, tuning and the validation split get the tokens separate tokenizations gave."""
    import shutil

    import numpy as np
    from calibration_packs import write_text
    from conftest import write_tiny_moe

    from mlx_flash.calibration import dense_pass, expert_bits, expert_tune
    from mlx_flash.models import load_tokenizer

    src = write_tiny_moe(tmp_path / "src", "mixtral", experts=4, layers=1, vocab=49152)
    for f in embedded_model_dir.glob("tokenizer*"):
        shutil.copy2(f, src / f.name)
    files = [str(text), str(write_text(tmp_path / "b.txt", seed=1)), str(text)]
    calls, seen = {}, {}

    def spy(module, name, **positions):  # counts the calls, keeps the arguments at `positions`
        real = getattr(module, name)

        def call(*a, **kw):
            calls[name] = calls.get(name, 0) + 1
            seen.update({key: a[i] for key, i in positions.items()})
            return real(*a, **kw)
        monkeypatch.setattr(module, name, call)
        return real

    text_tokens = spy(dense_pass, "text_tokens")
    spy(expert_bits, "measure_errors", measured=1)
    spy(expert_bits, "routing_statistics", routed=1)
    spy(expert_tune, "tune_keeping_best", tuned=5, windows=6)
    assert main(["--model", str(src), "--group-size", "32", "--calib-text", *files,
                 "--calib-tokens", "100", "--expert-bits", "3", "--expert-quantizer", "minmax",
                 "--expert-tune", "1", "--expert-tune-tokens", "300", "--expert-tune-val-tokens",
                 "512", "--expert-tune-every", "1", "--out", str(tmp_path / "p")]) == 0
    assert calls["text_tokens"] == 1
    tok = load_tokenizer(src)
    separate = {n: text_tokens(files, tok, n) for n in (100, 300, None)}
    assert len(separate[300]) == 300 and len(separate[None]) > 300 + 2 * 257
    np.testing.assert_array_equal(seen["measured"], separate[100])
    np.testing.assert_array_equal(seen["routed"], separate[100])
    np.testing.assert_array_equal(seen["tuned"], separate[300])
    want = expert_tune.validation_windows(separate[None], 300, 512)
    assert len(seen["windows"]) == len(want) == 2
    for got, w in zip(seen["windows"], want):
        np.testing.assert_array_equal(got, w)
    capsys.readouterr()
    for flag in ("--calib-tokens", "--expert-tune-tokens"):  # below text_tokens' minimum: refused
        with pytest.raises(SystemExit) as e:
            main(["--model", str(src), "--calib-text", *files, "--expert-bits", "3", flag, "63",
                  "--out", str(tmp_path / "q")])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and err.endswith(f"{flag} 63: must be >= 64"), err


def test_gate_bits_flag_keeps_the_gate_resident(tiny_llama, tmp_path, capsys):
    src = tiny_llama("src", dtype="float16")
    out = tmp_path / "pack"
    assert main(["--model", str(src), "--gate-bits", "4", "--out", str(out)]) == 0
    bundles = json.loads((out / "manifest.json").read_text())["bundles"]
    assert all(b["resident_gate"]["bits"] == 4 and [c["name"] for c in b["components"]] == ["up.weight", "down_t.weight"]
               for b in bundles)
    with pytest.raises(SystemExit) as e:
        main(["--model", str(src), "--gate-bits", "4", "--quantize", "4", "--out", str(tmp_path / "q")])
    assert e.value.code == 2 and "--gate-bits" in capsys.readouterr().err


def test_resident_bits_flag_quantizes_the_resident_linears(tiny_llama, tmp_path, capsys):
    src = tiny_llama("src", dtype="float16")
    out = tmp_path / "pack"
    assert main(["--model", str(src), "--gate-bits", "4", "--resident-bits", "8", "--resident-group-size",
                 "32", "--out", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    q = manifest["config"]["quantization"]
    assert (q["bits"], q["group_size"], q["model.layers.0.mlp.gate_proj"]["bits"]) == (8, 32, 4)
    assert manifest["resident"]["tensors"]["model.layers.0.self_attn.q_proj.weight"]["dtype"] == "uint32"
    with pytest.raises(SystemExit) as e:
        main(["--model", str(src), "--resident-bits", "8", "--quantize", "4", "--out", str(tmp_path / "q")])
    assert e.value.code == 2 and "--resident-bits" in capsys.readouterr().err


def test_resident_module_and_quantizer_flags(tiny_llama, tmp_path, capsys):
    """--resident-module NAME=BITS[:GROUP] and --resident-quantizer gptq --resident-calib-text:
    the pack holds each module at its own bits, GPTQ-rounded (not mx.quantize's values), and
    its dense model runs; bad specs and a missing calibration text are one line, exit 2."""
    import mlx.core as mx
    from calibration_packs import write_byte_tokenizer

    src = tiny_llama("src", dtype="float16", vocab=256)
    write_byte_tokenizer(src)
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"word{i % 97}" for i in range(2000)))
    out = tmp_path / "pack"
    assert main(["--model", str(src), "--gate-bits", "4", "--resident-bits", "4", "--resident-group-size", "32",
                 "--resident-module", "embed_tokens=8", "v_proj=8:32", "--resident-quantizer", "gptq",
                 "--resident-calib-text", str(text), "--resident-calib-tokens", "512", "--out", str(out)]) == 0
    q = json.loads((out / "manifest.json").read_text())["config"]["quantization"]
    assert (q["bits"], q["group_size"], q["model.embed_tokens"], q["model.layers.1.self_attn.v_proj"]) == (
        4, 32, {"bits": 8, "group_size": 64}, {"bits": 8, "group_size": 32})
    resident = mx.load(str(out / "resident.safetensors"))
    name = "model.layers.0.self_attn.q_proj"
    plain = mx.quantize(mx.load(str(src / "model.safetensors"))[f"{name}.weight"], group_size=32, bits=4)[0]
    assert resident[f"{name}.weight"].shape == plain.shape and not mx.array_equal(resident[f"{name}.weight"], plain).item()
    from mlx_flash import FlashConfig, load
    model, _ = load(str(out), FlashConfig("dense"), progress=False)
    assert model.model.embed_tokens.bits == 8 and model.layers[0].self_attn.q_proj.bits == 4
    assert mx.isfinite(model(mx.array([[1, 2, 3]]))).all().item()
    for argv, message in ((["--resident-bits", "8", "--resident-module", "q_proj"], "--resident-module q_proj: not NAME=BITS"),
                          (["--resident-module", "q_proj=4"], "--resident-module: needs --resident-bits"),
                          (["--resident-bits", "8", "--resident-quantizer", "gptq"], "needs --resident-calib-text"),
                          (["--resident-bits", "8", "--resident-calib-text", str(text)], "--resident-calib-text: "
                                                                                          "--resident-quantizer mlx")):
        with pytest.raises(SystemExit) as e:
            main(["--model", str(src), *argv, "--out", str(tmp_path / "bad")])
        assert e.value.code == 2 and message in capsys.readouterr().err
