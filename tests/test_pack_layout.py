"""pack/layout.py: which tensors are a layer's FFN, and the manifest's format version check."""

import json

import pytest

from mlx_flash.errors import FlashError
from mlx_flash.pack import find_ffn, load_pack_weights, write_pack


def test_ffn_table_finds_architectures():
    names = ["model.layers.3.mlp.gate_proj.weight", "model.layers.3.mlp.up_proj.weight",
             "model.layers.3.mlp.down_proj.weight", "model.h.0.mlp.c_fc.weight",
             "model.h.0.mlp.c_proj.weight", "model.layers.3.self_attn.q_proj.weight"]
    found = find_ffn(names)
    assert found[3]["arch"] == "gated-mlp" and found[0]["arch"] == "gpt2"
    assert found[0]["modules"] == {"up": "model.h.0.mlp.c_fc", "down": "model.h.0.mlp.c_proj"}


def test_other_format_version_is_refused(tiny_llama, tmp_path):
    pack = write_pack(tiny_llama("src"), tmp_path / "pack", progress=False)
    m = json.loads((pack / "manifest.json").read_text())
    m["format_version"] = 99
    (pack / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(FlashError, match=r"manifest\.json: pack format version 99"):
        load_pack_weights(pack)
