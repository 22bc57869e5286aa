"""Flash packs run per mode (models/flash.py): exactness against dense, predictors, budgets,
statistics, and the generate CLI's flash flags."""

import gc
import os
import threading

import mlx.core as mx
import numpy as np
import pytest

from mlx_flash.config import FlashConfig
from mlx_flash.cpu import endor as cpu_endor
from mlx_flash.cpu.patch import patch_layers
from mlx_flash.errors import FlashError
from mlx_flash.models import load_model
from mlx_flash.models.flash import build_flash_model
from mlx_flash.pack import read_manifest, write_pack
from mlx_flash.sparse.budget import encoded_bytes, layer_bytes, resident_bytes, stream_bytes
from mlx_flash.sparse.ffn import sparse_layers_to_eval
from mlx_flash.sparse.predictor import save_predictors
from flash_runs import TOKENS, all_neurons, assert_identical, open_files_under, run_steps, run_steps_lazily
from test_generate import run as generate  # the CLI in a subprocess, as users run it

def hybrid_budget(pack, resident_layers):
    """A byte budget that fits the fixed part of hybrid mode plus `resident_layers` whole FFNs."""
    m = read_manifest(pack)
    return resident_bytes(m) + stream_bytes(m) + sum(layer_bytes(b) for b in m["bundles"][:resident_layers])


@pytest.mark.parametrize("dtype, quant", [("float32", None), ("float16", None), ("float32", (4, 32)),
                                          ("bfloat16", (8, 32))])
def test_every_mode_equals_dense_bit_for_bit_without_sparsity(tiny_llama, tmp_path, dtype, quant):
    src = tiny_llama("src", dtype=dtype, quantize=quant, layers=4, intermediate=96)
    pack = write_pack(src, tmp_path / "pack", progress=False)
    dense = run_steps(build_flash_model(pack, FlashConfig("dense")))
    source_model = load_model(src, lazy=False)[0]
    patch_layers(source_model)  # the same CPU kernels as the pack's model (build_flash_model patches)
    source = run_steps(source_model)
    if dtype == "float32" and quant is None:  # the pack's dense model is mlx-lm's, bit for bit
        assert_identical(source, dense)
    else:
        # The pack holds down_proj transposed (row-column bundles), so the down projection sums in
        # another order: float16 rounding, <= 4 ulp of the largest logit (2^-10 relative each;
        # observed 1-2). Quantized sources also re-quantize down along the other axis (manifest
        # down_requantized; down_bits=16 avoids it): a real weight change, observed <= 3%.
        rel = 0.05 if quant else 4 * 2.0 ** -10
        for x, y in zip(source, dense):
            x, y = x.astype(mx.float32), y.astype(mx.float32)
            assert mx.abs(x - y).max().item() <= rel * mx.abs(x).max().item()
    predictors = {i: all_neurons(96) for i in range(4)}
    runs = {
        "naive": build_flash_model(pack, FlashConfig("naive")),
        "hybrid": build_flash_model(pack, FlashConfig("hybrid", memory_budget=hybrid_budget(pack, 1))),
        "flash": build_flash_model(pack, FlashConfig("flash", window=2), predictors=predictors,
                                   capacity={i: 96 for i in range(4)}),
    }
    assert runs["hybrid"].flash_stats.plan.resident_layers == [0]
    for mode, model in runs.items():
        assert_identical(run_steps(model), dense)


@pytest.mark.parametrize("in_pieces", [False, True])
def test_flash_overflow_past_the_cache_stays_exact_up_to_rounding(tiny_llama, tmp_path, in_pieces):
    src = tiny_llama("src", layers=2, intermediate=96)
    pack = write_pack(src, tmp_path / "pack", progress=False)
    dense = run_steps(build_flash_model(pack, FlashConfig("dense")))
    model = build_flash_model(pack, FlashConfig("flash"), predictors={i: all_neurons(96) for i in range(2)},
                              capacity={0: 30, 1: 50})
    rt = model.flash_runtime
    if in_pieces:  # a 16-row streaming buffer, 12 KiB staged per read call, reads of at most 8 KiB
        rt.loader.max_read = 2 * rt.loader.alignment
        rt.overflow_rows, rt.max_read_bytes = 16, 3 * rt.loader.alignment
        for cache in rt.caches.values():
            cache.max_read_bytes = rt.max_read_bytes
        rt.loader._local.staging = None
    calls, read_many, read_at_once = [], rt.loader.read_many, rt.loader.read_at_once
    rt.loader.read_many = lambda requests: calls.append(len(requests)) or read_many(requests)

    def at_once(*args):  # one request when taken
        stats = read_at_once(*args)
        if stats is not None:
            calls.append(1)
        return stats

    rt.loader.read_at_once = at_once
    got = run_steps(model)
    for x, y in zip(got, dense):  # float32, sums split in parts: rounding only
        assert mx.allclose(x, y, atol=1e-4, rtol=1e-4).item()
    if in_pieces:
        assert all(next(iter(buf.values())).shape[0] == 16 for buf in rt._stream.values())
        assert len(rt.loader._local.staging) <= rt.max_read_bytes
    s = model.flash_stats.summary()
    # every step needs all 192 neurons: 80 cached rows stay (hits), 112 stream as overflow
    assert s["hit_rate"] == pytest.approx(80 / 192) and s["neurons_loaded"] == 112
    if not in_pieces:  # the prompt's cache fill and its overflow: one loader call of one plan per layer
        assert calls == [1] * len(calls) and len(calls) == 2 * len(TOKENS)


def opt_pack_with_exact_predictors(tmp_path):
    from conftest import write_tiny_opt

    src = write_tiny_opt(tmp_path / "opt", ffn=128)
    pack = write_pack(src, tmp_path / "pack", progress=False)
    layers = {i: {"kind": "exact-relu", "n_neurons": 128, "rank": 0, "threshold": 0.0,
                  "prob_threshold": 0.5, "stats": {}, "capacity": [80] * 8} for i in range(2)}
    save_predictors(pack, {"activation": "relu"}, layers, {})
    return src, pack


def test_opt_exact_relu_predictor_matches_dense(tmp_path):
    src, pack = opt_pack_with_exact_predictors(tmp_path)
    dense = run_steps(load_model(src, lazy=False)[0])
    model = build_flash_model(pack, FlashConfig("flash", window=2))
    got = run_steps(model)
    for x, y in zip(got, dense):  # inactive ReLU neurons contribute exact zeros: rounding only
        assert mx.allclose(x, y, atol=1e-4, rtol=1e-4).item()
    s = model.flash_stats.summary()
    # a random ReLU layer fires about half its neurons: far fewer than all 256 are needed per token
    assert 0 < s["neurons_loaded"] < 256 and s["bytes_read"] > 0
    assert model.flash_stats.plan.capacity == {0: 80, 1: 80}


def test_stats_count_what_the_caches_and_reads_did(tmp_path):
    _, pack = opt_pack_with_exact_predictors(tmp_path)
    model = build_flash_model(pack, FlashConfig("flash", window=3))
    run_steps(model)
    steps = model.flash_stats.steps
    assert len(steps) == len(TOKENS)
    stride = read_manifest(pack)["bundles"][0]["stride"]
    for s in steps:
        # each needed neuron was a cache hit or was read from flash (into the cache or streamed)
        assert s.hits + s.neurons_loaded == s.neurons_needed > 0
        assert s.bytes_read >= s.neurons_loaded * stride  # whole bundles; merged reads add gaps
    caches = model.flash_runtime.caches.values()
    assert sum(s.neurons_loaded for s in steps) >= sum(c.rows_loaded for c in caches)
    for s in steps:  # the per-layer records split each step's counters exactly
        assert sorted(s.layers) == [0, 1] and all(r.kind == "sparse" and r.call_s > 0 for r in s.layers.values())
        for key in ("neurons_needed", "hits", "neurons_loaded", "bytes_read", "io_s", "mem_s"):
            assert sum(getattr(r, key) for r in s.layers.values()) == pytest.approx(getattr(s, key))
    summary = model.flash_stats.summary()
    layers = summary["layers"]
    assert sum(r["mb_read"] for r in layers.values()) * 1e6 == pytest.approx(summary["bytes_read"])
    assert sum(r["loaded"] for r in layers.values()) == pytest.approx(summary["neurons_loaded"])
    assert all(r["cache_rows"] == 80 for r in layers.values())


def test_naive_reads_every_ffn_every_step(tiny_llama, tmp_path):
    src = tiny_llama("src", layers=2, intermediate=96)
    pack = write_pack(src, tmp_path / "pack", progress=False)
    model = build_flash_model(pack, FlashConfig("naive"))
    run_steps(model)
    m = read_manifest(pack)
    per_step = sum(b["count"] * b["stride"] for b in m["bundles"])
    for s in model.flash_stats.steps:
        assert s.neurons_loaded == 192 and s.hits == 0
        assert s.bytes_read >= per_step  # whole bundles, aligned reads may add edges


def test_flash_without_predictors_points_at_calibrate(tiny_llama, tmp_path):
    pack = write_pack(tiny_llama("src"), tmp_path / "pack", progress=False)
    with pytest.raises(FlashError, match="python -m mlx_flash.calibrate"):
        build_flash_model(pack, FlashConfig("flash"))


def test_budget_below_minimum_says_the_minimum(tiny_llama, tmp_path):
    pack = write_pack(tiny_llama("src"), tmp_path / "pack", progress=False)
    # the Python API names its parameter (the CLI names --memory-budget: test_cli_flash_errors...)
    with pytest.raises(FlashError, match=r"memory_budget='[0-9.]+ kB': below the minimum .* give at least"):
        build_flash_model(pack, FlashConfig("naive", memory_budget="10kB"))
    with pytest.raises(FlashError, match="memory_budget='lots'"):
        FlashConfig("naive", memory_budget="lots")


# ---- the generate CLI on the embedded model's pack -----------------------------------------

@pytest.fixture(scope="module")
def embedded_pack(embedded_model_dir, tmp_path_factory):
    return write_pack(embedded_model_dir, tmp_path_factory.mktemp("embedded") / "pack", progress=False)


def test_cli_hybrid_stats(embedded_pack):
    r = generate("--model", str(embedded_pack), "--prompt", "What is the capital of France?",
                 "--max-tokens", "8", "--mode", "hybrid", "--memory-budget", "0.65", "--stats")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    for line in ("Per token (", "MB read", "cache hit rate", "Peak memory:", "Memory plan: mode hybrid"):
        assert line in r.stdout


@pytest.mark.parametrize("args, message", [
    (["--mode", "flash"], "--mode flash needs activation predictors"),
    (["--mode", "naive", "--memory-budget", "0.2"], "below the minimum resident set of mode naive"),
    (["--mode", "naive", "--memory-budget", "0.2"], "error: --memory-budget "),  # the flag, not memory_budget=
    (["--mode", "naive", "--memory-budget", "lots"], "--memory-budget lots: expected a fraction"),
    (["--mode", "naive", "--window", "0"], "--window 0: must be a whole number of tokens >= 1"),
])
def test_cli_flash_errors_are_one_line(embedded_pack, args, message):
    r = generate("--model", str(embedded_pack), "--max-tokens", "2", *args)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    # the test's own read-cost profile may be measured on a loaded machine: its one warning line
    # (read_cost.warn_if_loaded) is not part of the error
    err = "".join(line for line in r.stderr.splitlines(keepends=True)
                  if not line.startswith("mlx_flash: the read-cost profile "))
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_cli_memory_budget_needs_a_pack(embedded_model_dir):
    r = generate("--model", str(embedded_model_dir), "--memory-budget", "0.5")
    assert r.returncode == 2 and "--memory-budget: needs a flash pack" in r.stderr


@pytest.mark.parametrize("quantize", [None, 4])
def test_endor_pack_runs_every_mode_like_the_dense_pack(tiny_llama, tmp_path, quantize):
    """ENDOR bundles decode to exactly the rows a dense pack holds (float16), so every mode gives
    the dense pack's logits bit for bit; 4-bit ENDOR decodes to float16 rows, compared with its
    own dense mode (same decoded weights, different read path)."""
    from test_calibration_prune import pruned_model

    src, _ = pruned_model(tiny_llama, tmp_path, layers=4, intermediate=96)
    endor = write_pack(src, tmp_path / "endor", quantize=quantize, encoding="endor", progress=False)
    if quantize is None:
        dense = run_steps(build_flash_model(write_pack(src, tmp_path / "dense", progress=False),
                                            FlashConfig("dense")))
        assert_identical(run_steps(build_flash_model(endor, FlashConfig("dense"))), dense)
    else:
        dense = run_steps(build_flash_model(endor, FlashConfig("dense")))
    m = read_manifest(endor)  # room for 3 layers held encoded, fewer than 3 decoded
    held_budget = resident_bytes(m) + stream_bytes(m) + sum(encoded_bytes(b, m.alignment) for b in m.bundles[:3])
    runs = {
        "naive": build_flash_model(endor, FlashConfig("naive")),
        "hybrid": build_flash_model(endor, FlashConfig("hybrid", memory_budget=held_budget)),
        "flash": build_flash_model(endor, FlashConfig("flash", window=2),
                                   predictors={i: all_neurons(96) for i in range(4)},
                                   capacity={i: 96 for i in range(4)}),
    }
    plan = runs["hybrid"].flash_stats.plan
    assert plan.encoded_layers and len(plan.resident_layers) + len(plan.encoded_layers) == 3
    assert plan.weights <= plan.budget
    for mode, model in runs.items():
        got = run_steps(model)
        if mode in ("naive", "hybrid") and cpu_endor.takes(m.bundles[0].components[0].endor, 1):
            # streamed and held layers run the CPU decode-matvec for single tokens (float32 sums
            # where the row path rounds g, u and h to float16): the prompt exact, the steps within rounding
            ran = [layer.mlp._endor_cpu for layer in model.layers if layer.mlp.kind in ("streamed", "encoded")]
            assert ran and all(r is True for r in ran), ran
            assert_identical(got[:1], dense[:1])
            for x, y in zip(got[1:], dense[1:]):
                assert mx.abs(x - y).max().item() <= 0.01 * mx.abs(y).max().item()
            continue
        assert_identical(got, dense)
    assert runs["naive"].flash_stats.summary()["bytes_read"] > 0
    assert sum(s.decode_s for s in runs["flash"].flash_stats.steps) > 0  # neuron-cache loads decode
    held = runs["hybrid"].flash_stats.summary()
    assert held["decode_ms"] > 0 and held["bytes_read"] < runs["naive"].flash_stats.summary()["bytes_read"]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="lists open files through /proc (Linux)")
@pytest.mark.parametrize("engine", ["default", "threads"])
@pytest.mark.parametrize("mode", ["naive", "hybrid", "flash"])
def test_a_dropped_model_closes_its_pack_files_and_reader_threads(tiny_llama, tmp_path, mode, engine,
                                                                 monkeypatch):
    # Each model owns its loader: a suite or a notebook that builds many models must not keep
    # every loader's reader threads and open bundle files (the suite ran out of file descriptors).
    # AIO reads are checked on the calling thread and start no thread here; without AIO (macOS,
    # buffered files) the loader's reader threads run, and must stop with the model.
    if engine == "threads":
        monkeypatch.setattr("mlx_flash.io.aio.available", lambda: False)
    pack = write_pack(tiny_llama("src", layers=2, intermediate=96), tmp_path / "pack", progress=False)
    before = set(threading.enumerate())
    extra = ({"predictors": {i: all_neurons(96) for i in range(2)}, "capacity": {0: 30, 1: 50}}
             if mode == "flash" else {})
    cfg = FlashConfig(mode, memory_budget=hybrid_budget(pack, 1)) if mode == "hybrid" else FlashConfig(mode)
    model = build_flash_model(pack, cfg, **extra)
    run_steps(model)
    started = set(threading.enumerate()) - before
    assert open_files_under(pack)  # open while the model lives
    assert started or engine == "default"  # the reader threads run while the model lives
    del model
    gc.collect()
    assert open_files_under(pack) == []
    assert not [t.name for t in started if t.is_alive()]


def test_one_host_sync_per_sparse_layer_keeps_the_logits_bit_identical(tiny_llama, tmp_path):
    src = tiny_llama("src", layers=3, intermediate=96)
    pack = write_pack(src, tmp_path / "pack", progress=False)

    def build():  # every layer overflows its cache into the shared streaming buffer
        return build_flash_model(pack, FlashConfig("flash"), predictors={i: all_neurons(96) for i in range(3)},
                                 capacity={0: 30, 1: 50, 2: 20})

    every = build()
    every.flash_runtime.eval_sparse = None  # each sparse layer evaluates its own output
    want = run_steps(every)
    one = build()
    assert one.flash_runtime.eval_sparse == set()  # the next pass's first sparse layer evaluates them
    assert_identical(run_steps(one), want)
    # a layer that refills the shared buffer before it syncs: the sparse layer before it evaluates
    mixed = build()
    mixed.model.layers[1].mlp.kind = "streamed"
    mixed.flash_runtime.eval_sparse = sparse_layers_to_eval({0: "sparse", 1: "streamed", 2: "sparse"}, False)
    ref = build()
    ref.model.layers[1].mlp.kind = "streamed"
    ref.flash_runtime.eval_sparse = None
    assert_identical(run_steps(mixed), run_steps(ref))


@pytest.mark.parametrize("first", ["sparse", "streamed"])
def test_steps_built_before_the_last_is_evaluated_keep_the_logits_bit_identical(tiny_llama, tmp_path, first):
    """mlx-lm's generate builds a token's graph on the last token's unevaluated id: a pass's last
    sparse layer leaves its output lazy only when the next pass's first layer that is not resident
    syncs before it writes rows (sparse); a streamed one refills the shared buffer right away, so
    the layer evaluates its own (else the lazy output reads that layer's rows)."""
    src = tiny_llama("src", layers=3, intermediate=96)
    pack = write_pack(src, tmp_path / "pack", progress=False)

    def build():  # every sparse layer overflows its cache into the shared streaming buffer
        model = build_flash_model(pack, FlashConfig("flash"), predictors={i: all_neurons(96) for i in range(3)},
                                  capacity={0: 30, 1: 50, 2: 20})
        model.model.layers[0].mlp.kind = first
        kinds = {i: layer.mlp.kind for i, layer in enumerate(model.model.layers)}
        model.flash_runtime.eval_sparse = sparse_layers_to_eval(kinds, False)
        return model

    every = build()
    every.flash_runtime.eval_sparse = None
    want = run_steps(every)
    lazy = build()
    assert lazy.flash_runtime.eval_sparse == (set() if first == "sparse" else {2})
    assert_identical(run_steps_lazily(lazy), want)


def test_resident_gate_pack_runs_every_mode_like_its_dense_model(tiny_llama, tmp_path):
    """convert --gate-bits: the rows carry no gate; each row takes the resident 4-bit gate's output
    at its own neuron id (cache rows in cache order, overflow rows from neuron 30 or 50 on)."""
    src = tiny_llama("src", layers=2, intermediate=96)
    pack = write_pack(src, tmp_path / "pack", gate_bits=4, progress=False)
    reference = load_model(src, lazy=False)[0]
    for layer in reference.layers:  # the source model computing with the 4-bit gate's values
        g = layer.mlp.gate_proj
        g.weight = mx.dequantize(*mx.quantize(g.weight, group_size=32, bits=4), group_size=32, bits=4)
    want = run_steps(reference)
    dense = run_steps(build_flash_model(pack, FlashConfig("dense")))
    runs = {"naive": build_flash_model(pack, FlashConfig("naive")),
            "flash": build_flash_model(pack, FlashConfig("flash"), capacity={0: 30, 1: 50},
                                       predictors={i: all_neurons(96) for i in range(2)})}
    for got in [dense] + [run_steps(m) for m in runs.values()]:
        for x, y in zip(got, want):  # float32; 4-bit kernel vs dequantized matmul: rounding only
            assert mx.allclose(x, y, atol=1e-4, rtol=1e-4).item()
    s = runs["flash"].flash_stats.summary()
    assert s["hit_rate"] == pytest.approx(80 / 192) and s["neurons_loaded"] == 112


def test_lookahead_reads_the_next_layers_neurons_and_keeps_the_logits(tiny_llama, tmp_path, monkeypatch):
    """A CATS pack with a resident 4-bit gate and exact predictors: each sparse layer reads the
    next one's lookahead neurons in the background; the next layer copies those it needs into
    its cache or computes them from the lookahead buffer. Same logits as without lookahead and as
    dense; the lookahead served most of what it read (consecutive layers' gates on one stream)."""
    from calibration_packs import decode_logits, tiny_cats_pack, write_text
    from mlx_flash import calibrate as calibrate_cli

    pack = tiny_cats_pack(tiny_llama, tmp_path, [0.03, 0.05, 0.04, 0.06], gate_bits=4)
    texts = [write_text(tmp_path / f"t{i}.txt", n_words=300, seed=i) for i in range(2)]
    assert calibrate_cli.main(["--model", str(pack), "--text", *map(str, texts), "--kind", "gate-threshold",
                               "--quiet"]) == 0
    ids = [5, 17, 99, 3, 42, 7, 61, 12, 200, 31]
    dense = decode_logits(build_flash_model(pack, FlashConfig("dense")), ids)
    runs = {}
    for ahead in (False, True):
        model = build_flash_model(pack, FlashConfig("flash"), capacity={i: 12 for i in range(4)}, lookahead=ahead)
        read = _count_neurons_read(model.flash_runtime)
        runs[ahead] = (decode_logits(model, ids), model.flash_runtime)
        # the statistics count every neuron the loader read once: lookahead reads, not their copies
        assert sum(step.neurons_loaded for step in model.flash_stats.steps) == read[0] > 0
    rt = runs[True][1]
    assert 0 < rt.ahead_copied <= rt.ahead_used
    assert sorted(rt.lookahead) == [0, 1, 2] and rt.ahead_rows > 0 and not runs[False][1].lookahead
    assert rt.ahead_read > 0 and rt.ahead_used > 0.5 * rt.ahead_read, (rt.ahead_used, rt.ahead_read)
    np.testing.assert_allclose(runs[True][0], runs[False][0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(runs[True][0], dense, rtol=1e-4, atol=1e-4)
    # the model's own CATS mask is not computed a second time by the row projections
    assert len(rt.currents) == 4 and all(c.threshold == 0 for c in rt.currents.values())
    # a budget whose minimum leaves no room for the lookahead buffers runs without lookahead
    tight = build_flash_model(pack, FlashConfig("flash", memory_budget=0.8), lookahead=True)
    assert not tight.flash_runtime.lookahead and tight.flash_stats.plan.lookahead == 0
    # the default is off and follows the environment
    assert not build_flash_model(pack, FlashConfig("flash"), capacity={i: 12 for i in range(4)}).flash_runtime.lookahead
    monkeypatch.setenv("MLX_FLASH_LOOKAHEAD", "1")
    assert build_flash_model(pack, FlashConfig("flash"), capacity={i: 12 for i in range(4)}).flash_runtime.lookahead


def _count_neurons_read(runtime) -> list:
    """[neurons read so far] through `runtime`'s loader (every read goes through read_many, or
    start_read / read_at_once when native AIO takes it)."""
    count, loader = [0], runtime.loader
    read_many, start_read, read_at_once = loader.read_many, loader.start_read, loader.read_at_once

    def counted_at_once(layer, ids, *args):
        stats = read_at_once(layer, ids, *args)
        count[0] += len(ids) if stats is not None else 0  # else read_many reads them
        return stats

    def counted(requests):
        count[0] += sum(len(ids) for _, ids, _, _ in requests)
        return read_many(requests)

    def counted_start(layer, ids, *args, **kw):
        started = start_read(layer, ids, *args, **kw)
        count[0] += len(ids) if "job" in started else 0  # else read_many read it
        return started

    loader.read_many, loader.start_read, loader.read_at_once = counted, counted_start, counted_at_once
    return count


def test_flash_plan_prices_calibrations_reads_with_the_loaders_cost_model(tiny_llama, tmp_path, text, monkeypatch):
    """A calibrated pack's sparse prices come from its recorded reads priced by the loader's cost
    model now, not from the seconds stored at calibration time (a curve measured again)."""
    import mlx_flash.models.flash as flash_mod
    from mlx_flash.calibration import fit
    from mlx_flash.sparse.budget import priced_read_fractions
    from mlx_flash.sparse.predictor import sparse_read_calls
    from calibration_packs import tiny_llama_pack

    llama_pack = tiny_llama_pack(tiny_llama, tmp_path, layers=6, intermediate=256)
    fit.calibrate(llama_pack, [text], kind="gate-threshold", target_sparsity=0.5, progress=False)
    seen, real = {}, flash_mod.plan_memory

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    def stale(*args):
        raise AssertionError("the plan used prices stored at calibration time")

    monkeypatch.setattr(flash_mod, "plan_memory", spy)
    monkeypatch.setattr(flash_mod, "sparse_read_fraction", stale)
    monkeypatch.setattr(flash_mod, "cache_read_fraction", stale)
    model = build_flash_model(llama_pack, FlashConfig("flash", memory_budget=0.8))
    want = priced_read_fractions(model.flash_runtime.loader, sparse_read_calls(llama_pack, 5))
    assert want[0] and seen["sparse_read_fraction"] == want[0] and seen["cache_read_fraction"] == want[1]


def test_resident_bits_pack_runs_its_linears_on_the_8bit_kernels_and_frees_budget(tiny_llama, tmp_path):
    """convert --resident-bits 8: attention projections and the tied embedding / lm_head load as
    quantized layers on the CPU kernels; every mode computes the source model with those weights
    8-bit (and the gate 4-bit); at the same byte budget the smaller resident set leaves the
    memory plan more neuron-cache rows."""
    import mlx.nn as nn

    from mlx_flash.cpu.patch import KernelQuantizedEmbedding, KernelQuantizedLinear

    src = tiny_llama("src", layers=2, intermediate=96)
    plain = write_pack(src, tmp_path / "plain", gate_bits=4, progress=False)
    pack = write_pack(src, tmp_path / "pack", gate_bits=4, resident_bits=8, resident_group_size=32,
                      progress=False)
    reference = load_model(src, lazy=False)[0]
    for layer in reference.layers:
        g = layer.mlp.gate_proj
        g.weight = mx.dequantize(*mx.quantize(g.weight, group_size=32, bits=4), group_size=32, bits=4)
    nn.quantize(reference, group_size=32, bits=8, class_predicate=lambda p, m: "mlp" not in p
                and isinstance(m, (nn.Linear, nn.Embedding)))
    want = run_steps(reference)  # MLX's own quantized ops
    dense = build_flash_model(pack, FlashConfig("dense"))
    attn = dense.layers[0].self_attn
    assert all(type(getattr(attn, f"{p}_proj")) is KernelQuantizedLinear and getattr(attn, f"{p}_proj").bits == 8
               for p in "qkvo")
    assert type(dense.model.embed_tokens) is KernelQuantizedEmbedding and dense.model.embed_tokens.bits == 8
    runs = [dense, build_flash_model(pack, FlashConfig("naive")),
            build_flash_model(pack, FlashConfig("flash"), capacity={0: 30, 1: 50},
                              predictors={i: all_neurons(96) for i in range(2)})]
    for got in map(run_steps, runs):
        for x, y in zip(got, want):  # float32: the 8-bit kernels vs MLX's quantized matmuls
            assert mx.allclose(x, y, atol=1e-4, rtol=1e-4).item()
    m = read_manifest(plain)  # room for half a layer's rows beside the float pack's fixed part
    budget = resident_bytes(m) + stream_bytes(m) + layer_bytes(m.bundles[0]) // 2
    plans = [build_flash_model(p, FlashConfig("flash", memory_budget=budget), capacity={0: 96, 1: 96},
                               predictors={i: all_neurons(96) for i in range(2)}).flash_stats.plan
             for p in (plain, pack)]
    assert plans[1].resident == read_manifest(pack).resident.length < plans[0].resident
    assert sum(plans[1].capacity.values()) > sum(plans[0].capacity.values())


def test_build_reads_the_manifest_predictors_and_resident_file_once_each(tiny_llama, tmp_path, monkeypatch):
    """A calibrated CATS pack with 8-bit resident linears (convert --gate-bits 4 --resident-bits 8,
    calibrate --kind gate-threshold): building its flash model parses manifest.json and
    predictors.json once each and reads resident.safetensors once (mx.load; the checksum is taken
    over the loaded tensors); flash computes its dense model."""
    from calibration_packs import decode_logits, tiny_cats_pack, write_text
    from mlx_flash import calibrate as calibrate_cli
    from mlx_flash.pack import reader, schema

    pack = tiny_cats_pack(tiny_llama, tmp_path, [0.03, 0.05, 0.04, 0.06], gate_bits=4, resident_bits=8,
                          resident_group_size=32)
    texts = [write_text(tmp_path / f"t{i}.txt", n_words=300, seed=i) for i in range(2)]
    assert calibrate_cli.main(["--model", str(pack), "--text", *map(str, texts), "--kind", "gate-threshold",
                               "--quiet"]) == 0
    ids = [5, 17, 99, 3, 42, 7, 61, 12]
    dense = decode_logits(build_flash_model(pack, FlashConfig("dense")), ids)
    parsed, loaded = [], []
    real_json, real_load = schema.read_json_file, mx.load

    def counting_json(path, what):
        parsed.append(os.path.basename(path))
        return real_json(path, what)

    def counting_load(path, *args, **kwargs):
        loaded.append(os.path.basename(str(path)))
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr("mlx_flash.pack.layout.read_json_file", counting_json)
    monkeypatch.setattr("mlx_flash.sparse.predictor.read_json_file", counting_json)
    monkeypatch.setattr(mx, "load", counting_load)
    monkeypatch.setattr(reader, "file_crc32", lambda path: pytest.fail(f"{path} read a second time"))
    model = build_flash_model(pack, FlashConfig("flash"), lookahead=True)
    assert sorted(parsed) == ["manifest.json", "predictors.json"]
    assert loaded.count("resident.safetensors") == 1
    plan = model.flash_stats.plan
    assert len(plan.capacity) == 4 and model.flash_runtime.lookahead
    np.testing.assert_allclose(decode_logits(model, ids), dense, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("act", ["cats", "product"])
def test_a_relu_llama_mlp_with_its_own_threshold_is_left_unmasked(act):
    """The runtime adds no gate mask where the model's MLP already applies the calibrated rule
    (CATS: |silu(g)| > t; product: |silu(g) u| > t, which no gate mask could express)."""
    import mlx.nn as nn

    from mlx_flash.models import relu_llama as rl
    from mlx_flash.models.flash import masks_like_model

    args = rl.ModelArgs.from_dict({"model_type": "relu_llama", "hidden_size": 8, "num_hidden_layers": 1,
                                   "intermediate_size": 16, "num_attention_heads": 2, "rms_norm_eps": 1e-5,
                                   "vocab_size": 16, "hidden_act": act, "activation_threshold": 0.5})
    mlp = rl.MLP(args, 0.5)
    assert masks_like_model(mlp, 0.5, nn.silu) and masks_like_model(mlp, 0.25, nn.silu)
    assert not masks_like_model(mlp, 0.75, nn.silu)  # a stricter calibrated cut: the runtime masks
    assert not masks_like_model(rl.MLP(rl.ModelArgs.from_dict({**args.__dict__, "hidden_act": "relu",
                                                               "activation_threshold": 0.0})), 0.5, nn.silu)


@pytest.mark.skipif(not __import__("mlx_flash.cpu.ops", fromlist=["x"]).decode_kernel_enabled({}),
                    reason="no sparse-decode kernel (CPU kernels not built, or not Linux AIO)")
def test_decode_primitives_stage_in_the_generating_threads_staging(tiny_llama, tmp_path, monkeypatch):
    """The decode primitives' reads (on the CPU stream's thread) stage in the staging buffer of the
    thread that generates, the one the memory plan counts: no second buffer. That thread waits for
    MLX's pending work before it stages again (no primitive's read may still land there); another
    thread stages in its own buffer, without waiting."""
    from calibration_packs import decode_logits, tiny_cats_pack, write_text
    from mlx_flash import calibrate as calibrate_cli

    pack = tiny_cats_pack(tiny_llama, tmp_path, [0.03, 0.05, 0.04, 0.06], gate_bits=4, dtype="float16")
    text = write_text(tmp_path / "t.txt", n_words=300, seed=0)
    assert calibrate_cli.main(["--model", str(pack), "--text", str(text), "--kind", "gate-threshold", "--quiet"]) == 0
    model = build_flash_model(pack, FlashConfig("flash"), capacity={i: 12 for i in range(4)})
    loader = model.flash_runtime.loader
    decode_logits(model, [5, 17, 99, 3])
    _, staging, owner = loader._stream_reads
    assert owner == threading.get_ident()
    assert np.shares_memory(staging, np.frombuffer(loader._local.staging, np.uint8))
    syncs, real = [], mx.synchronize
    monkeypatch.setattr(mx, "synchronize", lambda *a: syncs.append(threading.get_ident()) or real(*a))
    assert loader._staging(1) is loader._local.staging and syncs == [owner]
    other = []
    worker = threading.Thread(target=lambda: other.append(loader._staging(1)))
    worker.start()
    worker.join()
    assert syncs == [owner] and not np.shares_memory(np.frombuffer(other[0], np.uint8), staging)
