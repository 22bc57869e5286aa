"""models/moe.py: MoE packs load per mode; bad input fails with one line naming the cause."""

import gc
import json
import os
import subprocess
import sys
import threading

import mlx.core as mx
import numpy as np
import pytest
from conftest import write_tiny_moe
from flash_runs import open_files_under

from mlx_flash.errors import FlashError
from mlx_flash.config import FlashConfig
from mlx_flash.models.moe import build_moe_model, expert_slots
from mlx_flash.moe.store import expert_layers, scratch_bank_bytes
from mlx_flash.pack import read_manifest, write_pack


@pytest.fixture(scope="module")
def moe_pack(tmp_path_factory):
    root = tmp_path_factory.mktemp("moepack")
    src = write_tiny_moe(root / "src", "qwen2_moe", quantize=(4, 32), experts=8)
    return write_pack(src, root / "pack", progress=False)


def test_pack_layout_experts_are_aligned_blocks_and_shared_expert_resident(moe_pack):
    m = read_manifest(moe_pack)
    assert {b["kind"] for b in m["bundles"]} == {"experts"}
    for b in m["bundles"]:
        assert b["count"] == 8 and b["stride"] % m["alignment"] == 0
        names = {c["name"] for c in b["components"]}
        assert {"gate.weight", "gate.scales", "gate.biases", "down.weight"} <= names
    resident = m["resident"]["tensors"]
    assert any(".shared_expert." in k for k in resident) and any(".mlp.gate." in k for k in resident)
    assert not any("switch_mlp" in k for k in resident)


def test_memory_budget_sets_slots_after_the_scratch_bank_and_too_small_budget_fails(moe_pack):
    m = read_manifest(moe_pack)
    stride, n_layers = m["bundles"][0]["stride"], len(m["bundles"])
    resident = m["resident"]["length"]
    scratch = 8 * m.bundles[0].row_bytes  # one layer's 8 experts, as a prompt's scratch bank
    assert scratch_bank_bytes(expert_layers(m)) == scratch
    assert expert_slots(m, None, 2) == 8
    assert expert_slots(m, resident + 8 * stride * n_layers, 2) == 8  # all cached: no scratch
    assert expert_slots(m, resident + scratch + 5 * stride * n_layers, 2) == 5
    assert expert_slots(m, resident + scratch + 5 * stride * n_layers - 1, 2) == 4
    with pytest.raises(FlashError, match="memory_budget=.*leaves 1 expert slots.*scratch bank"):
        expert_slots(m, resident + scratch + 2 * stride * n_layers - 1, 2)
    # enough for 2 slots per layer, not for the scratch bank as well
    with pytest.raises(FlashError, match="memory_budget=.*leaves 0 expert slots"):
        build_moe_model(moe_pack, FlashConfig(mode="flash",
                                              memory_budget=resident + 2 * stride * n_layers))
    model = build_moe_model(moe_pack, FlashConfig(mode="flash", memory_budget=0.75))
    assert 2 <= model.moe_store.cache.capacity_of(0) < 8
    # naive mode's one bank is the scratch bank
    with pytest.raises(FlashError, match="memory_budget=.*naive mode's .* expert bank"):
        build_moe_model(moe_pack, FlashConfig(mode="naive", memory_budget=resident + scratch - 1))
    assert build_moe_model(moe_pack, FlashConfig(mode="naive", memory_budget=resident + scratch))


def test_a_long_prompt_stays_within_the_budget(moe_pack):
    """A prompt routed to every expert while 2 slots per layer are cached reads them into the
    scratch bank: resident + slot bank + scratch bank (bytes allocated) fit the budget."""
    m = read_manifest(moe_pack)
    stride, n_layers = m.bundles[0].stride, len(m.bundles)
    budget = m.resident.length + scratch_bank_bytes(expert_layers(m)) + 2 * stride * n_layers
    model = build_moe_model(moe_pack, FlashConfig(mode="hybrid", memory_budget=budget))
    store = model.moe_store
    assert store.cache.capacity_of(0) == 2
    mx.eval(model(mx.array([list(range(1, 33))])))  # 32 tokens x top-2 over 8 experts
    assert store.scratch and store.overflow_reads > 0
    banks = sum(a.nbytes for b in [*store.banks.values(), *store.scratch.values()]
                for a in b.values())
    assert m.resident.length + banks <= budget


def test_wrong_expert_count_fails(tmp_path):
    src = write_tiny_moe(tmp_path / "src", "qwen2_moe", experts=8)
    config = json.loads((src / "config.json").read_text())
    config["num_experts"] = 6  # the weights hold 8
    (src / "config.json").write_text(json.dumps(config))
    bad = write_pack(src, tmp_path / "bad", progress=False)
    with pytest.raises(FlashError,
                       match=r"manifest.json: bundles\[0\].count = 8, but the config.s num_experts says 6"):
        build_moe_model(bad, FlashConfig(mode="hybrid"))


def test_unknown_moe_architecture_fails(tmp_path):
    src = write_tiny_moe(tmp_path / "src", "mixtral", experts=4)
    w = mx.load(str(src / "model.safetensors"))
    # llama.cpp / HF per-expert names that no FFN_TABLE entry knows
    w = {k.replace("switch_mlp.gate_proj", "experts.w9"): v for k, v in w.items()}
    mx.save_safetensors(str(src / "model.safetensors"), w)
    r = subprocess.run([sys.executable, "-m", "mlx_flash.convert", "--model", str(src),
                        "--out", str(tmp_path / "pack")], capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.slow
def test_generate_cli_runs_an_moe_pack_from_flash(tmp_path, embedded_model_dir):
    import shutil

    src = write_tiny_moe(tmp_path / "src", "qwen3_moe", quantize=(4, 32), experts=8, vocab=49152)
    for f in embedded_model_dir.glob("tokenizer*"):
        shutil.copy2(f, src / f.name)
    pack = write_pack(src, tmp_path / "pack", progress=False)
    m = read_manifest(pack)
    slots = 4 * m["bundles"][0]["stride"] * len(m["bundles"])
    budget = m["resident"]["length"] + scratch_bank_bytes(expert_layers(m)) + slots
    # the last: room for 3 slots per layer (top-2) but not for the prompt scratch bank as well
    for value, code in ((budget, 0), (m["resident"]["length"] + 1, 2),
                        (m["resident"]["length"] + slots * 3 // 4, 2)):
        r = subprocess.run([sys.executable, "-m", "mlx_flash.generate", "--model", str(pack),
                            "--mode", "flash", "--memory-budget", str(value), "--prompt", "Hello",
                            "--max-tokens", "4", "--ignore-chat-template"],
                           capture_output=True, text=True)
        assert r.returncode == code, r.stderr
    assert "--memory-budget" in r.stderr and "scratch bank" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_budget_slots_split_over_layers_by_calibration_routing(tmp_path):
    from mlx_flash.models.moe import layer_slots

    src = write_tiny_moe(tmp_path / "src", "qwen2_moe", quantize=(4, 32), experts=8)
    # layer 0 hits nothing more beyond 2 slots; layers 1 and 2 gain up to 8 and 5
    hits = {0: [5, 90, 90, 90, 90, 90, 90, 90], 1: [1, 10, 20, 30, 40, 50, 60, 70],
            2: [1, 10, 30, 50, 70, 70, 70, 70]}
    pack = write_pack(src, tmp_path / "pack", progress=False,
                      moe_routing={"policy": "lfu", "sizes": list(range(1, 9)), "hits": hits,
                                   "tokens": 100})
    m = read_manifest(pack)
    assert layer_slots(m, 4, 2) == {0: 2, 1: 5, 2: 5}
    assert layer_slots(m, 8, 2) == {0: 8, 1: 8, 2: 8}
    budget = (m["resident"]["length"] + scratch_bank_bytes(expert_layers(m))
              + 4 * m["bundles"][0]["stride"] * 3)
    model = build_moe_model(pack, FlashConfig(mode="hybrid", memory_budget=budget))
    assert [model.moe_store.cache.capacity_of(layer) for layer in range(3)] == [2, 5, 5]
    ref = build_moe_model(pack, FlashConfig(mode="dense"))
    tokens = mx.array([[3, 17, 42, 5, 99, 64, 1, 7]])
    for t in range(1, 8):
        np.testing.assert_array_equal(np.array(model(tokens[:, :t])), np.array(ref(tokens[:, :t])))


def test_bad_routing_statistics_fail_in_one_line(tmp_path):
    src = write_tiny_moe(tmp_path / "src", "mixtral", experts=4)
    for routing, match in (({"policy": "lfu", "sizes": [1, 2, 9], "hits": {}}, r"sizes\[2\] = 9"),
                           ({"policy": "lfu", "sizes": [1, 2], "hits": {"0": [1, 2]}},
                            r"one entry per MoE layer")):
        with pytest.raises(FlashError, match=match) as e:
            write_pack(src, tmp_path / "bad", progress=False, moe_routing=routing, overwrite=True)
            read_manifest(tmp_path / "bad")
        assert "\n" not in str(e.value)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="lists open files through /proc (Linux)")
def test_a_dropped_moe_model_closes_its_expert_files_and_threads(moe_pack):
    before = set(threading.enumerate())
    # a fixed preload width: the preload thread starts whatever the measured window says
    model = build_moe_model(moe_pack, FlashConfig(mode="flash", memory_budget=0.75), preload_width=1)
    model(mx.array([[1, 2, 3, 4]]))
    mx.eval(model(mx.array([[5]])))
    started = set(threading.enumerate()) - before
    assert open_files_under(moe_pack) and started
    del model
    gc.collect()
    assert open_files_under(moe_pack) == []
    assert not [t.name for t in started if t.is_alive()]
