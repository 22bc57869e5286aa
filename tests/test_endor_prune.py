"""Pruning rule (mlx_flash/endor/prune.py): per-row scores, which linears, argument checks."""

import numpy as np
import pytest

from mlx_flash.calibration.prune import load_float_model
from mlx_flash.endor import prune as pr
from mlx_flash.errors import FlashError


def test_prune_weight_drops_lowest_scores_per_row():
    w = np.array([[1.0, -2.0, 3.0, -4.0], [0.5, 0.1, -0.2, 9.0]], np.float32)
    np.testing.assert_array_equal(pr.prune_weight(w, 0.5), [[0, 0, 3, -4], [0.5, 0, 0, 9]])
    norms = np.array([10.0, 1.0, 1.0, 0.1], np.float32)  # |w| * norm: [10, 2, 3, .4], [5, .1, .2, .9]
    np.testing.assert_array_equal(pr.prune_weight(w, 0.5, norms), [[1, 0, 3, 0], [0.5, 0, 0, 9]])
    assert (pr.prune_weight(w, 0.3) == 0).sum(axis=1).tolist() == [1, 1]  # floor(0.3 * 4)


def test_bad_arguments_name_the_flag(tiny_llama):
    with pytest.raises(FlashError, match="--sparsity 1.0"):
        pr.check_args("wanda", 1.0)
    with pytest.raises(FlashError, match="--sparsity 0"):
        pr.check_args("wanda", 0)
    with pytest.raises(FlashError, match="--method"):
        pr.check_args("sparsegpt", 0.5)
    model, _, _ = load_float_model(tiny_llama("src"))
    with pytest.raises(FlashError, match="--layers fc1: the model has no such linear layers"):
        pr.select_linears(model, ["ffn", "fc1"])
    assert set(pr.select_linears(model, ["attn"])) == {
        f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
