"""--mode auto (models/auto.py): dense when the weights fit, else flash (calibrated or MoE packs)
or hybrid within the budget; through resolve_auto, mlx_flash.load and the generate CLI."""

import pytest

from calibration_packs import tiny_llama_pack, write_byte_tokenizer
from conftest import write_tiny_moe
from mlx_flash.config import FlashConfig
from mlx_flash.errors import FlashError
from mlx_flash.models import auto
from mlx_flash.pack import read_manifest, write_pack

PLENTY = lambda: (1 << 40, "MemAvailable")  # noqa: E731


@pytest.fixture
def pack(tiny_llama, tmp_path):
    return tiny_llama_pack(tiny_llama, tmp_path, layers=4, intermediate=256)


@pytest.fixture
def calibrated(pack, text):
    from mlx_flash.calibration import fit

    fit.calibrate(pack, [text], kind="gate-threshold", target_sparsity=0.5, progress=False)
    return pack


def resolve(pack, available=PLENTY, **options):
    return auto.resolve_auto(pack, read_manifest(pack), FlashConfig(**options), available)


def test_the_default_mode_is_auto_and_a_concrete_mode_passes_through(pack):
    assert FlashConfig().mode == "auto"
    for mode in ("dense", "naive", "hybrid", "flash"):
        cfg, note = resolve(pack, mode=mode, memory_budget=0.5)
        assert (cfg.mode, cfg.memory_budget.fraction, note) == (mode, 0.5, None)


def test_dense_when_the_weights_fit(pack):
    need = auto.dense_bytes(read_manifest(pack))
    cfg, note = resolve(pack, lambda: (int(need / auto.AUTO_SHARE) + 4096, "MemAvailable"))
    assert (cfg.mode, cfg.memory_budget, note) == ("dense", None, None)
    cfg, note = resolve(pack, memory_budget=1.0)
    assert (cfg.mode, cfg.memory_budget.fraction, note) == ("dense", 1.0, None)
    cfg, note = resolve(pack, lambda: None)  # nothing tells: everything resident, as mlx-lm loads
    assert (cfg.mode, note) == ("dense", None)


def test_uncalibrated_pack_over_budget_runs_hybrid(pack):
    cfg, note = resolve(pack, memory_budget=0.7)
    assert cfg.mode == "hybrid" and cfg.memory_budget.fraction == 0.7
    assert note.startswith("--mode auto: hybrid within ") and "(memory_budget=0.7)" in note
    assert f"python -m mlx_flash.calibrate --model {pack}" in note


def test_calibrated_pack_over_the_available_memory_runs_flash_in_a_share_of_it(calibrated):
    need = auto.dense_bytes(read_manifest(calibrated))
    cfg, note = resolve(calibrated, lambda: (need, "cgroup /bench memory.limit_in_bytes"))
    assert cfg.mode == "flash" and cfg.memory_budget.nbytes == int(auto.AUTO_SHARE * need)
    assert cfg.memory_budget.param.startswith("--mode auto (80% of ")
    assert "cgroup /bench memory.limit_in_bytes" in note and "calibrate" not in note


def test_moe_pack_over_budget_runs_flash(tmp_path):
    src = write_tiny_moe(tmp_path / "src", "qwen2_moe", quantize=(4, 32), experts=8)
    moe = write_pack(src, tmp_path / "pack", progress=False)
    cfg, note = resolve(moe, memory_budget=0.8)
    assert cfg.mode == "flash" and note.startswith("--mode auto: flash within ")


def test_load_runs_the_choice_and_keeps_its_note(calibrated, monkeypatch):
    import mlx_flash

    need = auto.dense_bytes(read_manifest(calibrated))
    monkeypatch.setattr(auto, "available_memory", lambda: (int(0.9 * need), "MemAvailable"))
    model, _ = mlx_flash.load(calibrated)
    assert model.flash_stats.plan.mode == "flash" and model.flash_auto_note.startswith("--mode auto: flash")
    monkeypatch.setattr(auto, "available_memory", lambda: (need, "MemAvailable"))
    model, _ = mlx_flash.load(calibrated, memory_budget=1.0)
    assert model.flash_stats.plan.mode == "dense" and model.flash_auto_note is None


def test_auto_budget_below_the_minimum_names_where_it_came_from(pack, monkeypatch):
    import mlx_flash

    monkeypatch.setattr(auto, "available_memory", lambda: (4096, "cgroup /tiny memory.max"))
    with pytest.raises(FlashError, match=r"^--mode auto \(80% of 4.1 kB available, cgroup /tiny memory.max\) "
                                         r"3.3 kB: below the minimum resident set of mode hybrid"):
        mlx_flash.load(pack)


def test_plain_folder_runs_dense_and_refuses_a_budget(tiny_llama):
    import mlx_flash

    folder = tiny_llama("plain", vocab=256)
    write_byte_tokenizer(folder)
    model, _ = mlx_flash.load(folder)
    assert getattr(model, "flash_stats", None) is None
    with pytest.raises(FlashError, match=r"^memory_budget=0.5: needs a flash pack"):
        mlx_flash.load(folder, memory_budget=0.5)
    with pytest.raises(FlashError, match=r"^--mode hybrid: needs a flash pack"):
        mlx_flash.load(folder, mode="hybrid", memory_budget=0.5)


def test_generate_without_mode_runs_hybrid_under_a_budget_and_says_so(pack, capsys):
    from mlx_flash.generate import main

    assert main(["--model", str(pack), "--memory-budget", "0.7", "--max-tokens", "2", "--ignore-chat-template",
                 "--stats"]) == 0
    out, err = capsys.readouterr()
    assert "--mode auto: hybrid within " in err and "(--memory-budget 0.7)" in err
    assert "Memory plan: mode hybrid" in out
