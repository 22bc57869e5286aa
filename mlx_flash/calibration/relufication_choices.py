"""The relufication recipe's named choices and defaults, one definition for the library
(relufication.py) and the relufy CLI's parser; no MLX import, so `python -m mlx_flash.relufy --help`
and its argument checks start without loading MLX."""

DECAYS = ("cosine", "constant")           # learning-rate schedule after the warm-up
ALLOCATIONS = ("uniform", "sensitivity")  # per-layer sparsity targets: all equal, or by measured cost
KEEP_CHECKPOINTS = 3                      # newest step checkpoints kept (~1.6 GB each for 135M float32)
