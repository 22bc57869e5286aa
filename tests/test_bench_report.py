"""bench/report.py: every printed figure is one the run measured, with its denominator; a peer that
is not installed is "not installed", nothing more."""

from mlx_flash.bench.report import _table3_md, byte_ratios, flash_sparsity_line, speedup_line, speedups, table3_rows


def test_peer_not_installed_has_no_figures():
    result = {"modes": {}, "peers": {"llama.cpp": {"ok": False, "status": "not installed",
                                                   "error": "not installed: pip install llama-cpp-python",
                                                   "note": ""}}}
    result["table3"] = table3_rows(result)
    (row,) = [line for line in _table3_md(result) if line.startswith("| llama.cpp")]
    assert "not installed" in row and "does not fit" not in row and "0.00" not in row


def test_failed_peer_keeps_its_measured_peak():
    result = {"modes": {}, "peers": {"mlx-lm": {"ok": False, "status": "failed", "error": "OOM",
                                                "peak_bytes": 2.5e9, "cap_bytes": 2e9}}}
    result["table3"] = table3_rows(result)
    (row,) = [line for line in _table3_md(result) if line.startswith("| mlx-lm")]
    assert "does not fit / failed: OOM" in row and "2.50 (2.00)" in row


def test_flash_sparsity_line_names_its_denominator():
    none_sparse = flash_sparsity_line({"active_fraction": 5.0, "sparse_layers": 0, "ffn_layers": 30})
    assert "no layer sparse" in none_sparse and "%" not in none_sparse
    some = flash_sparsity_line({"active_fraction": 0.42, "sparse_layers": 12, "ffn_layers": 30})
    assert "42.0% of the model's FFN neurons" in some and "12 of 30 layers ran sparse" in some


def test_table3_prints_each_rows_first_prompt_time_in_its_own_column():
    mode = {"ok_runs": 1, "errors": [], "peak_bytes": 4e8, "cap_bytes": 5e8, "io_ms": 20.0, "mem_ms": 1.0,
            "compute_ms": 30.0, "total_ms": 51.0, "total_ms_std": 0.5, "bytes_read": 2.7e7, "hit_rate": 0.8,
            "plan_weights_bytes": 1.2e8, "prompt_ms": 2705.4}
    result = {"modes": {"flash": mode, "naive": {**mode, "prompt_ms": None}},
              "peers": {"llama.cpp": {"ok": True, "status": "ran", "total_ms": 40.0, "total_ms_std": 1.0,
                                      "peak_bytes": 3e8, "cap_bytes": 5e8, "prompt_ms": 812.25}}}
    result["table3"] = table3_rows(result)
    lines = _table3_md(result)
    header = lines[0].strip("|").split("|")
    col = [h.strip() for h in header].index("prompt ms")
    cells = {line.split("|")[1].strip(): line.strip("|").split("|")[col].strip() for line in lines[2:]}
    assert cells == {"flash": "2705.4", "naive": "-", "llama.cpp": "812.2"}
    assert all(line.count("|") == lines[0].count("|") for line in lines)


def test_speedup_line_puts_the_byte_ratios_of_the_modes_beside_the_speedups():
    def mode(total_ms, bytes_read):
        return {"ok_runs": 1, "errors": [], "peak_bytes": 4e8, "cap_bytes": 5e8, "io_ms": 1.0, "mem_ms": 0.0,
                "compute_ms": 1.0, "total_ms": total_ms, "total_ms_std": 0.0, "bytes_read": bytes_read,
                "hit_rate": 0.0, "plan_weights_bytes": 1e8, "prompt_ms": 1.0}
    result = {"modes": {"naive": mode(138.0, 106.5e6), "hybrid": mode(100.0, 74.6e6), "flash": mode(50.0, 38.8e6)},
              "peers": {"llama.cpp": {"ok": True, "status": "ran", "total_ms": 40.0, "peak_bytes": 3e8,
                                      "cap_bytes": 5e8}}}
    result["speedups"] = speedups(result)
    assert byte_ratios(result) == {"flash_vs_naive": 106.5e6 / 38.8e6, "flash_vs_hybrid": 74.6e6 / 38.8e6}
    line = speedup_line(result)
    assert line.startswith("naive 2.76x, hybrid 2.00x, llama.cpp 0.80x")
    assert line.endswith("(bytes read per token: naive 2.74x flash's, hybrid 1.92x flash's)")
    result["modes"]["flash"]["bytes_read"] = 0  # a flash run that read nothing (all resident): no ratio
    assert speedup_line(result) == "naive 2.76x, hybrid 2.00x, llama.cpp 0.80x"
