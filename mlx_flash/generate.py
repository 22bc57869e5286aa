"""python -m mlx_flash.generate: stream text from a model (flags mirror mlx_lm.generate)."""

import argparse
import math
import os
import sys

from .cli import run_cli
from .config import add_flash_arguments, flash_config
from .errors import FlashError

DEFAULT_PROMPT = "hello"
DEFAULT_MAX_TOKENS = 100


def build_parser():
    parser = argparse.ArgumentParser(
        prog="python -m mlx_flash.generate",
        description="Generate text with mlx-flash. Without --model, uses the embedded SmolLM2-135M-Instruct.",
    )
    parser.add_argument("--model", default=None,
                        help="a model folder (mlx-lm / Hugging Face), a .gguf file, or a hub repo id "
                             "(default: the embedded SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--prompt", "-p", default=DEFAULT_PROMPT, help="the prompt; '-' reads stdin")
    parser.add_argument("--system-prompt", default=None, help="system message for the chat template")
    parser.add_argument("--max-tokens", "-m", type=int, default=DEFAULT_MAX_TOKENS,
                        help="maximum number of tokens to generate")
    parser.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling top-p")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: off)")
    parser.add_argument("--min-p", type=float, default=0.0,
                        help="drop tokens less likely than min-p times the most likely one (0: off)")
    parser.add_argument("--seed", type=int, default=None, help="PRNG seed")
    parser.add_argument("--ignore-chat-template", action="store_true",
                        help="use the raw prompt without the tokenizer's chat template")
    flash = parser.add_argument_group("flash packs (python -m mlx_flash.convert --out PACK)")
    add_flash_arguments(flash)
    flash.add_argument("--stats", action="store_true",
                       help="print per-token I/O / memory / compute ms, bytes read, hit rate, peak memory")
    parser.add_argument("--q8-activations", action="store_true",
                        help="CPU kernels: round activations to int8 per 32 values (as llama.cpp does) for "
                             "integer dot products in quantized layers; faster, not bit-exact vs MLX")
    parser.add_argument("--no-kernels", action="store_true",
                        help="MLX's own ops instead of the CPU kernels (as MLX_FLASH_KERNELS=0): "
                             "slower on CPU, bit-identical to mlx-lm (MoE experts included)")
    parser.add_argument("--verbose", action="store_true",
                        help="show tracebacks on errors; for a flash pack, print the read-cost profile "
                             "that prices its reads (when it was measured, and the machine's load then)")
    return parser


def _check_args(args):
    if args.max_tokens == 0 or args.max_tokens < -1:
        raise FlashError(f"--max-tokens {args.max_tokens}: must be positive (or -1 for no limit)")
    if not (math.isfinite(args.temp) and args.temp >= 0):
        raise FlashError(f"--temp {args.temp}: must be a finite number >= 0")
    if not 0 < args.top_p <= 1:
        raise FlashError(f"--top-p {args.top_p}: must be in (0, 1]")
    if args.top_k < 0:
        raise FlashError(f"--top-k {args.top_k}: must be >= 0 (0: off)")
    if not 0 <= args.min_p <= 1:
        raise FlashError(f"--min-p {args.min_p}: must be in [0, 1]")
    if args.seed is not None and not 0 <= args.seed < 2 ** 63:
        raise FlashError(f"--seed {args.seed}: must be in 0..2^63-1")
    if args.q8_activations and args.no_kernels:
        raise FlashError("--q8-activations: rounds activations in the CPU kernels; --no-kernels "
                         "turns them off")


def read_prompt(prompt: str) -> str:
    """The --prompt value; '-' reads stdin, which must be UTF-8 text."""
    from .errors import FlashError

    if prompt != "-":
        return prompt
    raw = sys.stdin.buffer.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FlashError(f"--prompt -: stdin is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset "
                         f"{e.start})") from None


def flash_loader(model):
    """The FlashLoader a flash pack's model reads with (dense FFN runtime or MoE expert store), or
    None for a model loaded whole."""
    owner = getattr(model, "flash_runtime", None) or getattr(model, "moe_store", None)
    return getattr(owner, "loader", None)


def _main(argv):
    args = build_parser().parse_args(argv)
    _check_args(args)
    # Our own checks report over-long prompts; transformers' tokenizer warning would only repeat it.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    # MLX and mlx-lm take seconds to import: `--help` and flag errors come first
    import mlx.core as mx

    from .api import check_prompt_fits, encode_prompt, load, stream_generate

    if args.seed is not None:
        mx.random.seed(args.seed)
    from .cpu import ops  # heavy, as above

    if args.no_kernels:
        ops.set_kernels_enabled(False)
    if args.q8_activations:
        ops.set_q8_activations(True)
    prompt = read_prompt(args.prompt)
    model, tokenizer = load(args.model, flash_config(args))
    if getattr(model, "flash_auto_note", None):
        print(model.flash_auto_note, file=sys.stderr)
    stats = getattr(model, "flash_stats", None)
    if args.verbose and (loader := flash_loader(model)) is not None:
        from .io.planner import profile_file
        from .io.read_cost import describe_profile

        print(describe_profile(loader.cost, profile_file()), file=sys.stderr)
    tokens = encode_prompt(tokenizer, prompt, args.system_prompt, not args.ignore_chat_template)
    check_prompt_fits(model, len(tokens), args.max_tokens)
    print("==========", flush=True)
    response = None
    if stats is not None:
        stats.reset()
    for response in stream_generate(model, tokenizer, tokens, args.max_tokens, temp=args.temp, top_p=args.top_p,
                                    top_k=args.top_k, min_p=args.min_p):
        print(response.text, end="", flush=True)
    print()
    print("==========")
    if response is not None:
        print(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec")
        print(f"Generation: {response.generation_tokens} tokens, {response.generation_tps:.3f} tokens-per-sec")
        print(f"Peak memory: {response.peak_memory:.3f} GB")
    if args.stats:
        if stats is None:
            print("Flash stats: none (not a flash pack; convert one with python -m mlx_flash.convert)")
        else:
            stats.finish()
            print(stats.format())
    return 0


def main(argv=None):
    return run_cli(_main, argv)


class _CallableModule(type(sys)):
    """`mlx_flash.generate` is the API function and this CLI module's name: importing the module
    (`from mlx_flash.generate import main`) rebinds the package attribute to it, so the module
    forwards calls to the function and `mlx_flash.generate(model, tokenizer, prompt)` still works."""

    def __call__(self, *args, **kwargs):
        from .api import generate

        return generate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
