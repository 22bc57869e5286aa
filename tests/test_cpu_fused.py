"""mlx_flash.cpu.fused: whole decoder blocks on the fused kernels vs MLX's own ops (tolerances: cpu_checks.py)."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from cpu_checks import TINY_LLAMA_VARIANTS, _f32, _quantized, _x, needs_ext
from cpu_checks import _cpu_and_enabled  # noqa: F401  (pytest fixture)

from mlx_flash.cpu import fused, ops
from mlx_flash.cpu.patch import patch_layers


@needs_ext
@pytest.mark.parametrize("o_format", [(4, 32), (8, 64), None], ids=["q4g32", "q8g64", "f16"])
@pytest.mark.parametrize("lq", [1, 5])
def test_fused_output_stages_equal_the_single_ops(o_format, lq):
    # attention_o_proj = attention (heads last) then the o projection with the residual, and
    # norm_swiglu with down = norm_swiglu then down with the residual: the same arithmetic in one
    # primitive, so the results are identical, not merely close.
    B, Hq, Hkv, D, cap, n_keys, dim, hidden = 2, 4, 2, 16, 24, 9, 128, 192
    q = _x((B, Hq, lq, D), mx.float16)
    k, v = _x((B, Hkv, cap, D), mx.float16, seed=2), _x((B, Hkv, cap, D), mx.float16, seed=3)
    x = _x((B, lq, dim), mx.float16, seed=4)

    def weights(n, kk, seed):
        if o_format is None:
            return (_x((n, kk), mx.float16, seed=seed), None, None, None), 64, None
        bits, group = o_format
        wq, s, b, _, _ = _quantized(n, kk, bits, group, mx.float16, seed=seed)
        return (wq, s, b, None), group, bits

    def single(y, proj, add):
        (w, s, b, _), group, bits = proj
        if bits is None:
            return ops._ext.half_matvec(y, w, add=add)
        return ops._ext.quantized_matvec(y, w, s, b, group, bits, add=add)

    o = weights(dim, Hq * D, 5)
    fused = ops._ext.attention_o_proj(q, k, v, 0.25, lq > 1, n_keys, *o, x)
    ref = single(ops._ext.attention(q, k, v, 0.25, lq > 1, heads_last=True, n_keys=n_keys), o, x)
    assert fused.dtype == ref.dtype and np.array_equal(_f32(fused), _f32(ref))

    norm = _x((dim,), mx.float16, seed=6)
    gate, up, down = weights(hidden, dim, 7), weights(hidden, dim, 8), weights(dim, hidden, 9)
    if o_format is not None:  # gate / up in one format; down may differ (here: float16)
        down = (_x((dim, hidden), mx.float16, seed=9), None, None, None), 64, None
    g = ops._ext.norm_swiglu(x, norm, 1e-5, gate[0], up[0], gate[1], gate[2])
    fused = ops._ext.norm_swiglu(x, norm, 1e-5, gate[0], up[0], gate[1], gate[2], down=down[0],
                                 down_group_size=down[1], down_bits=down[2])
    ref = single(g, down, x)
    assert fused.dtype == ref.dtype and np.array_equal(_f32(fused), _f32(ref))
    with pytest.raises(ValueError, match="residual must have shape"):
        ops._ext.attention_o_proj(q, k, v, 0.25, False, n_keys, *o, x[:, :, :8])
    with pytest.raises(ValueError, match="down must have 128 rows"):
        short = weights(8, hidden, 9)
        ops._ext.norm_swiglu(x, norm, 1e-5, gate[0], up[0], gate[1], gate[2], down=short[0],
                             down_group_size=short[1], down_bits=short[2])


def _assert_decode_matches_mlx(model, prompt, steps, tol):
    """The patched model's logits for a prompt then one token per step through mlx-lm's KV cache
    equal MLX's own ops on the same model (kernels switched off) within tol (relative to max |logit|)."""
    from mlx_lm.models.cache import make_prompt_cache

    def run():
        cache = make_prompt_cache(model)
        outs = [model(mx.array([prompt]), cache=cache)]
        outs += [model(mx.array([[t]]), cache=cache) for t in steps]
        mx.eval(outs)
        return [_f32(o) for o in outs]

    fused = run()
    ops.set_kernels_enabled(False)
    reference = run()
    ops.set_kernels_enabled(True)
    for a, r in zip(fused, reference):
        assert np.max(np.abs(a - r)) <= tol * max(1.0, np.max(np.abs(r))), np.max(np.abs(a - r))


@needs_ext
@TINY_LLAMA_VARIANTS
def test_fused_blocks_with_kv_cache_match_mlx(tiny_llama, variant):
    # A prompt then decode steps through mlx-lm's KV cache: the fused blocks (norm+qkv+rope,
    # attention, o_proj+residual, norm+swiglu, down+residual) against MLX's own ops on the same model.
    from mlx_lm.utils import load_model

    from mlx_flash.cpu.patch import FusedBlock

    model, _ = load_model(tiny_llama("m", **variant))
    patch_layers(model)
    assert all(isinstance(layer, FusedBlock) for layer in model.model.layers)
    tol = {None: 1e-4}.get(variant.get("dtype"), 2e-2)  # half models round activations to 2^-8..2^-11
    _assert_decode_matches_mlx(model, [1, 5, 9, 2, 7, 3, 11], [4, 8, 6, 10], tol)


def _buffer_address(a):
    view = np.array(a, copy=False)  # MLX arrays export their buffer: no copy
    return view.__array_interface__["data"][0]


@needs_ext
def test_fused_blocks_write_kv_cache_in_place_and_grow(tiny_llama):
    # Decode steps write k and v into mlx-lm's KVCache buffers inside the fused primitive (no
    # slice_update / slice ops): in place while the buffer has room, through mlx-lm's own
    # update_and_fetch when it must grow (step 4 here: the prompt fills 7 of 8 rows). Logits equal
    # MLX's ops step by step, in the pipelined order of mlx-lm's generate (next step's graph
    # evaluated asynchronously while the current one runs).
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    model, _ = load_model(tiny_llama("m", quantize=(4, 32)))
    prompt, steps = [1, 5, 9, 2, 7, 3, 11], [4, 8, 6, 10, 12, 2]

    def run(record):
        cache = make_prompt_cache(model)
        for c in cache:
            c.step = 4
        grows = []
        for c in cache:  # count mlx-lm's own update_and_fetch calls
            c.update_and_fetch = (lambda f: lambda k, v: (grows.append(1), f(k, v))[1])(c.update_and_fetch)
        outs = [model(mx.array([prompt]), cache=cache)]
        mx.eval(outs)
        addresses = [_buffer_address(cache[0].keys)] if record else []
        for t in steps:
            outs.append(model(mx.array([[t]]), cache=cache))
            mx.async_eval(outs[-1])
            if record:
                mx.eval(outs[-1])
                addresses.append(_buffer_address(cache[0].keys))
        mx.eval(outs)
        return [_f32(o) for o in outs], len(grows), addresses, cache[0].offset

    patch_layers(model)
    fused, grows, addresses, offset = run(record=True)
    assert offset == len(prompt) + len(steps)
    # 2 layers: the prompt (7 rows into 8), then growth at offsets 8 and 12; the rest in place
    assert grows == 2 * 3
    a = addresses  # after the prompt, then after each step (offsets 8, 9, .., 13)
    assert a[0] == a[1] != a[2] == a[3] == a[4] == a[5] != a[6]
    ops.set_kernels_enabled(False)
    reference, _, _, _ = run(record=False)
    ops.set_kernels_enabled(True)
    for a, r in zip(fused, reference):
        assert np.max(np.abs(a - r)) <= 2e-2 * max(1.0, np.max(np.abs(r))), np.max(np.abs(a - r))


@needs_ext
def test_fused_blocks_never_write_into_a_cache_buffer_someone_holds(tiny_llama):
    # A cache buffer that another array refers to (a saved prompt cache, cache.state) is not
    # donated: the step writes into a copy, the held array keeps its values.
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    model, _ = load_model(tiny_llama("m", quantize=(4, 32)))
    patch_layers(model)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[1, 5, 9]]), cache=cache))
    held_keys, held_values, _ = cache[0].state
    before = _f32(held_keys), _f32(held_values)
    mx.eval(model(mx.array([[4]]), cache=cache))
    assert cache[0].keys is not held_keys and _buffer_address(cache[0].keys) != _buffer_address(held_keys)
    assert np.array_equal(_f32(held_keys), before[0]) and np.array_equal(_f32(held_values), before[1])
    assert not np.array_equal(_f32(cache[0].keys), before[0])  # the copy got row 3
    # a cache buffer without room for offset + L rows is refused (the caller grows it first)
    block = model.model.layers[0]
    a, x = block.self_attn, mx.zeros((1, 2, 64))
    plan = fused._block_plan(block, dense_mlp=True)
    full = mx.zeros((1, a.n_kv_heads, 8, 64 // a.n_heads), fused._promote(x.dtype, *plan.k_dtypes))
    with pytest.raises(ValueError, match="S >= offset \\+ L = 9"):
        ops._ext.norm_qkv_rope(x, *plan.qkv, 7, None, k_cache=full, v_cache=full)


@needs_ext
@pytest.mark.parametrize("quantize", [None, (4, 32)], ids=["f16", "q4g32"])
def test_fused_qwen2_blocks_with_qkv_biases_match_mlx(quantize):
    # qwen2: llama's block with q/k/v biases (FlashQKV adds them after rounding the projections).
    from mlx_lm.models import qwen2

    from mlx_flash.cpu.patch import FusedBlock

    mx.random.seed(3)
    args = qwen2.ModelArgs(model_type="qwen2", hidden_size=64, num_hidden_layers=2, intermediate_size=96,
                           num_attention_heads=4, rms_norm_eps=1e-6, vocab_size=128, num_key_value_heads=2)
    model = qwen2.Model(args)
    model.set_dtype(mx.float16)
    if quantize:
        nn.quantize(model, group_size=quantize[1], bits=quantize[0])
    attn = model.model.layers[0].self_attn
    assert "bias" in attn.q_proj and np.abs(_f32(attn.k_proj.bias)).max() > 0
    patch_layers(model)
    assert all(isinstance(layer, FusedBlock) for layer in model.model.layers)

    _assert_decode_matches_mlx(model, [1, 5, 9, 2, 7], [4, 8, 6], 2e-2)  # float16 activations: 2^-11


@needs_ext
def test_fused_block_plan_follows_replaced_weights(tiny_llama):
    # fused.fused_block reads a block's arrays once; weights loaded later (load_weights, update) and
    # a replaced module must be seen on the next call.
    from mlx_lm.utils import load_model

    model, _ = load_model(tiny_llama("a", quantize=(4, 32)))
    other, _ = load_model(tiny_llama("b", quantize=(4, 32), seed=1))
    patch_layers(model)
    tokens = mx.array([[1, 5, 9, 2]])
    before = _f32(model(tokens))
    model.load_weights(list(tree_flatten(other.parameters())))
    after = _f32(model(tokens))
    block = model.model.layers[1]
    block.mlp.down_proj = other.model.layers[0].mlp.down_proj  # an unpatched module: read as it is
    replaced = _f32(model(tokens))
    ops.set_kernels_enabled(False)
    reference = _f32(model(tokens))
    block.mlp.down_proj = other.model.layers[1].mlp.down_proj
    reference_after = _f32(model(tokens))
    ops.set_kernels_enabled(True)
    assert np.max(np.abs(after - before)) > 0.1
    for a, r in ((replaced, reference), (after, reference_after)):
        assert np.max(np.abs(a - r)) <= 2e-2 * max(1.0, np.max(np.abs(r))), np.max(np.abs(a - r))


def test_projection_memo_follows_replaced_weights():
    # fused.projection remembers what it read from a layer; new arrays (load_weights, update) must be seen.
    layer = nn.QuantizedLinear(64, 16, group_size=32, bits=4)
    first = fused.projection(layer)
    assert fused.projection(layer) is first
    new = nn.QuantizedLinear(64, 16, group_size=32, bits=4)
    layer.update(new.parameters())
    second = fused.projection(layer)
    assert second is not first and second[0][0] is new.weight and second[0][1] is new.scales
    assert "_flash_projection" not in layer.parameters()  # the memo is not a parameter
