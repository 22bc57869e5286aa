import argparse
import importlib
import shlex
import sys

from ..cli import run_cli
from . import SUBCOMMANDS


def _main(argv):
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m mlx_flash.bench",
                                     description="Purge-aware benchmarks of mlx-flash.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    command = parser.parse_known_args(argv[:1])[0].command  # import only the module asked for
    module = importlib.import_module(f"mlx_flash.bench.{command}")
    sub_parser = argparse.ArgumentParser(prog=f"python -m mlx_flash.bench {command}",
                                         description=SUBCOMMANDS[command])
    module.add_arguments(sub_parser)
    args = sub_parser.parse_args(argv[1:])
    args.command_line = "python -m mlx_flash.bench " + shlex.join(argv)  # for reports: how to reproduce
    return module.run(args) or 0


def main(argv=None):
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
