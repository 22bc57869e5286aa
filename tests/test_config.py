"""config.py: FlashConfig and the memory budget, parsed once; errors name what the caller used."""

import pytest

from mlx_flash.config import FlashConfig, MemoryBudget, memory_budget_arg, parse_memory_budget
from mlx_flash.errors import FlashError


@pytest.mark.parametrize("value,fraction,nbytes", [
    (0.65, 0.65, None), ("0.5", 0.5, None), (1, 1.0, None), ("6GB", None, 6 * 10**9),
    ("700MiB", None, 700 * 2**20), ("123456", None, 123456), (2048, None, 2048), (" 1.5 kb ", None, 1500)])
def test_budget_values(value, fraction, nbytes):
    b = parse_memory_budget(value, "--memory-budget")
    assert (b.fraction, b.nbytes, b.value) == (fraction, nbytes, value)
    assert b.bytes_for(10_000) == (int(fraction * 10_000) if fraction else nbytes)
    assert parse_memory_budget(b) is b and parse_memory_budget(None) is None


@pytest.mark.parametrize("value", ["lots", "6 parsecs", "-1", 0, "0GB"])
def test_errors_name_the_flag_or_the_parameter(value):
    with pytest.raises(FlashError, match=f"^--memory-budget {value}: "):
        memory_budget_arg(value)
    with pytest.raises(FlashError, match=r"^memory_budget=.*: (expected|must be positive)"):
        FlashConfig("hybrid", memory_budget=value)


def test_flash_config_holds_the_parsed_budget():
    cfg = FlashConfig("flash", memory_budget="6GB")
    assert cfg.memory_budget == MemoryBudget(nbytes=6 * 10**9, param="memory_budget", value="6GB")
    assert cfg.memory_budget.named() == "memory_budget='6GB'"
    given = memory_budget_arg("0.5")
    assert FlashConfig("hybrid", memory_budget=given).memory_budget is given  # parsed once
    assert FlashConfig().memory_budget is None
    with pytest.raises(FlashError, match="--mode fast: unknown mode"):
        FlashConfig("fast")
