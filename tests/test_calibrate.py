"""python -m mlx_flash.calibrate: writes predictors into the pack; bad input is one line, exit 2."""

import numpy as np
import pytest

from mlx_flash import calibrate as calibrate_cli
from mlx_flash.sparse.predictor import read_predictors_json


def test_cli_writes_into_the_pack(llama_pack, text, capsys):
    assert calibrate_cli.main(["--model", str(llama_pack), "--text", str(text), "--rank", "4",
                              "--target-sparsity", "0.2", "--rank-per-layer", "1:8", "--quiet"]) == 0
    doc = read_predictors_json(llama_pack)
    assert doc["layers"]["0"]["rank"] == 4 and doc["layers"]["1"]["rank"] == 8
    assert doc["calibration"]["texts"] == ["calib.txt"]


def test_cli_quant_gate_with_reorder(llama_pack, text):
    assert calibrate_cli.main(["--model", str(llama_pack), "--text", str(text), "--kind", "quant-gate",
                              "--gate-bits", "3", "--reorder", "--quiet"]) == 0
    doc = read_predictors_json(llama_pack)
    assert {(e["kind"], e["bits"]) for e in doc["layers"].values()} == {("quant-gate", 3)}
    assert doc["calibration"]["gate_bits"] == 3


def test_cli_bad_text_one_line_exit_2(llama_pack, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    # the CLI: one line, exit 2
    with pytest.raises(SystemExit) as e:
        calibrate_cli.main(["--model", str(llama_pack), "--text", str(empty)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "empty text" in err[0]


@pytest.mark.parametrize("flags, message", [
    (["--target-sparsity", "1.5"], "--target-sparsity 1.5: must be in [0, 1)"),
    (["--rank", "0"], "--rank 0: must be >= 1"),
    (["--recall", "0"], "--recall 0.0: must be in (0, 1]"),
    (["--max-window", "0"], "--max-window 0: must be in 1..64"),
    (["--kind", "exact-relu"], "exact-relu"),
    (["--text", "/nonexistent.txt"], "--text /nonexistent.txt: no such file"),
])
def test_flags_are_checked_before_the_dense_pass(llama_pack, text, capsys, monkeypatch, flags, message):
    from mlx_flash.calibration import fit

    def no_dense_pass(*a, **k):
        raise AssertionError("the dense pass ran before the flags were checked")

    monkeypatch.setattr(fit, "collect_inputs", no_dense_pass)
    monkeypatch.setattr(calibrate_cli, "collect_inputs", no_dense_pass)
    argv = ["--model", str(llama_pack), "--text", str(text), *flags]
    with pytest.raises(SystemExit) as e:
        calibrate_cli.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and message in err[0], err


def test_read_only_pack_is_refused_before_the_dense_pass(llama_pack, text, capsys, monkeypatch):
    from mlx_flash.calibration import fit

    ran = lambda *a, **k: (_ for _ in ()).throw(AssertionError("ran"))  # noqa: E731
    monkeypatch.setattr(fit, "collect_inputs", ran)
    monkeypatch.setattr(calibrate_cli, "collect_inputs", ran)

    def refuse(self, *a, **k):
        raise PermissionError(13, "Read-only file system", str(self))

    monkeypatch.setattr(type(llama_pack), "write_bytes", refuse)
    with pytest.raises(SystemExit) as e:
        calibrate_cli.main(["--model", str(llama_pack), "--text", str(text)])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "cannot write into it (Read-only file system)" in err


CATS_THRESHOLDS = [0.03, 0.06]  # |silu(gate x)| cuts of the tiny CATS model's two layers


def cats_pack(tiny_llama, tmp_path, **pack_kwargs):
    """A float16 CATS relu_llama pack and calibration text."""
    from calibration_packs import tiny_cats_pack, write_text

    pack = tiny_cats_pack(tiny_llama, tmp_path, CATS_THRESHOLDS, dtype="float16", **pack_kwargs)
    return pack, [write_text(tmp_path / f"t{i}.txt", n_words=300, seed=i) for i in range(2)]


@pytest.mark.parametrize("kind, gate_bits, tolerance", [("gate-threshold", 4, 1e-3), ("quant-gate", None, 3e-2)])
def test_cats_model_calibrates_with_its_own_thresholds_and_every_mode_computes_it(tiny_llama, tmp_path, kind,
                                                                                  gate_bits, tolerance):
    """The predictors' thresholds are the model's trained ones, so flash (every layer sparse) and
    naive compute the dense CATS model: exactly with the resident gate's exact predictor (the
    relufied model's recipe: convert --dtype float16 --gate-bits 4, calibrate --kind
    gate-threshold), up to the 4-bit gate copy's missed neurons with quant-gate."""
    from calibration_packs import decode_logits
    from mlx_flash.calibration.quality import load_mode

    pack, texts = cats_pack(tiny_llama, tmp_path, gate_bits=gate_bits)
    assert calibrate_cli.main(["--model", str(pack), "--text", *map(str, texts), "--kind", kind,
                               "--reorder", "--quiet"]) == 0
    doc = read_predictors_json(pack)
    assert doc["activation"] == "cats"
    assert [doc["layers"][str(i)]["threshold"] for i in range(2)] == pytest.approx(CATS_THRESHOLDS)
    stats = [doc["layers"][str(i)]["stats"] for i in range(2)]
    assert all(0.05 < s["active"] < 0.95 for s in stats), stats  # the thresholds cut, not all or nothing
    if kind == "gate-threshold":
        assert all(s["predicted"] == s["active"] and s["recall"] == 1 for s in stats)
    ids = [5, 17, 99, 3, 42, 7, 61]
    dense = decode_logits(load_mode(pack, "dense")[0], ids)
    np.testing.assert_allclose(decode_logits(load_mode(pack, "naive")[0], ids), dense, rtol=1e-3, atol=1e-3)
    flash, _ = load_mode(pack, "flash", all_sparse=True)
    np.testing.assert_allclose(decode_logits(flash, ids), dense, rtol=tolerance, atol=tolerance)
    needed = [step.neurons_needed for step in flash.flash_stats.steps]
    assert len(needed) == len(ids) and max(needed) < 0.95 * 2 * 96  # the mask skips neurons


def test_cats_model_refuses_a_target_sparsity(tiny_llama, tmp_path, capsys):
    pack, texts = cats_pack(tiny_llama, tmp_path)
    with pytest.raises(SystemExit) as e:
        calibrate_cli.main(["--model", str(pack), "--text", *map(str, texts), "--target-sparsity", "0.5"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "CATS model's thresholds are its own" in err[0], err


PRODUCT_THRESHOLDS = [0.004, 0.008]  # |silu(gate x) * up x| cuts of the tiny product-threshold model


def test_product_model_calibrates_with_its_own_thresholds_and_flash_computes_it(tiny_llama, tmp_path, capsys):
    """A product-threshold relu_llama (relufy --activation product): calibrate keeps the model's
    thresholds and measures activity on |h|; the default kind is quant-glu (a gate-based kind is
    refused in one line); flash computes the product-thresholded model (every neuron read: the
    dense logits; quant-glu and low-rank: the neurons they skip are the only difference)."""
    from calibration_packs import decode_logits, tiny_cats_pack, write_text
    from mlx_flash.calibration.quality import load_mode

    pack = tiny_cats_pack(tiny_llama, tmp_path, PRODUCT_THRESHOLDS, name="product", act="product",
                          dtype="float16")
    texts = [write_text(tmp_path / f"t{i}.txt", n_words=300, seed=i) for i in range(2)]
    with pytest.raises(SystemExit) as e:
        calibrate_cli.main(["--model", str(pack), "--text", *map(str, texts), "--kind", "gate-threshold"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "product-threshold model" in err[0], err
    ids = [5, 17, 99, 3, 42, 7, 61]
    dense = decode_logits(load_mode(pack, "dense")[0], ids)
    for kind in ("all", None, "low-rank"):
        argv = ["--model", str(pack), "--text", *map(str, texts), "--quiet", "--rank", "16"]
        # (the default kind at 8 bits: 4-bit copies of this tiny model's small random rows are too
        # coarse against its thresholds to skip much at the default recall)
        assert calibrate_cli.main(argv + (["--kind", kind] if kind else ["--gate-bits", "8"])) == 0
        doc = read_predictors_json(pack)
        assert doc["activation"] == "product"
        layers = [doc["layers"][str(i)] for i in range(2)]
        assert [e["kind"] for e in layers] == [kind or "quant-glu"] * 2
        assert [e["threshold"] for e in layers] == pytest.approx(PRODUCT_THRESHOLDS)
        assert all(0.05 < e["stats"]["active"] < 0.95 for e in layers), layers  # |h| > t cuts
        flash, _ = load_mode(pack, "flash", all_sparse=True)
        got = decode_logits(flash, ids)
        if kind == "all":  # every neuron computed: the model's own product rule, nothing else
            np.testing.assert_allclose(got, dense, rtol=1e-3, atol=1e-3)
            continue
        needed = [step.neurons_needed for step in flash.flash_stats.steps]
        assert max(needed) < 0.95 * 2 * 96  # the predictor skips neurons
        if kind is None:  # the 8-bit gate and up copies keep the calibrated recall (0.99 default)
            assert all(e["stats"]["recall"] >= 0.95 for e in layers), layers
            np.testing.assert_allclose(got, dense, rtol=5e-2, atol=5e-2)
        assert np.corrcoef(got.ravel(), dense.ravel())[0, 1] > 0.9


def test_quant_glu_on_a_resident_gate_pack_copies_up_alone_and_shares_the_gate(tiny_llama, tmp_path, monkeypatch):
    """A product-threshold pack converted with --gate-bits 4: quant-glu stores a quantized copy of
    up alone and takes the model's resident gate (exact: the one the rows use), counted once; in
    flash mode each sparse layer computes its mask from the gate matvec its rows take (one per
    layer), and the logits stay those of the dense pack within the calibrated recall."""
    from calibration_packs import decode_logits, tiny_cats_pack, write_text
    from mlx_flash.calibration.quality import load_mode
    import mlx.core as mx

    from mlx_flash.paths import load_safetensors
    from mlx_flash.sparse.predictor import LayerPredictor, load_predictors

    pack = tiny_cats_pack(tiny_llama, tmp_path, PRODUCT_THRESHOLDS, name="product-g4", act="product",
                          dtype="float16", gate_bits=4)
    texts = [write_text(tmp_path / f"t{i}.txt", n_words=300, seed=i) for i in range(2)]
    assert calibrate_cli.main(["--model", str(pack), "--text", *map(str, texts), "--quiet", "--gate-bits", "8"]) == 0
    doc = read_predictors_json(pack)
    layers = [doc["layers"][str(i)] for i in range(2)]
    assert [e["kind"] for e in layers] == ["quant-glu"] * 2
    assert all(e["stats"]["recall"] >= 0.95 for e in layers), layers
    stored = load_safetensors(pack / "predictors.safetensors")
    assert sorted({k.split(".", 2)[2] for k in stored}) == ["up.biases", "up.scales", "up.weight"]
    predictors = load_predictors(pack)
    for i, p in predictors.items():
        assert p.resident_gate and p.nbytes == sum(v.nbytes for k, v in stored.items() if k.startswith(f"layers.{i}."))
    ids = [5, 17, 99, 3, 42, 7, 61]
    dense = decode_logits(load_mode(pack, "dense")[0], ids)
    real, shared = LayerPredictor.mask_from_gate, []

    def recorded(self, g, x=None):
        shared.append(x is not None)
        return real(self, g, x)

    monkeypatch.setattr(LayerPredictor, "mask_from_gate", recorded)
    flash, _ = load_mode(pack, "flash", all_sparse=True)
    rt = flash.flash_runtime
    for i, p in rt.predictors.items():  # its gate: the model's own resident arrays
        assert p._t["gate.weight"] is rt.currents[i].resident_gate["weight"]
        x = mx.random.normal((3, p._t["up.weight"].shape[1] * 32 // 8), key=mx.random.key(i)).astype(mx.float16)
        assert mx.array_equal(real(p, rt.currents[i].full_gate(x), x), p(x)).item()
    got = decode_logits(flash, ids)
    assert shared and all(shared) and len(shared) == 2 * len(flash.flash_stats.steps)
    assert max(step.neurons_needed for step in flash.flash_stats.steps) < 0.95 * 2 * 96
    np.testing.assert_allclose(got, dense, rtol=5e-2, atol=5e-2)


def test_quant_glu_is_refused_for_a_model_thresholding_its_gate(tiny_llama, tmp_path, capsys):
    pack, texts = cats_pack(tiny_llama, tmp_path)
    with pytest.raises(SystemExit) as e:
        calibrate_cli.main(["--model", str(pack), "--text", *map(str, texts), "--kind", "quant-glu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "--kind quant-glu" in err[0] and "cats" in err[0], err
