"""FlashConfig: how a model runs (mode, memory budget parsed once into a MemoryBudget, window, I/O threads)."""

import re
from dataclasses import dataclass

from .errors import FlashError

MODES = ("dense", "naive", "hybrid", "flash")
AUTO_MODE = "auto"  # the default: one of MODES chosen at load time (models/auto.py)
MODE_HELP = {
    AUTO_MODE: "dense when every weight fits the budget (default: 80% of the available memory), "
               "else flash (a calibrated or MoE pack) or hybrid within it",
    "dense": "every weight resident (the reference)",
    "naive": "every layer's FFN reloaded from flash for every token",
    "hybrid": "as many whole-layer FFNs resident as the budget allows, the rest reloaded per token",
    "flash": "predictor + sliding-window neuron cache + bundled reads (LLM in a flash)",
}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


@dataclass(frozen=True)
class MemoryBudget:
    """A weights budget, parsed once where the user gave it: `fraction` of the pack's bytes
    (0 < f <= 1) or `nbytes` bytes. `param` names what the caller used (`--memory-budget` on the
    command line, `memory_budget=` in Python) so every later error names the same thing."""
    fraction: float | None = None
    nbytes: int | None = None
    param: str = "--memory-budget"
    value: object = None  # as the caller gave it (reports and JSON show this)

    def bytes_for(self, pack_bytes: int) -> int:
        """Bytes this budget allows for a pack of `pack_bytes` bytes."""
        return int(self.fraction * pack_bytes) if self.fraction is not None else self.nbytes

    def named(self, shown=None) -> str:
        """`--memory-budget 0.5` / `memory_budget=0.5` (with `shown` instead of the value if given)."""
        return param_named(self.param, self.value if shown is None else shown)

    def __str__(self):
        return str(self.value)


def param_named(param: str, value) -> str:
    """How errors show a value: `--memory-budget 0.5` for a flag, `memory_budget=0.5` for a parameter."""
    return f"{param} {value}" if param.startswith("--") else f"{param}={value!r}"


def parse_memory_budget(value, param: str = "memory_budget") -> MemoryBudget | None:
    """A memory budget value -> MemoryBudget (None for None); FlashError naming `param`.

    Accepts a float/int or a string: "0.5" (fraction of the pack size), "6GB", "700MiB", "123456".
    Numbers above 1 without a unit are bytes. A MemoryBudget is returned as is.
    """
    if value is None or isinstance(value, MemoryBudget):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number, unit = float(value), ""
    else:
        m = _SIZE.match(str(value))
        if not m or m.group(2).upper() not in _UNITS:
            raise FlashError(f"{param_named(param, value)}: expected a fraction of the pack (0.65) "
                             f"or a size (6GB, 700MiB)")
        number, unit = float(m.group(1)), m.group(2).upper()
    if number <= 0:
        raise FlashError(f"{param_named(param, value)}: must be positive")
    if unit == "" and number <= 1:
        return MemoryBudget(fraction=number, param=param, value=value)
    return MemoryBudget(nbytes=int(number * _UNITS[unit]), param=param, value=value)


def memory_budget_arg(value) -> MemoryBudget:
    """argparse `type=` for --memory-budget: parsed at the edge, errors name the flag."""
    return parse_memory_budget(value, "--memory-budget")


def add_flash_arguments(parser) -> None:
    """The FlashConfig flags of the CLIs that load a model (generate, chat, server): --mode,
    --memory-budget, --window, --threads; `parser` may be an argument group."""
    parser.add_argument("--mode", choices=(AUTO_MODE, *MODES), default=AUTO_MODE,
                        help="how FFN weights are held: " + "; ".join(f"{m} = {h}" for m, h in MODE_HELP.items())
                        .replace("%", "%%"))
    parser.add_argument("--memory-budget", default=None, type=memory_budget_arg,
                        help="memory for weights: a fraction of the pack (0.65) or a size (6GB, 700MiB); "
                             "default: no limit (--mode auto: 80%% of the available memory)")
    parser.add_argument("--window", type=int, default=5,
                        help="flash: tokens whose active neurons stay cached (default 5)")
    parser.add_argument("--threads", type=int, default=32, help="parallel flash reads (default 32)")


def flash_config(args) -> "FlashConfig":
    """The FlashConfig of add_flash_arguments' parsed flags (FlashError names a bad one)."""
    return FlashConfig(mode=args.mode, memory_budget=args.memory_budget, window=args.window, threads=args.threads)


@dataclass
class FlashConfig:
    """How a model runs (flash packs only; plain folders always run dense).

    mode: AUTO_MODE (the default: models/auto.py picks one of MODES when the model loads) or one
      of MODES (see MODE_HELP).
    memory_budget: None (no limit), a fraction of the pack size (0.65), a size ("6GB", bytes) or a
      MemoryBudget; stored as a MemoryBudget (parsed here, once).
    window: tokens whose active neurons the flash neuron cache keeps (the paper's k); the
      runtime shrinks it when the budget would be exceeded.
    threads: parallel reads in flight (the paper uses 32).
    """

    mode: str = AUTO_MODE
    memory_budget: MemoryBudget | None = None
    window: int = 5
    threads: int = 32

    def __post_init__(self):
        if self.mode not in (AUTO_MODE, *MODES):
            raise FlashError(f"--mode {self.mode}: unknown mode (choose from {', '.join((AUTO_MODE, *MODES))})")
        self.memory_budget = parse_memory_budget(self.memory_budget, "memory_budget")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise FlashError(f"--window {self.window}: must be a whole number of tokens >= 1")
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or not 1 <= self.threads <= 256:
            raise FlashError(f"--threads {self.threads}: must be a whole number in 1..256")
