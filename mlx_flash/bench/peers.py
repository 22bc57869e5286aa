"""Peers for `bench run`: mlx-lm (every weight resident) and llama.cpp (llama-cpp-python, default
mmap loading of a GGUF), run cold under the same cap with the same prompt token ids.

mlx-lm runs the model's mlx-lm folder: the source folder of a converted model, or one exported
from the pack (resident tensors + FFN rebuilt from the bundles). Architectures mlx-lm lacks (OPT)
load through mlx-lm's own loader with mlx-flash's model class (models.load_model).

llama.cpp needs a GGUF: the source GGUF when the model came from one (the embedded model), else
one written from the pack. llama.cpp has no OPT architecture, so an OPT-shaped pack is written as
llama.cpp's "gpt2" architecture with the same tensors and bytes (learned positions, pre-LayerNorm,
biases; fused qkv; GELU instead of ReLU, which changes no cost of a dense forward pass): the
speed of a dense run does not depend on the weights' values, and synthetic packs are random anyway.
MoE packs (olmoe, qwen3_moe; 4-bit group 32 = Q4_1) are written with the very same weights.
Both writers live in sources/gguf_export.py. Other pack architectures get no llama.cpp GGUF
here (--gguf FILE gives one).
"""

import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from ..calibration.synthetic import is_synthetic
from ..errors import FlashError
from ..pack import load_pack_weights
from ..model_folder import read_config, write_model_folder
from ..sources import default_gguf_path, write_moe_gguf
from ..sources.gguf_export import write_gpt2_gguf

PEERS = ("mlx-lm", "llama.cpp")
INSTALL_HINT = "pip install '.[peers]' (or scripts/setup.sh --peers) for llama-cpp-python"


def available(name) -> tuple[bool, str]:
    if name == "mlx-lm":
        return importlib.util.find_spec("mlx_lm") is not None, "pip install mlx-lm"
    return importlib.util.find_spec("llama_cpp") is not None, INSTALL_HINT


def choose(spec: str) -> dict:
    """--peers value -> {peer: None (run) or reason it will not run}."""
    spec = (spec or "none").strip()
    if spec == "none":
        return {}
    names = PEERS if spec == "auto" else [s for s in spec.split(",") if s]
    out = {}
    for n in names:
        if n not in PEERS:
            raise FlashError(f"--peers {n}: unknown peer (choose from {', '.join(PEERS)}, auto, none)")
        ok, hint = available(n)
        out[n] = None if ok else f"not installed: {hint}"
    return out


# ---- child functions ----------------------------------------------------------------------------

def generate_mlx_lm(folder, prompt, gen_tokens) -> dict:
    """mlx-lm dense: load every weight, generate greedily; ms per token from mlx-lm's own counts."""
    # a child process; mlx-lm is the peer measured, imported only where it runs
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler
    from mlx_lm.utils import load_model as mlx_lm_load_model
    from mlx_lm.utils import load_tokenizer

    from ..models.loader import load_model, mlx_lm_model_classes

    folder = Path(folder)
    t0 = time.perf_counter()
    config = read_config(folder)
    if mlx_lm_model_classes(config) is not None:
        model, _ = mlx_lm_load_model(folder, lazy=False)
        loader = "mlx_lm.utils.load_model"
    else:  # architecture mlx-lm lacks: its loader with our model class
        model, _ = load_model(folder, lazy=False)
        loader = "mlx_lm.utils.load_model + mlx-flash model class"
    tokenizer = load_tokenizer(folder)
    load_s = time.perf_counter() - t0
    last, stamps, t1 = None, [], time.perf_counter()
    for r in stream_generate(model, tokenizer, list(prompt), max_tokens=gen_tokens,
                             sampler=make_sampler(temp=0.0)):
        stamps.append(time.perf_counter())
        last = r
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"load_s": load_s, "loader": loader, "generation_tps": last.generation_tps,
            "prompt_tps": last.prompt_tps, "tokens": last.generation_tokens,
            "total_ms": 1e3 / last.generation_tps if last.generation_tps else None,
            "prompt_ms": 1e3 * (stamps[0] - t1) if stamps else None,
            "mean_gap_ms": 1e3 * sum(gaps) / len(gaps) if gaps else None,
            "peak_memory": mx.get_peak_memory()}


def generate_llama_cpp(gguf, prompt, gen_tokens, threads=None, temp=0.0, seed=0) -> dict:
    """llama.cpp through llama-cpp-python, default loading (mmap), greedy (or sampled at `temp`);
    ms per decode token from the time between successive tokens."""
    from llama_cpp import Llama  # optional peer (pip install '.[peers]'); available() checks it

    t0 = time.perf_counter()
    llm = Llama(model_path=str(gguf), n_ctx=len(prompt) + gen_tokens + 16,
                n_threads=threads or os.cpu_count(), verbose=False, seed=seed)
    load_s = time.perf_counter() - t0
    stamps, t1 = [], time.perf_counter()
    sampling = {"top_k": 1, "temp": 0.0} if not temp else {"top_k": 0, "temp": temp}
    for tok in llm.generate(list(prompt), top_p=1.0, reset=True, **sampling):
        stamps.append(time.perf_counter())
        if len(stamps) >= gen_tokens:
            break
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"load_s": load_s, "prompt_ms": 1e3 * (stamps[0] - t1) if stamps else None,
            "tokens": len(stamps), "total_ms": 1e3 * sum(gaps) / len(gaps) if gaps else None,
            "use_mmap": True, "n_threads": threads or os.cpu_count()}


# ---- model files for the peers ------------------------------------------------------------------

def export_mlx_folder(pack: Path, out: Path) -> Path:
    """An mlx-lm folder with the pack's whole model (config, one safetensors, tokenizer files)."""
    config, weights = load_pack_weights(pack)
    return write_model_folder(out, weights, config, pack)


# ---- running ------------------------------------------------------------------------------------

def run_peers(suite, names: dict, prompts, out: Path) -> dict:
    """Run every chosen peer --repeats times, cold, under the suite's cap; {peer: result}."""
    results = {}
    info = suite.model_info
    for name, reason in names.items():
        if reason:  # not installed: nothing was measured, so no figures
            results[name] = {"ok": False, "status": "not installed", "error": reason, "note": ""}
            continue
        try:
            path, note = _model_file(name, suite, out)
        except FlashError as e:
            results[name] = {"ok": False, "status": "not run", "error": str(e),
                             "note": "no model file for this peer"}
            continue
        recs = []
        for rep in range(suite.args.repeats):
            if name == "mlx-lm":
                fn, kw = "mlx_flash.bench.peers:generate_mlx_lm", {"folder": str(path)}
            else:
                fn, kw = "mlx_flash.bench.peers:generate_llama_cpp", {"gguf": str(path),
                                                                     "threads": os.cpu_count()}
            kw.update(prompt=prompts[rep]["ids"], gen_tokens=suite.args.gen_tokens)
            if getattr(suite.args, "temp", 0.0) and name == "llama.cpp":
                kw.update(temp=suite.args.temp, seed=rep)
            recs.append(suite.child("peers", name, fn, kw, budget_bytes=suite.budget_bytes,
                                    paths=[path], repeat=rep))
        ok = [r for r in recs if r["ok"]]
        res = {"ok": bool(ok), "status": "ran" if ok else "failed", "model_file": str(path), "note": note,
               "cap_bytes": recs[0]["cap_bytes"],
               "peak_bytes": max((r["peak_bytes"] or 0) for r in recs),
               "error": None if ok else recs[0]["error"]}
        if ok:
            ms = [r["value"]["total_ms"] for r in ok if r["value"].get("total_ms")]
            res["total_ms"] = statistics.fmean(ms) if ms else None
            res["total_ms_std"] = statistics.stdev(ms) if len(ms) > 1 else 0.0
            res["load_s"] = statistics.fmean(r["value"]["load_s"] for r in ok)
            firsts = [r["value"]["prompt_ms"] for r in ok if r["value"].get("prompt_ms") is not None]
            res["prompt_ms"] = statistics.fmean(firsts) if firsts else None
            res["ok"] = res["total_ms"] is not None
        results[name] = res
    return results


def _model_file(name, suite, out: Path):
    info = suite.model_info
    synthetic = " (SYNTHETIC weights)" if _synthetic(suite.pack) else ""
    if name == "mlx-lm":
        if info["mlx_folder"]:
            return Path(info["mlx_folder"]), f"mlx-lm folder of the source model{synthetic}"
        folder = out / "peer-mlx-model"
        if not (folder / "config.json").exists():
            print(f"exporting the pack as an mlx-lm folder for the mlx-lm peer: {folder}",
                  file=sys.stderr)
            export_mlx_folder(suite.pack, folder)
        return folder, f"mlx-lm folder exported from the pack{synthetic}"
    if suite.args.gguf:
        return Path(suite.args.gguf).expanduser(), "GGUF given with --gguf"
    if info["gguf"]:
        return Path(info["gguf"]), "the source GGUF, default mmap loading"
    gguf_path = out / "peer-model.gguf"
    if any(b.kind == "experts" for b in suite.manifest.bundles):
        if not gguf_path.exists():
            print(f"writing a GGUF of the MoE pack for llama.cpp: {gguf_path}", file=sys.stderr)
            write_moe_gguf(suite.pack, gguf_path, default_gguf_path())
        return gguf_path, ("GGUF written from the pack (same weights: 4-bit group-32 experts as "
                           f"Q4_1, lossless), default mmap loading{synthetic}")
    if not gguf_path.exists():
        print(f"writing a GGUF of the pack for llama.cpp: {gguf_path}", file=sys.stderr)
        write_gpt2_gguf(suite.pack, gguf_path, default_gguf_path())
    return gguf_path, ("GGUF written from the pack as llama.cpp's gpt2 architecture (llama.cpp "
                       f"has no OPT; same tensors and bytes, dense), default mmap loading{synthetic}")


def _synthetic(pack):
    return is_synthetic(pack) is not None
