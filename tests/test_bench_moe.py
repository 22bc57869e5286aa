"""bench run on MoE packs (EdgeMoE's rows) and its child: byte, sync and routing accounting
checked against what the runtime must do (speed is never asserted here)."""

import json
import shutil

import pytest

from mlx_flash.bench.__main__ import main as bench_main
from mlx_flash.bench.moe import (MLX_ROW, expert_io_accounting, expert_io_lines, generate_moe,
                                  hit_rate_vs_slots, with_compute_paths)
from mlx_flash.convert import main as convert_main
from mlx_flash.moe.store import expert_layers, scratch_bank_bytes
from mlx_flash.cpu import ops
from mlx_flash.pack import read_manifest

PROMPT = [1, 2, 3, 400, 5000, 17, 9, 33]


@pytest.fixture(scope="module")
def moe_pack(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_moe") / "olmoe-tiny"
    assert convert_main(["--synthetic", "olmoe-tiny", "--out", str(out)]) == 0
    return out


def test_naive_reads_top_k_experts_per_layer_per_token(moe_pack):
    m = read_manifest(moe_pack)
    stride, layers = m.bundles[0].stride, len(m.bundles)
    top_k = m.config["num_experts_per_tok"]
    r = generate_moe(str(moe_pack), "naive", PROMPT, 6, record=True)
    s = r["summary"]
    block = sum(c.length for c in m.bundles[0].components)  # one expert's bytes in a bank
    # one decode token routes to exactly top_k distinct experts per layer, each read whole; the
    # planner may cover the gap between two of them (never more than the layer's blocks)
    assert s["useful_bytes"] == top_k * block * layers
    assert top_k * block * layers <= s["bytes_read"] <= m.bundles[0].count * stride * layers
    assert s["host_syncs"] == layers and s["preload_bytes"] == 0 and s["hit_rate"] is None
    assert s["tokens"] == 6 and s["total_ms"] > 0 and 0 <= s["io_ms"] <= s["total_ms"]
    # the decode routing: (layer, top_k experts) per layer per decode step after the first token
    assert len(r["routes"]) >= 5 * layers
    assert all(len(set(e)) == top_k for _, e in r["routes"])
    assert r["plan_weights_bytes"] == m.resident.length + m.bundles[0].count * block


def test_cache_of_every_expert_reads_each_expert_once(moe_pack):
    m = read_manifest(moe_pack)
    n, stride, layers = m.bundles[0].count, m.bundles[0].stride, len(m.bundles)
    ref = generate_moe(str(moe_pack), "naive", PROMPT, 8, record=True)
    r = generate_moe(str(moe_pack), "hybrid", PROMPT, 8, capacity=n, record=True)
    assert r["routes"] == ref["routes"]  # same tokens, same routing: results do not depend on mode
    s = r["summary"]
    assert r["slots_per_layer"] == n and 0 < s["hit_rate"] <= 1
    # nothing is evicted, so no expert is read twice: decode reads at most every block once
    assert s["bytes_read"] * (s["tokens"] - 1) <= n * layers * stride
    assert s["bytes_read"] < ref["summary"]["bytes_read"]
    block = sum(c.length for c in m.bundles[0].components)
    assert r["plan_weights_bytes"] == m.resident.length + n * layers * block


def test_hit_rate_vs_slots_on_a_known_trace():
    # one layer, 4 experts, top-1: a cyclic trace defeats LRU, Belady keeps what comes back first
    routes = [(0, [e]) for e in [0, 1, 2, 0, 1, 2, 0, 1, 2]]
    rows = {r["slots"]: r for r in hit_rate_vs_slots(routes, 4, 1)}
    assert rows[2]["lru"] == 0.0 and rows[2]["belady"] == pytest.approx(3 / 9)
    assert rows[4]["lru"] == rows[4]["belady"] == pytest.approx(6 / 9)  # compulsory misses only


@pytest.mark.slow
def test_bench_run_moe_rows(moe_pack, tmp_path, capsys, small_fio):
    text = tmp_path / "t.txt"
    text.write_text("Experts are read from flash into a cache of slots; the router picks them. " * 40)
    out = tmp_path / "bench"
    m = read_manifest(moe_pack)  # resident + the prompt scratch bank + 4 of each layer's 8 experts
    budget = str(m.resident.length + scratch_bank_bytes(expert_layers(m))
                 + 4 * len(m.bundles) * m.bundles[0].stride)
    assert bench_main(["run", "--model", str(moe_pack), "--memory-budget", budget,
                       "--prompt-tokens", "8", "--gen-tokens", "4", "--repeats", "1",
                       "--peers", "none", "--text", str(text), "--out", str(out)]) == 0
    result = json.loads((out / "results.json").read_text())
    # the read-cost profile line, as bench run prints it for dense packs: stderr, results, report
    profile = result["read_cost_profile"]
    assert profile.startswith("read-cost profile ") and profile in capsys.readouterr().err
    rows = {r["label"].split(" (")[0]: r for r in result["rows"]}
    assert list(rows) == ["IO-FREE", "IO-QEXP", "cache only", "preload only", "ours"]
    assert all(r["ok_runs"] == 1 for r in rows.values())
    assert rows["IO-FREE"]["bytes_read"] == 0 and rows["IO-QEXP"]["hit_rate"] is None
    assert rows["ours"]["slots_per_layer"] == 4 and rows["cache only"]["slots_per_layer"] == 4
    assert set(result["speedups"]) == {"IO-FREE", "IO-QEXP", "cache only", "preload only"}
    assert result["model"]["synthetic"]["arch"] == "olmoe-tiny"
    assert result["hit_rate_vs_slots"][-1]["slots"] == 8
    report = (out / "report.md").read_text()
    assert "SYNTHETIC" in report and "Belady" in report and "bench run" in report
    assert f"Reads priced by the {profile}." in report
    if shutil.which("fio"):  # rows that read experts, next to fio's time for their bytes
        assert "IO-QEXP" in {e["label"].split(" (")[0] for e in result["io_vs_fio"]}
        assert "Expert I/O per decode token vs fio" in report and "| IO-QEXP" in report


def test_a_prompt_routed_past_the_slots_stays_within_the_budget(moe_pack):
    m = read_manifest(moe_pack)
    block, layers = m.bundles[0].row_bytes, len(m.bundles)
    budget = m.resident.length + scratch_bank_bytes(expert_layers(m)) + 4 * layers * m.bundles[0].stride
    # 16 prompt tokens x top-2 route to all 8 experts of a layer: more than 4 slots, one chunk
    r = generate_moe(str(moe_pack), "hybrid", list(range(100, 116)), 3, budget=budget)
    assert r["slots_per_layer"] == 4
    assert r["plan_weights_bytes"] == m.resident.length + (4 * layers + 8) * block <= budget


def test_sampled_decode_is_seeded(moe_pack):
    runs = [generate_moe(str(moe_pack), "naive", PROMPT, 6, record=True, temp=1.0, seed=s)["routes"]
            for s in (0, 0, 1)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_mlx_rows_alternate_each_row_with_the_kernels_off(moe_pack):
    rows = [("ours (flash)", "p", "flash", {}), ("IO-FREE (dense)", "p", "dense", {})]
    assert [r[-1] for r in with_compute_paths(rows, False, True)] == [True, True]
    assert [r[-1] for r in with_compute_paths(rows, False, False)] == [False, False]
    paths = with_compute_paths(rows, True, True)
    assert [(r[0], r[-1]) for r in paths] == [
        ("ours (flash)", True), (MLX_ROW + "ours (flash)", False),
        ("IO-FREE (dense)", True), (MLX_ROW + "IO-FREE (dense)", False)]
    # the child of a kernels-off row runs on MLX's ops (the process-wide switch)
    try:
        off = generate_moe(str(moe_pack), "dense", PROMPT, 2, kernels=False)
    finally:
        ops.set_kernels_enabled(True)
    on = generate_moe(str(moe_pack), "dense", PROMPT, 2)
    assert off["kernels"] is False and on["kernels"] is ops.EXTENSION_AVAILABLE


def test_io_log_splits_demand_reads_from_preloads(moe_pack):
    m = read_manifest(moe_pack)
    layers, top_k = len(m.bundles), m.config["num_experts_per_tok"]
    naive = generate_moe(str(moe_pack), "naive", PROMPT, 5)["summary"]
    log = naive["io_log"]
    # naive: every layer call reads its top_k experts on demand, nothing in the background
    assert log["preload"] == {} and log["preload_wait"] == {}
    assert sum(v[0] for v in log["demand"].values()) == pytest.approx(layers)
    assert sum(v[1] for v in log["demand"].values()) == naive["bytes_read"] > 0
    assert set(log["demand"]) <= {str(d) for d in range(1, top_k + 1)}  # reads in flight per call
    assert naive["io_ms"] == pytest.approx(1e3 * sum(v[2] for v in log["demand"].values()))
    flash = generate_moe(str(moe_pack), "flash", PROMPT, 5, capacity=2 * top_k,
                         preload_width=top_k)["summary"]
    # (a preload may be cancelled before it starts on a loaded machine: no "> 0" here; the
    # waits and cancellations are tested on a held read in tests/test_moe_store.py)
    assert flash["preload_bytes"] == sum(v[1] for v in flash["io_log"]["preload"].values())
    waited = flash["io_log"]["preload_wait"]
    assert flash["waited_preload_bytes"] == sum(v[1] for v in waited.values())
    assert flash["io_ms"] == pytest.approx(1e3 * sum(
        v[2] for kind in ("demand", "preload_wait") for v in flash["io_log"][kind].values()))


def test_expert_io_accounting_prices_each_depth_at_its_fio_throughput():
    gbps = {1: 1.0, 2: 2.0, 4: 4.0}
    ref = lambda pack, depth: {"gbps": gbps[depth], "command": f"fio --iodepth={depth}"}  # noqa: E731
    rows = [{"label": "ours", "pack": "p", "io_log": {
        "demand": {"1": [3, 3e6, 0.006], "2": [1, 4e6, 0.003]},    # 3 calls of 1 read, 1 of 2
        "preload": {"1": [5, 9e6, 0.02]},                           # background: not waited on
        "preload_wait": {"4": [1, 8e6, 0.001]}}},
        {"label": "IO-FREE", "pack": "p", "io_log": {"demand": {}, "preload": {}, "preload_wait": {}}},
        {"label": "deep", "pack": "p", "io_log": {"demand": {"64": [1, 4e6, 0.001]}}}]
    got = expert_io_accounting(rows, threads=4, reference=ref)
    assert [e["label"] for e in got] == ["ours", "deep"]  # a row that waited for nothing is left out
    e = got[0]
    assert e["demand_mb"] == pytest.approx(7.0) and e["demand_ms"] == pytest.approx(9.0)
    assert e["demand_fio_ms"] == pytest.approx(3e6 / 1e9 * 1e3 + 4e6 / 2e9 * 1e3)  # 3 + 2 ms
    assert e["preload_wait_fio_ms"] == pytest.approx(2.0) and e["preload_mb"] == pytest.approx(9.0)
    assert e["over_fio"] == pytest.approx((9.0 + 1.0) / (5.0 + 2.0))
    assert got[1]["fio"] == {4: 4.0}  # depth capped at the loader's reads in flight
    text = expert_io_lines(got)
    assert "| ours | 7.0 | 9.0 | 5.0 | 8.0 | 1.0 | 2.0 | 9.0 | 1.43x |" in text
    assert "fio GB/s by depth: 1: 1.000, 2: 2.000, 4: 4.000 (`fio --iodepth=" in text
    assert expert_io_lines([]) == ""


def test_moe_rows_picks_the_rows_to_run(moe_pack):
    from types import SimpleNamespace

    from mlx_flash.bench.moe import suite_rows

    args = SimpleNamespace(io_exp_pack=str(moe_pack), moe_policy="layer", moe_rows=None)
    m = read_manifest(moe_pack)
    every = [r[0].split(" (")[0] for r in suite_rows(args, moe_pack, m)]
    assert every == ["IO-FREE", "IO-EXP", "IO-QEXP", "cache only", "preload only", "ours"]
    args.moe_rows = ["ours", "io-exp", "cache"]  # the suite's order, whatever the flag's
    assert [r[0].split(" (")[0] for r in suite_rows(args, moe_pack, m)] == ["IO-EXP", "cache only", "ours"]


def test_routing_stability_counts_the_experts_a_quantized_layer_re_routes(tmp_path):
    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np
    from conftest import write_tiny_moe

    from mlx_flash.bench.moe import routing_stability
    from mlx_flash.models import load_model

    src = write_tiny_moe(tmp_path / "m", "mixtral", layers=3, experts=6, top_k=2)

    def load():  # layer 0's experts loud enough that their rounding reaches the later routers
        m, _ = load_model(src, lazy=False)
        sw = m.model.layers[0].block_sparse_moe.switch_mlp
        for proj in (sw.gate_proj, sw.up_proj, sw.down_proj):
            proj.weight = proj.weight * 8
        return m

    model = load()
    tokens = np.random.default_rng(0).integers(0, 128, 128).astype(np.int32)
    rows = routing_stability(model, tokens, [8, 2], layer=0, seq_len=64)

    class Recorder(nn.Module):  # each call's top-2 experts as a bool mask, by hand
        def __init__(self, gate, seen):
            super().__init__()
            self.gate, self.seen = gate, seen

        def __call__(self, x):
            g = self.gate(x)
            top = np.argsort(-np.array(g), axis=-1)[..., :2]
            mask = np.zeros(g.shape, bool)
            np.put_along_axis(mask, top, True, axis=-1)
            self.seen.append(mask)
            return g

    def chosen(m):
        seen = [[] for _ in m.model.layers]
        for layer, s in zip(m.model.layers, seen):
            layer.block_sparse_moe.gate = Recorder(layer.block_sparse_moe.gate, s)
        for start in (0, 64):
            mx.eval(m(mx.array(tokens[start: start + 64])[None]))
        for layer in m.model.layers:
            layer.block_sparse_moe.gate = layer.block_sparse_moe.gate.gate
        return seen

    ref = chosen(model)
    for row in rows:
        q = load()
        sw = q.model.layers[0].block_sparse_moe.switch_mlp
        for proj in (sw.gate_proj, sw.up_proj, sw.down_proj):
            proj.weight = mx.dequantize(*mx.quantize(proj.weight, 32, row["bits"]), 32, row["bits"])
        want = [np.mean([(new & ~old).sum(-1).mean() for new, old in zip(n, o)])
                for n, o in zip(chosen(q), ref)]
        np.testing.assert_allclose(row["changed"], want, atol=1e-6)
        assert row["changed"][0] == 0  # a layer's own experts never change its router's input
    assert rows[1]["kl"] > rows[0]["kl"] and max(rows[1]["changed"]) > 0


def test_bench_moe_no_cache_tables_prints_only_the_asked_figures(tmp_path, capsys):
    from calibration_packs import write_byte_tokenizer, write_text
    from conftest import write_tiny_moe

    src = write_tiny_moe(tmp_path / "m", "mixtral", layers=3, experts=6, top_k=2, vocab=256)
    write_byte_tokenizer(src)
    calib, held = write_text(tmp_path / "c.txt", seed=1), write_text(tmp_path / "h.txt", seed=2)
    out = tmp_path / "r.json"
    assert bench_main(["moe", "--model", str(src), "--calib-text", str(calib), "--text", str(held),
                       "--tokens", "600", "--no-cache-tables", "--routing-stability", "8", "2",
                       "--stability-tokens", "512", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| 2 bits |" in printed and "| 8 bits |" in printed and "LRU" not in printed
    result = json.loads(out.read_text())
    assert "rows" not in result and [r["bits"] for r in result["routing_stability"]] == [8, 2]


def run_bench_moe_on_2600_calibration_tokens(tmp_path, *flags) -> dict:
    """bench moe on a tiny MoE with more calibration tokens (2600) than the 2048 it once cut them
    to; the figures its JSON holds."""
    from calibration_packs import write_byte_tokenizer, write_text
    from conftest import write_tiny_moe

    src = write_tiny_moe(tmp_path / "m", "mixtral", layers=2, experts=4, top_k=2, vocab=256)
    write_byte_tokenizer(src)
    calib, held = write_text(tmp_path / "c.txt", 1000, seed=1), write_text(tmp_path / "h.txt", seed=2)
    out = tmp_path / "r.json"
    assert bench_main(["moe", "--model", str(src), "--calib-text", str(calib), "--text", str(held),
                       "--tokens", "300", "--calib-tokens", "2600", "--no-cache-tables", "--group-size", "32",
                       *flags, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_bits_variants_calibrate_on_the_tokens_convert_takes(tmp_path, capsys):
    rows = run_bench_moe_on_2600_calibration_tokens(tmp_path, "--bits-variants", "3.0")["bits_variants"]
    assert "calibration 2600 tokens" in capsys.readouterr().out
    assert rows[0]["name"] == "all 4-bit" and all(r["mean_bits"] <= 3.0 + 1e-9 for r in rows[1:])


def test_importance_check_measures_the_proxy_on_the_tokens_convert_takes(tmp_path, capsys):
    check = run_bench_moe_on_2600_calibration_tokens(tmp_path, "--importance-samples", "3")["importance"]
    assert "importance proxy on 2600 calibration tokens" in capsys.readouterr().out
    assert check["proxy_tokens"] == 2600 and len(check["pairs"]) == 3
