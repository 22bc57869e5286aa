"""calibration/dense_pass.py: the pack's dense model with MaskedFFNs, checked against the original FFN."""

import pytest

from mlx_flash.calibration import dense_pass
from mlx_flash.errors import FlashError


def test_unsupported_mlp_shape_is_refused(llama_pack):
    from mlx_flash.pack import read_manifest

    model, _, config, manifest = dense_pass.load_dense_model(llama_pack)
    with pytest.raises(FlashError, match="unsupported architecture"):
        dense_pass.install_masked_ffns(model, manifest, "relu", config["hidden_size"])  # llama is silu
    with pytest.raises(FlashError, match="activation 'tanh' is not supported"):
        dense_pass.ffn_activation({"hidden_act": "tanh"}, read_manifest(llama_pack))