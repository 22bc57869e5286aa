"""mlx-flash: run language models whose weights do not fit in memory, on MLX.

    import mlx_flash
    model, tokenizer = mlx_flash.load()            # embedded SmolLM2-135M-Instruct
    print(mlx_flash.generate(model, tokenizer, "Hello", max_tokens=32))
"""

from .api import FlashConfig, generate, load, stream_generate
from .errors import FlashError

__all__ = ["FlashConfig", "FlashError", "generate", "load", "stream_generate"]
__version__ = "0.1.0"
