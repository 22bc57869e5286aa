"""What the CLIs wrapping an mlx-lm CLI share (server.py: mlx_lm.server, chat.py: mlx_lm.chat):
our flags parsed first (--model, --mode, --memory-budget, --window, --threads, --verbose), the
model resolved before mlx-lm starts (a bad one fails in one line), every other flag passed on to
the mlx-lm module's own main, which runs with our loader installed."""

import argparse
import importlib
import sys

from .cli import refuse_flags
from .config import add_flash_arguments, flash_config


def build_parser(prog: str, description: str):
    parser = argparse.ArgumentParser(prog=prog, add_help=False, description=description)
    parser.add_argument("--model", default=None,
                        help="a model folder, a .gguf file, a flash pack or a hub repo id "
                             "(default: the embedded SmolLM2-135M-Instruct Q4_1)")
    add_flash_arguments(parser.add_argument_group("flash packs (python -m mlx_flash.convert --out PACK)"))
    parser.add_argument("--verbose", action="store_true", help="show tracebacks on errors")
    return parser


def run_wrapped(parser, module: str, argv, refused, why: str, install) -> int:
    """Parse our flags of `argv` with `parser` (build_parser), refuse the `refused` flags (FlashError
    "FLAG: why"), then run `module`'s main (an mlx-lm CLI) on the rest after `install(module,
    FlashConfig)` has put our loader in it; --help prints our flags, then mlx-lm's."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args, rest = parser.parse_known_args(argv)
    helping = "-h" in rest or "--help" in rest
    if not helping:
        refuse_flags(rest, refused, why)
        config = flash_config(args)
        from .sources import resolve_model  # heavy (mlx-lm): after the flags

        rest = ["--model", str(resolve_model(args.model)), *rest]
    wrapped = importlib.import_module(module)
    if helping:
        parser.print_help()
        print(f"\n{module}'s flags:\n")
    else:
        install(wrapped, config)
    sys.argv = [parser.prog, *rest]
    wrapped.main()
    return 0
