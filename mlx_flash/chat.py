"""python -m mlx_flash.chat: a chat in the terminal with a model mlx-flash loads, flash packs
included. It is mlx-lm's chat (`mlx_lm.chat`: its prompt, its commands q / r / h, its flags, one
KV cache kept across turns) with mlx-flash loading the model:

  python -m mlx_flash.chat                                   # the embedded SmolLM2-135M-Instruct
  python -m mlx_flash.chat --model PACK --memory-budget 0.65 --max-tokens 256

mlx-flash's flags are generate's: --model (default: the embedded model), --mode (default auto),
--memory-budget, --window, --threads; every other flag goes to mlx_lm.chat (--temp, --top-p,
--seed, --max-kv-size, --max-tokens, --system-prompt, ...). Adapters are refused.
"""

import argparse
import sys

from .cli import refuse_flags, run_cli
from .config import FlashConfig, add_flash_arguments, flash_config

UNSUPPORTED = ("--adapter-path", "--pipeline")


def build_parser():
    parser = argparse.ArgumentParser(
        prog="python -m mlx_flash.chat", add_help=False,
        description="Chat with a model mlx-flash loads (mlx-lm's chat). Flags not listed here are "
                    "mlx_lm.chat's (python -m mlx_flash.chat --help lists both).")
    parser.add_argument("--model", default=None,
                        help="a model folder, a .gguf file, a flash pack or a hub repo id "
                             "(default: the embedded SmolLM2-135M-Instruct Q4_1)")
    add_flash_arguments(parser.add_argument_group("flash packs (python -m mlx_flash.convert --out PACK)"))
    parser.add_argument("--verbose", action="store_true", help="show tracebacks on errors")
    return parser


def flash_load(config: FlashConfig):
    """mlx_lm.chat's `load(path, ...)`, through mlx_flash.load with `config`; the choice of
    --mode auto, if any, on stderr."""

    def load(path, **_):
        from .api import load as flash

        model, tokenizer = flash(path, config)
        if getattr(model, "flash_auto_note", None):
            print(model.flash_auto_note, file=sys.stderr)
        return model, tokenizer

    return load


def _main(argv):
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    import mlx_lm.chat as mlx_chat

    if "-h" in rest or "--help" in rest:
        parser.print_help()
        print("\nmlx_lm.chat's flags:\n")
    else:
        refuse_flags(rest, UNSUPPORTED, "not supported by mlx_flash.chat (chat with mlx_lm.chat)")
        config = flash_config(args)
        from .sources import resolve_model  # a bad --model fails here, in one line

        rest = ["--model", str(resolve_model(args.model)), *rest]
        mlx_chat.load = flash_load(config)
    sys.argv = ["python -m mlx_flash.chat", *rest]
    mlx_chat.main()
    return 0


def main(argv=None):
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
