"""pack/reorder: permuting a layer's neuron bundles keeps the pack valid and the model's logits."""

import json

import numpy as np
import pytest

import mlx_flash
from calibration_packs import decode_logits
from mlx_flash.errors import FlashError
from mlx_flash.pack import read_manifest
from mlx_flash.pack.reorder import neuron_orders, reorder_pack


def test_reordered_pack_loads_verified_and_computes_the_same_logits(llama_pack):
    ids = [5, 17, 99, 3, 42]
    before = decode_logits(mlx_flash.load(str(llama_pack), mode="naive")[0], ids)
    entry = read_manifest(llama_pack)["bundles"][0]
    count, stride = entry["count"], entry["stride"]

    def rows():
        return np.fromfile(llama_pack / entry["file"], np.uint8)[: count * stride].reshape(count, stride)

    rng = np.random.default_rng(0)
    first, second = rng.permutation(count), rng.permutation(count)
    original_rows = rows()
    reorder_pack(llama_pack, {0: first, 1: first})
    assert np.array_equal(rows(), original_rows[first])  # bundle p now holds neuron first[p]
    reorder_pack(llama_pack, {1: second})
    orders = neuron_orders(read_manifest(llama_pack))
    assert np.array_equal(orders[0], first) and np.array_equal(orders[1], first[second])  # composed
    for mode in ("naive", "dense"):  # naive reads every bundle through the checksummed loader
        after = decode_logits(mlx_flash.load(str(llama_pack), mode=mode)[0], ids)
        np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-5)
    assert not any(p.name.startswith(".") for p in (llama_pack / "bundles").iterdir())


def test_bad_orders_and_stale_manifests_are_refused(llama_pack):
    count = read_manifest(llama_pack)["bundles"][0]["count"]
    with pytest.raises(FlashError, match="not a permutation"):
        reorder_pack(llama_pack, {0: np.zeros(count, int)})
    with pytest.raises(FlashError, match="layer 7 has no neuron bundles"):
        reorder_pack(llama_pack, {7: np.arange(count)})
    old = (llama_pack / "manifest.json").read_text()
    reorder_pack(llama_pack, {0: np.arange(count)[::-1]})
    (llama_pack / "manifest.json").write_text(old)  # a crash before the manifest was written
    with pytest.raises(FlashError, match="crc32 table does not match"):
        reorder_pack(llama_pack, {0: np.arange(count)})
    assert json.loads(old)["bundles"][0].get("neuron_order") is None


def test_reorder_permutes_a_resident_gate_with_its_bundles(tiny_llama, tmp_path):
    from calibration_packs import write_byte_tokenizer
    from mlx_flash.pack import load_resident, write_pack

    src = tiny_llama("src", vocab=256)
    write_byte_tokenizer(src)
    pack = write_pack(src, tmp_path / "pack", gate_bits=4, progress=False)
    ids = [5, 17, 99, 3, 42]
    before = decode_logits(mlx_flash.load(str(pack), mode="naive")[0], ids)
    gate = load_resident(pack)[1]["model.layers.1.mlp.gate_proj.weight"]
    order = np.random.default_rng(0).permutation(96)
    reorder_pack(pack, {1: order})
    assert np.array_equal(np.array(load_resident(pack)[1]["model.layers.1.mlp.gate_proj.weight"]),
                          np.array(gate)[order])
    for mode in ("naive", "dense"):  # load_resident checks the rewritten file's length and crc32
        after = decode_logits(mlx_flash.load(str(pack), mode=mode)[0], ids)
        np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-5)
    assert not any(p.name.startswith(".") for p in pack.iterdir())
