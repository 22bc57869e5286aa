"""python -m mlx_flash.chat: a chat in the terminal with a model mlx-flash loads, flash packs
included. It is mlx-lm's chat (`mlx_lm.chat`: its prompt, its commands q / r / h, its flags, one
KV cache kept across turns) with mlx-flash loading the model:

  python -m mlx_flash.chat                                   # the embedded SmolLM2-135M-Instruct
  python -m mlx_flash.chat --model PACK --memory-budget 0.65 --max-tokens 256

mlx-flash's flags are generate's: --model (default: the embedded model), --mode (default auto),
--memory-budget, --window, --threads; every other flag goes to mlx_lm.chat (--temp, --top-p,
--seed, --max-tokens, --system-prompt, ...). Adapters are refused.
"""

import sys

from .cli import run_cli
from .config import FlashConfig
from .mlx_lm_cli import build_parser, run_wrapped

PROG = "python -m mlx_flash.chat"


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
    parser = build_parser(PROG, "Chat with a model mlx-flash loads (mlx-lm's chat). Flags not listed here are "
                                "mlx_lm.chat's (--help lists both).")

    def install(chat, config):
        chat.load = flash_load(config)

    return run_wrapped(parser, "mlx_lm.chat", argv, ("--adapter-path", "--pipeline"),
                       "not supported by mlx_flash.chat (chat with mlx_lm.chat)", install)


def main(argv=None):
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
