"""python -m mlx_flash.server: an OpenAI-compatible HTTP server over the models mlx-flash loads,
flash packs included. It is mlx-lm's server (`mlx_lm.server`: its endpoints /v1/chat/completions,
/v1/completions, /v1/models, /health, its flags and prompt cache) with mlx-flash loading the model:

  python -m mlx_flash.server --model PACK --mode flash --memory-budget 0.65 --port 8080
  curl localhost:8080/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}'

mlx-flash's flags are generate's: --mode (default auto), --memory-budget, --window, --threads;
every other flag goes to mlx_lm.server (--host, --port, --prompt-cache-size, --chat-template,
--temp, --max-tokens, ...). Without --model it serves the embedded SmolLM2-135M-Instruct.
Requests are served one after another (no batching across requests; a flash pack's neuron caches
belong to one sequence at a time); adapters and draft models are refused.
"""

import argparse
import gc
import logging
import sys

from .cli import refuse_flags, run_cli
from .config import FlashConfig, add_flash_arguments, flash_config

UNSUPPORTED = ("--adapter-path", "--draft-model")


def build_parser():
    parser = argparse.ArgumentParser(
        prog="python -m mlx_flash.server", add_help=False,
        description="An OpenAI-compatible HTTP server (mlx-lm's) over models mlx-flash loads. "
                    "Flags not listed here are mlx_lm.server's (python -m mlx_flash.server --help lists both).")
    parser.add_argument("--model", default=None,
                        help="a model folder, a .gguf file, a flash pack or a hub repo id "
                             "(default: the embedded SmolLM2-135M-Instruct Q4_1)")
    add_flash_arguments(parser.add_argument_group("flash packs (python -m mlx_flash.convert --out PACK)"))
    parser.add_argument("--verbose", action="store_true", help="show tracebacks on errors")
    return parser


def provider_class(base, config: FlashConfig):
    """mlx-lm's ModelProvider (`base`) loading through mlx_flash.load with `config`."""

    class FlashModelProvider(base):
        def _load(self, model_path, adapter_path=None, draft_model_path=None):
            if adapter_path is not None or draft_model_path is not None:
                raise ValueError("mlx_flash.server: adapters and draft models are not supported")
            import mlx.core as mx

            from .api import load

            self.reset()  # the previous model's weights go before the next loads
            gc.collect()
            mx.clear_cache()
            model, tokenizer = load(model_path, config)
            if self.cli_args.chat_template:
                tokenizer.chat_template = self.cli_args.chat_template
            elif self.cli_args.use_default_chat_template and tokenizer.chat_template is None:
                tokenizer.chat_template = tokenizer.default_chat_template
            for line in (getattr(model, "flash_auto_note", None),
                         getattr(getattr(model, "flash_stats", None), "plan", None)):
                if line is not None:
                    logging.info("mlx_flash: %s", line if isinstance(line, str) else line.describe())
            self.model_key = (model_path, adapter_path, draft_model_path)
            self.model, self.tokenizer = model, tokenizer
            self.processor = self.draft_model = None
            self.is_batchable = False  # one sequence at a time: the runtime's caches follow one

    return FlashModelProvider


def _main(argv):
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        parser.print_help()
        print("\nmlx_lm.server's flags:\n")
    else:
        refuse_flags(rest, UNSUPPORTED, "not supported by mlx_flash.server (serve the model with mlx_lm.server)")
        config = flash_config(args)
        from .sources import resolve_model  # heavy (mlx-lm): after the flags

        # a bad --model fails here, in one line, not in the server's generation thread
        rest = ["--model", str(resolve_model(args.model)), *rest]
    import mlx_lm.server as mlx_server

    if "-h" not in rest and "--help" not in rest:
        mlx_server.ModelProvider = provider_class(mlx_server.ModelProvider, config)
    sys.argv = ["python -m mlx_flash.server", *rest]
    mlx_server.main()
    return 0


def main(argv=None):
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
