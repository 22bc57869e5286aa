"""MoE experts streamed from flash (EdgeMoE): expert cache + eviction, store, streamed SwitchGLU,
routing traces, prediction + preload.

    cache.py    ExpertCache (slot assignment; LRU, LFU, layer-aware, Belady) and `simulate`
    store.py    ExpertStore: a pack's expert blocks read into a preallocated MLX slot bank
    switch.py   StreamedSwitchGLU: mlx-lm's SwitchGLU call over the slot bank (bit-identical)
"""
