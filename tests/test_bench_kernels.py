"""bench kernels: runs end to end on tiny sizes (speed is never asserted here)."""

import json
import os

import pytest

from mlx_flash.bench.__main__ import main


def test_kernels_bench_reports(embedded_model_dir, tiny_llama, tmp_path, capsys):
    import shutil

    from mlx_flash.cpu import ops

    if not ops.EXTENSION_AVAILABLE:
        pytest.skip(f"mlx_flash._ext not built ({ops.EXTENSION_ERROR})")
    # a tiny random 4-bit llama with the embedded model's tokenizer (fast to generate with)
    model = tiny_llama("m", quantize=(4, 32), vocab=49152)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded_model_dir / name, model / name)
    out = tmp_path / "kernels.json"
    # a model folder (not a GGUF): the llama.cpp column is skipped with its reason
    assert main(["kernels", "--only", "smollm2 k/v", "--working-set", "1", "--repeats", "1",
                 "--bandwidth-mib", "8", "--generate", str(model), "--max-tokens", "4", "--prompt-tokens", "16",
                 "--gen-repeats", "1", "--breakdown", "--warm", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    b = result["decode_breakdown"]
    assert b["matvecs"] == 15 and 0 < b["matvecs_ms"] and b["step_ms"] > 0 and b["weight_bytes"] > 0
    # 2 fused blocks x 3 primitives, the final norm, the lm_head and the quantized embedding lookup's
    # ops (MLX ops: several hundred)
    assert 8 <= b["step_primitives"] < 100 and b["step_primitives_mlx"] > 3 * b["step_primitives"]
    assert 0 < b["build_ms"] < b["step_ms"]
    assert result["reference_bandwidth_gbs"] > 0 and "kernels" in result["command"]
    assert result["machine"]["cpus"] >= 1 and result["packages"]["mlx"]  # as bench run and io record them
    (case,) = result["cases"]
    assert case["kind"] == "q4g32" and case["N"] == 192 and case["K"] == 576
    assert case["bytes_per_call"] == 192 * (576 // 2 + 4 * 576 // 32)  # packed 4-bit + f16 scales/biases
    assert case["ours_gbs"] > 0 and case["mlx_gbs"] > 0 and case["ours_fraction"] > 0 and case["warm_gbs"] > 0
    g = result["generate"]
    assert g["mlx"]["layers_patched"] == 0 and g["mlx_flash"]["layers_patched"] == 22
    assert g["mlx"]["generation_tps"] > 0 and g["mlx_flash"]["generation_tps"] > 0
    assert g["mlx_flash"]["generated_tokens"] == 4 and g["prompt_tokens"] > 5
    assert "llama.cpp" not in g and g["llama_cpp_missing"]
    assert g["prompt"]["tokens"] == 16 and set(g["prompt"]["tps"]) == {"mlx", "mlx_flash"}
    assert all(v > 0 for v in g["prompt"]["tps"].values())
    text = capsys.readouterr().out
    assert "llama.cpp: skipped" in text and "command: python" in text and "16-token prompt" in text


def test_kernels_bench_compares_greedy_tokens_by_shared_prefix(capsys):
    from mlx_flash.bench import kernels

    assert kernels._shared_prefix([5, 6, 7, 8], [5, 6, 9, 8]) == 2
    assert kernels._shared_prefix([5, 6], [5, 6, 7]) == 2 and kernels._shared_prefix([], [1]) == 0
    engine = {"generation_tps": 50.0, "generated_tokens": 8, "layers_patched": 3}
    kernels._print_generate({
        "model": "m", "prompt_tokens": 4, "max_tokens": 8, "threads": 2, "mlx": dict(engine),
        "mlx_flash": dict(engine), "mlx_flash_q8x": dict(engine), "llama.cpp": dict(engine),
        "speedup_over_mlx": 1.0, "same_greedy_tokens_as_mlx": True, "q8x_same_greedy_tokens_as_mlx": False,
        "fraction_of_llama_cpp": 1.0, "q8x_fraction_of_llama_cpp": 1.0,
        "same_first_tokens_as_llama_cpp": 5, "q8x_same_first_tokens_as_llama_cpp": 7,
        "prompt": {"tokens": 256, "tps": {"mlx": 10.0, "mlx_flash": 300.0, "llama.cpp": 200.0}}})
    out = capsys.readouterr().out
    assert "same first 5 tokens (--q8-activations: 7)" in out
    assert "300.0 tok/s, 30.0x MLX, 1.50x llama.cpp" in out and "256-token prompt" in out


def test_kernels_bench_refuses_no_kernels_without_generate(capsys):
    with pytest.raises(SystemExit) as e:
        main(["kernels", "--no-kernels"])
    assert e.value.code == 2 and "--no-kernels" in capsys.readouterr().err


@pytest.mark.parametrize("flag,value", [("--prompt-tokens", "-1"), ("--gen-repeats", "0"), ("--max-tokens", "0")])
def test_kernels_bench_refuses_counts_out_of_range(flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        main(["kernels", "--no-kernels", "--generate", flag, value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"{flag}: must be at least" in err and len(err.strip().splitlines()) == 1


def test_llama_cpp_crash_is_a_row_not_the_end(tmp_path, monkeypatch):
    """A llama.cpp that segfaults (as 0.3.36's AMX matmul does on some Intel machines) runs in a
    child process: the benchmark gets a 'crashed' reason and goes on."""
    import argparse
    import sys

    from mlx_flash.bench import kernels

    fake = tmp_path / "llama_cpp"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "import ctypes\n\nclass Llama:\n    def __init__(self, **kw):\n        ctypes.string_at(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}")
    args = argparse.Namespace(max_tokens=4, gen_repeats=1)
    value, why = kernels._llama_cpp_in_child(tmp_path / "m.gguf", 1, [1, 2, 3], args, None)
    assert value is None and why == "crashed in its child process (SIGSEGV)"
    sys.modules.pop("llama_cpp", None)
