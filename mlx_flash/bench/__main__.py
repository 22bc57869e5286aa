import argparse
import importlib
import sys

from ..cli import run_cli
from . import SUBCOMMANDS


def _main(argv):
    parser = argparse.ArgumentParser(prog="python -m mlx_flash.bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in SUBCOMMANDS.items():
        module = importlib.import_module(f"mlx_flash.bench.{name}")
        module.add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    args = parser.parse_args(argv)
    module = importlib.import_module(f"mlx_flash.bench.{args.command}")
    return module.run(args) or 0


def main(argv=None):
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
