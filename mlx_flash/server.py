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

import gc
import logging
import sys

from .cli import run_cli
from .config import FlashConfig
from .mlx_lm_cli import build_parser, run_wrapped

PROG = "python -m mlx_flash.server"


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
            if getattr(model, "flash_auto_note", None):
                logging.info("mlx_flash: %s", model.flash_auto_note)
            if getattr(model, "flash_stats", None) is not None:
                logging.info("mlx_flash: %s", model.flash_stats.plan.describe())
            self.model_key = (model_path, adapter_path, draft_model_path)
            self.model, self.tokenizer = model, tokenizer
            self.processor = self.draft_model = None
            self.is_batchable = False  # one sequence at a time: the runtime's caches follow one

    return FlashModelProvider


def _main(argv):
    parser = build_parser(PROG, "An OpenAI-compatible HTTP server (mlx-lm's) over models mlx-flash loads. Flags "
                                "not listed here are mlx_lm.server's (--help lists both).")

    def install(server, config):
        server.ModelProvider = provider_class(server.ModelProvider, config)

    return run_wrapped(parser, "mlx_lm.server", argv, ("--adapter-path", "--draft-model"),
                       "not supported by mlx_flash.server (serve the model with mlx_lm.server)", install)


def main(argv=None):
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
