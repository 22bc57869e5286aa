"""FlashConfig: how a model runs (mode, memory budget, window, I/O threads)."""

from dataclasses import dataclass

from .errors import FlashError

MODES = ("dense",)


@dataclass
class FlashConfig:
    """How a model runs. `mode`: "dense" keeps every weight resident (the reference)."""

    mode: str = "dense"

    def __post_init__(self):
        if self.mode not in MODES:
            raise FlashError(f"--mode {self.mode}: unknown mode (choose from {', '.join(MODES)})")
