"""calibration/expert_tune.py: experts' scales/biases tuned end to end against the float model."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import write_tiny_moe

from mlx_flash.calibration.expert_bits import experts_at_widths, measure_errors
from mlx_flash.calibration.expert_tune import (dense_experts, quantize_resident,
                                               tune_expert_scales, tune_keeping_best,
                                               validation_windows, windows_perplexity)
from mlx_flash.cpu.patch import patch_layers
from mlx_flash.errors import FlashError
from mlx_flash.models import load_model
from mlx_flash.moe.bitwidths import assign_widths


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    src = write_tiny_moe(tmp_path_factory.mktemp("tune") / "src", "mixtral", experts=6, layers=2)
    out = []
    for _ in range(2):
        model, _ = load_model(src, lazy=False)
        for layer in model.layers:  # experts that move the logits (the random ones barely do)
            up = layer.block_sparse_moe.switch_mlp.up_proj
            up.weight = up.weight * 20
        model.lm_head.weight = model.lm_head.weight * 30  # a peaked next-token distribution
        out.append(model)
    return out


def _kl(teacher, student, tokens):
    x = mx.array(tokens)[None]
    t = nn.log_softmax(teacher(x), axis=-1)
    s = nn.log_softmax(student(x), axis=-1)
    return float(mx.mean(mx.sum(mx.exp(t) * (t - s), axis=-1)))


def test_dense_experts_give_the_switch_glu_outputs(models):
    teacher, _ = models
    x = mx.array(np.random.default_rng(0).integers(0, 128, 80).astype(np.int32))[None]
    want = teacher(x)
    with dense_experts(teacher):
        got = teacher(x)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=0,
                               atol=1e-5 * float(mx.abs(want).max()))
    assert type(teacher.layers[0].block_sparse_moe.switch_mlp).__name__ == "SwitchGLU"


def test_tuning_lowers_the_kl_keeps_the_integers_and_restores_the_student(models):
    teacher, student = models
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 128, 600).astype(np.int32)
    quantized = {}
    errors = measure_errors(teacher, tokens[:300], 32, (2, 3, 4), progress=False,
                            method="gptq-fit", quantized=quantized)
    bits = assign_widths(errors, 2.5, widths=(2, 3, 4))
    quantize_resident(student, 4, 32)
    patch_layers(student)  # the kernels' attention (no vjp) where they run: tuning turns them off
    before_w = student.layers[0].block_sparse_moe.switch_mlp.up_proj.weight
    held = tokens[300:]
    with experts_at_widths(student, bits, 32, quantized):
        kl_before = _kl(teacher, student, held)
    out = tune_expert_scales(student, teacher, quantized, bits, tokens[:300], steps=25,
                             group_size=32, lr=2e-2, seq_len=64, progress=False)
    assert student.layers[0].block_sparse_moe.switch_mlp.up_proj.weight is before_w
    with experts_at_widths(student, bits, 32, out["quantized"]):
        kl_after = _kl(teacher, student, held)
    assert kl_after < 0.8 * kl_before, (kl_before, kl_after)
    for key, stacks in quantized.items():
        layer, b = key
        rows = [e for e, w in enumerate(bits[layer]) if w == b]
        others = [e for e in range(6) if e not in rows]
        for role, (packed, s, bias) in stacks.items():
            new = out["quantized"][key][role]
            assert new[0] is packed  # the integers never move
            assert np.array_equal(np.array(new[1])[others], np.array(s)[others])
            if rows:
                assert not np.array_equal(np.array(new[1])[rows], np.array(s)[rows])
    with pytest.raises(FlashError, match="--expert-tune: needs more than 64"):
        tune_expert_scales(student, teacher, quantized, bits, tokens[:50], steps=1,
                           group_size=32, seq_len=64, progress=False)


def _mixed_widths(models, seed):
    """(teacher, student, tokens, quantized stacks, bits): experts at 2 and 3 bits (mean 2.5)."""
    teacher, student = models
    tokens = np.random.default_rng(seed).integers(0, 128, 300).astype(np.int32)
    quantized = {}
    errors = measure_errors(teacher, tokens, 32, (2, 3), progress=False, method="gptq-fit",
                            quantized=quantized)
    quantize_resident(student, 4, 32)
    return teacher, student, tokens, quantized, assign_widths(errors, 2.5, widths=(2, 3))


def test_lr_by_width_scales_each_widths_step(models):
    teacher, student, tokens, quantized, bits = _mixed_widths(models, 2)

    def first_step(lr_by_width):
        out = tune_expert_scales(student, teacher, quantized, bits, tokens, steps=1,
                                 group_size=32, lr=1e-3, seq_len=64, progress=False,
                                 lr_by_width=lr_by_width)
        moved = {}
        for (layer, b), stacks in quantized.items():
            rows = [e for e, w in enumerate(bits[layer]) if w == b]
            s0, s1 = np.array(stacks["up"][1])[rows], np.array(out["quantized"][(layer, b)]["up"][1])[rows]
            moved.setdefault(b, []).append(np.abs(s1 / s0 - 1).ravel())
        return {b: np.median(np.concatenate(v)) for b, v in moved.items()}

    plain, weighted = first_step(None), first_step({2: 3.0})
    # Adam's first step has the same size in every parameter: the factor multiplies it
    assert weighted[2] == pytest.approx(3 * plain[2], rel=1e-3)
    assert weighted[3] == pytest.approx(plain[3], rel=1e-3)
    assert first_step({2: 0.0, 3: 0.0}) == {2: 0.0, 3: 0.0}


def test_checkpoints_are_the_shorter_runs(models):
    teacher, student, tokens, quantized, bits = _mixed_widths(models, 3)
    seen = {}

    def tune(steps, **kw):
        return tune_expert_scales(student, teacher, quantized, bits, tokens, steps=steps,
                                  group_size=32, seq_len=64, progress=False, **kw)["quantized"]

    final = tune(4, checkpoint_every=2, on_checkpoint=lambda n, q: seen.setdefault(n, q))
    assert sorted(seen) == [2, 4]
    short = tune(2)
    for key, stacks in quantized.items():
        for role in stacks:
            for got, want in ((seen[2], short), (seen[4], final)):
                assert all(mx.array_equal(a, b) for a, b in zip(got[key][role], want[key][role]))
            assert not mx.array_equal(seen[2][key][role][1], seen[4][key][role][1])


def test_validation_windows_are_spread_after_the_tuning_range():
    tokens = np.arange(1000, dtype=np.int32)
    windows = validation_windows(tokens, 300, 256, seq_len=64)
    assert len(windows) == 4 and all(len(w) == 65 for w in windows)
    assert windows[0][0] == 300 and windows[-1][-1] == 999  # from the first to the last token after 300
    with pytest.raises(FlashError, match="--expert-tune-val-tokens 1024: needs at least 1040"):
        validation_windows(tokens, 300, 1024, seq_len=64)


def test_tune_keeping_best_keeps_the_checkpoint_that_scores_best(models, tmp_path):
    teacher, student, tokens, quantized, bits = _mixed_widths(models, 4)
    judge, _ = load_model(write_tiny_moe(tmp_path / "j", "mixtral", experts=6, layers=2), lazy=False)
    judge.update(student.parameters())  # the student's weights: non-expert ones as packed
    windows = validation_windows(np.random.default_rng(5).integers(0, 128, 400).astype(np.int32),
                                 0, 256, seq_len=64)

    def keep(lr):
        return tune_keeping_best(student, teacher, judge, quantized, bits, tokens, windows, steps=5,
                                 checkpoint_every=2, group_size=32, seq_len=64, progress=False, lr=lr)

    out = keep(2e-2)
    steps, ppls = zip(*out["validation"])
    assert steps == (0, 2, 4, 5)  # before tuning, every 2 steps and the last
    assert len(set(ppls)) == 4 and out["best_steps"] == steps[int(np.argmin(ppls))]
    assert windows_perplexity(judge, out["quantized"], bits, 32, windows) == pytest.approx(min(ppls))
    still = keep(0.0)  # nothing moves: no checkpoint beats the untuned stacks, which are kept
    assert still["best_steps"] == 0 and still["quantized"] is quantized


def test_tune_keeping_best_returns_the_best_checkpoints_stacks(models, monkeypatch):
    from mlx_flash.calibration import expert_tune

    teacher, student, tokens, quantized, bits = _mixed_widths(models, 6)
    scores = iter([5.0, 3.0, 1.0, 2.0])  # steps 0, 2, 4, 5: the best is step 4, not the last
    monkeypatch.setattr(expert_tune, "windows_perplexity", lambda *a: next(scores))
    seen = []
    out = tune_keeping_best(student, teacher, student, quantized, bits, tokens, [], steps=5,
                            checkpoint_every=2, group_size=32, seq_len=64, progress=False,
                            on_score=lambda n, p: seen.append((n, p)))
    assert out["best_steps"] == 4 and out["validation"] == [(0, 5.0), (2, 3.0), (4, 1.0), (5, 2.0)]
    assert seen == out["validation"]
    four = tune_expert_scales(student, teacher, quantized, bits, tokens, steps=4, group_size=32,
                              seq_len=64, progress=False)["quantized"]
    for key, stacks in four.items():
        for role, want in stacks.items():
            assert all(mx.array_equal(a, b) for a, b in zip(out["quantized"][key][role], want))


def _integers(packed, bits):
    ones = mx.ones((*packed.shape[:-1], packed.shape[-1] * 32 // bits // 32), mx.float32)
    return np.array(mx.dequantize(packed, ones, mx.zeros_like(ones), group_size=32, bits=bits))


def test_moving_integers_are_the_weights_the_student_computed_with(models):
    """integer_lr: integers move (by at most one step in three steps this small: MLX's Adam moves a
    parameter by at most ~5 lr a step then; only the rows of each width's own experts), and a checkpoint's stacks, packed anew, are the weights the next step
    computed with: its KL from the teacher is that step's."""
    from mlx_flash.calibration.relufication import distill_kl
    from mlx_flash.cpu import ops

    teacher, student, tokens, quantized, bits = _mixed_widths(models, 7)
    seen = {}
    out = tune_expert_scales(student, teacher, quantized, bits, tokens, steps=4, group_size=32,
                             lr=1e-2, integer_lr=0.03, seq_len=64, progress=False,
                             checkpoint_every=3, on_checkpoint=lambda n, q: seen.setdefault(n, q))
    moved = 0
    for (layer, b), stacks in quantized.items():
        rows = [e for e, w in enumerate(bits[layer]) if w == b]
        others = [e for e in range(6) if e not in rows]
        for role, (packed, _, _) in stacks.items():
            q0, q3 = _integers(packed, b), _integers(seen[3][(layer, b)][role][0], b)
            assert np.array_equal(q0[others], q3[others])
            assert np.abs(q3 - q0).max() <= 1 and q3.min() >= 0 and q3.max() <= 2 ** b - 1
            moved += int((q3 != q0).sum())
    assert moved > 0
    rng = np.random.default_rng(0)  # the windows tune_expert_scales drew (seed 0)
    start = [int(rng.integers(0, len(tokens) - 64)) for _ in range(4)][3]
    x = mx.array(tokens[start: start + 64])[None]
    kernels = ops.kernels_active()
    ops.set_kernels_enabled(False)
    try:
        with experts_at_widths(student, bits, 32, seen[3]), dense_experts(student), dense_experts(teacher):
            kl = float(distill_kl(student(x).astype(mx.float32), teacher(x).astype(mx.float32)))
    finally:
        ops.set_kernels_enabled(kernels)
    assert kl == pytest.approx(out["kl"][3], rel=1e-4)
    assert kl != pytest.approx(out["kl"][2], rel=1e-4)
    # the offsets have an Adam of their own: integers move with the scales held (lr 0)
    held = tune_expert_scales(student, teacher, quantized, bits, tokens, steps=3, group_size=32,
                              lr=0.0, integer_lr=0.03, seq_len=64, progress=False)["quantized"]
    for (layer, b), stacks in quantized.items():
        for role, (packed, s, bias) in stacks.items():
            new = held[(layer, b)][role]
            assert np.array_equal(np.array(new[1]), np.array(s))
            assert np.array_equal(np.array(new[2]), np.array(bias))
    assert any(not np.array_equal(np.array(held[key][role][0]), np.array(stacks[role][0]))
               for key, stacks in quantized.items() for role in stacks)
    with pytest.raises(FlashError, match="--expert-tune-int-lr -1: must be >= 0"):
        tune_expert_scales(student, teacher, quantized, bits, tokens, steps=1, group_size=32,
                           integer_lr=-1.0, seq_len=64, progress=False)
