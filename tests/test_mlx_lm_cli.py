"""mlx_lm_cli.run_wrapped: our flags parsed, the model resolved, the rest handed to the wrapped
mlx-lm module's main with our loader installed (a stand-in module here)."""

import sys
import types

import pytest

from mlx_flash.errors import FlashError
from mlx_flash.mlx_lm_cli import build_parser, run_wrapped


@pytest.fixture
def fake(monkeypatch):
    seen = {}
    mod = types.ModuleType("fake_mlx_lm_cli")
    mod.main = lambda: seen.setdefault("argv", list(sys.argv))
    monkeypatch.setitem(sys.modules, "fake_mlx_lm_cli", mod)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    return seen


def run(argv, seen_config):
    return run_wrapped(build_parser("prog", "test"), "fake_mlx_lm_cli", argv, ("--adapter-path",), "no adapters",
                       lambda module, config: seen_config.append((module.__name__, config)))


def test_our_flags_become_the_config_and_the_rest_goes_to_mlx_lm(fake, tiny_llama):
    folder = tiny_llama("m")
    configs = []
    assert run(["--model", str(folder), "--port", "9", "--mode", "hybrid", "--memory-budget", "0.5",
                "--window", "3", "--temp", "0.2"], configs) == 0
    (name, config), = configs
    assert name == "fake_mlx_lm_cli" and (config.mode, config.memory_budget.fraction, config.window) == ("hybrid", 0.5, 3)
    assert fake["argv"] == ["prog", "--model", str(folder), "--port", "9", "--temp", "0.2"]


def test_refused_flags_and_bad_values_stop_before_mlx_lm(fake):
    for argv, message in ((["--adapter-path", "a"], "--adapter-path: no adapters"),
                          (["--threads", "0"], "--threads 0: must be a whole number in 1..256"),
                          (["--model", "/no/such"], "--model /no/such: no such file or folder")):
        with pytest.raises(FlashError, match=f"^{message}"):
            run(argv, [])
    assert "argv" not in fake


def test_help_lists_ours_then_passes_on(fake, capsys):
    configs = []
    run(["--help"], configs)
    assert "--memory-budget" in capsys.readouterr().out and fake["argv"] == ["prog", "--help"] and configs == []
