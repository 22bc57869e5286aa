"""Loading through the seam (models/loader.py, models.load): same weights and logits as mlx-lm."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_flash.errors import FlashError
from mlx_flash.models import get_model_classes, load_model
from mlx_flash.sources import resolve_model


def test_logits_bit_identical_to_mlx_lm_load(embedded_model_dir):
    from mlx_lm import load as mlx_lm_load

    import mlx_flash
    from mlx_flash.cpu import ops
    from mlx_flash.cpu.patch import FusedBlock, KernelQuantizedLinear, patch_layers

    ours, our_tok = mlx_flash.load(str(embedded_model_dir))
    ref, ref_tok = mlx_lm_load(str(embedded_model_dir))
    patch_layers(ref)  # the same seam: mlx-lm's model with its linear layers on our kernels
    ids = ref_tok.encode("Bit-identical logits are the contract of the dense path.")
    assert our_tok.encode("Bit-identical logits are the contract of the dense path.") == ids
    if ops.kernels_active():  # the dense path runs on our kernels (fused blocks) with no flag (issue 6)
        assert any(isinstance(m, KernelQuantizedLinear) for _, m in ours.named_modules())
        assert all(isinstance(layer, FusedBlock) for layer in ours.model.layers)
    a, b = ours(mx.array([ids])), ref(mx.array([ids]))
    assert a.dtype == b.dtype
    assert np.array_equal(np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32)))


def test_logits_match_mlx_lm_on_its_own_ops(embedded_model_dir):
    """Against mlx-lm's model left on MLX's own ops (nothing patched: the independent reference the
    test above cannot be, since it patches both sides): float16 rounding only, same greedy token."""
    from mlx_lm import load as mlx_lm_load

    import mlx_flash

    ours, tok = mlx_flash.load(str(embedded_model_dir))
    ref, _ = mlx_lm_load(str(embedded_model_dir))
    ids = mx.array([tok.encode("Independent references catch what shared code hides.")])
    a, b = ours(ids).astype(mx.float32), ref(ids).astype(mx.float32)
    scale = mx.abs(b).max().item()
    ulp = 2.0 ** (np.floor(np.log2(scale)) - 10)  # float16 ulp at the largest logit
    assert mx.abs(a - b).max().item() <= ulp  # observed 0.004 ulp
    assert mx.array_equal(mx.argmax(a, -1), mx.argmax(b, -1)).item()


def test_tiny_folder_loads(tiny_llama):
    path = tiny_llama("q", quantize=(4, 32))
    model, config = load_model(path)
    assert config["model_type"] == "llama"
    assert model(mx.array([[1, 2, 3]])).shape == (1, 3, 128)


def test_unknown_model_type(tiny_llama):
    path = tiny_llama()
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "no_such_arch"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(FlashError, match=r"model_type 'no_such_arch' is not supported"):
        load_model(resolve_model(str(path)))
    with pytest.raises(FlashError):
        get_model_classes({"model_type": "no_such_arch"})


def test_load_weights_checked_loads_all_or_names_the_packs_resident_file(tiny_llama):
    from mlx_flash.models.loader import build_model, load_weights_checked

    folder = tiny_llama("t")
    config = json.loads((folder / "config.json").read_text())
    weights = dict(mx.load(str(folder / "model.safetensors")))
    model = build_model(config, weights)
    load_weights_checked(model, weights, "PACK")
    name = "model.layers.0.mlp.up_proj.weight"
    assert mx.array_equal(dict(tree_flatten(model.parameters()))[name], weights[name])
    del weights[name]
    with pytest.raises(FlashError, match=r"^PACK/resident\.safetensors: does not match the model \("):
        load_weights_checked(build_model(config, weights), weights, "PACK")


@pytest.mark.parametrize("model_type, notice", [("relu_llama", False), ("mystery_arch", True)])
def test_tokenizer_load_drops_transformers_notice_only_for_this_packages_own_model_types(tiny_llama, model_type,
                                                                                           notice):
    """transformers warns at every tokenizer load of a config.json whose model_type it does not
    know; for relu_llama (a model of this package) the warning is noise and is dropped, for any
    other unknown type it stays, and the filter does not outlive the load."""
    import logging

    from calibration_packs import write_byte_tokenizer

    from mlx_flash.models import load_tokenizer

    src = tiny_llama("t", vocab=256)
    write_byte_tokenizer(src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    seen = []

    class Seen(logging.Handler):  # on transformers' logger itself: it sees what passed its filters
        def emit(self, record):
            seen.append(record.getMessage())

    log = logging.getLogger("transformers.configuration_utils")
    handler = Seen()
    log.addHandler(handler)
    try:
        assert load_tokenizer(src).encode("hi")
    finally:
        log.removeHandler(handler)
    assert any(f"model of type `{model_type}`" in m for m in seen) == notice, seen
    assert log.filters == []
