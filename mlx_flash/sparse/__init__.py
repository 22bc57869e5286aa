"""Dense-model path of "LLM in a flash": neuron caches, the swapped-in FFN module, memory budget.

    neuron_cache.NeuronCache   per-layer preallocated rows, pointers, num_used, last-k-active
    ffn.FlashFFN               the FFN module per mode (resident / streamed / sparse rows)
    budget.plan_memory         how a --memory-budget is spent, and the minimum resident set
    stats.FlashStats           per-token I/O / memory-management / compute split (model.flash_stats)
    predictor                  activation predictors (python -m mlx_flash.calibrate)
"""
