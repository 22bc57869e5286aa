"""Purge-aware benchmarks. `python -m mlx_flash.bench SUBCOMMAND --help`.

Each subcommand lives in its own module here and exposes `add_arguments(parser)` and
`run(args) -> int`.
"""

SUBCOMMANDS = {
    "fuzz": "Property-based fuzzing of the pack / predictors / GGUF readers and the CPU kernels",
    "early_reads": "Recall / precision of a sparse layer's neurons known before its mask (pre-attention gate, lookahead, hot set)",
    "endor": "ENDOR Fig. 5 per layer: cold read + decode of dense, ENDOR and zstd bytes",
    "blas": "Float32 matmul/matvec speed of MLX's CPU backend and the BLAS it uses",
    "io": "Cold-cache read throughput of the flash loader (paper Fig. 2b)",
    "moe": "MoE expert cache hit rate vs size (with Belady), next-layer predictors, streamed runtime",
    "moe_profile": "Where an MoE decode token's time goes: attention, router, experts, combine, LM head",
    "host": "Where a decode token's time goes on the host: evals by call site, read waits, Python between",
    "kernels": "Effective weight bandwidth of the CPU kernels, and generation tokens/s",
    "reorder": "Bytes read per token at the same neurons: pack order vs co-activation order",
    "relufy_step": "Relufication training speed: tokens/s of eager vs compiled steps at several batch shapes",
    "run": "The paper's protocol: cold runs of every mode and the peers, Tables 2-3, sweeps",
}
