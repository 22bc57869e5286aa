"""CPU compute: our kernels (mlx_flash._ext) behind MLX-op twins, and where models meet them.

    ops.py     matvec and layer ops: the kernel when it applies, the equal MLX ops otherwise
    fused.py   a whole llama-family decoder block in three kernel calls (block fusion)
    patch.py   patch_layers: re-class a loaded mlx-lm model's modules to run on ops / fused
"""
