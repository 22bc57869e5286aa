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
Other pack architectures get no llama.cpp GGUF here (--gguf FILE gives one).
"""

import importlib.util
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..calibration.synthetic import is_synthetic
from ..errors import FlashError
from ..pack import load_pack_weights
from ..paths import atomic_output_dir
from ..sources import default_gguf_path

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
    config = json.loads((folder / "config.json").read_text())
    if mlx_lm_model_classes(config) is not None:
        model, _ = mlx_lm_load_model(folder, lazy=False)
        loader = "mlx_lm.utils.load_model"
    else:  # architecture mlx-lm lacks: its loader with our model class
        model, _ = load_model(folder, lazy=False)
        loader = "mlx_lm.utils.load_model + mlx-flash model class"
    tokenizer = load_tokenizer(folder)
    load_s = time.perf_counter() - t0
    last, stamps = None, []
    for r in stream_generate(model, tokenizer, list(prompt), max_tokens=gen_tokens,
                             sampler=make_sampler(temp=0.0)):
        stamps.append(time.perf_counter())
        last = r
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"load_s": load_s, "loader": loader, "generation_tps": last.generation_tps,
            "prompt_tps": last.prompt_tps, "tokens": last.generation_tokens,
            "total_ms": 1e3 / last.generation_tps if last.generation_tps else None,
            "mean_gap_ms": 1e3 * sum(gaps) / len(gaps) if gaps else None,
            "peak_memory": mx.get_peak_memory()}


def generate_llama_cpp(gguf, prompt, gen_tokens, threads=None) -> dict:
    """llama.cpp through llama-cpp-python, default loading (mmap), greedy; ms per decode token
    from the time between successive tokens."""
    from llama_cpp import Llama  # optional peer (pip install '.[peers]'); available() checks it

    t0 = time.perf_counter()
    llm = Llama(model_path=str(gguf), n_ctx=len(prompt) + gen_tokens + 16,
                n_threads=threads or os.cpu_count(), verbose=False)
    load_s = time.perf_counter() - t0
    stamps, t1 = [], time.perf_counter()
    for tok in llm.generate(list(prompt), top_k=1, top_p=1.0, temp=0.0, reset=True):
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
    with atomic_output_dir(out) as tmp:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for f in pack.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens")):
                shutil.copy(f, tmp / f.name)
    return out


def write_gpt2_gguf(pack: Path, out: Path, tokenizer_gguf: Path) -> Path:
    """A llama.cpp GGUF (architecture "gpt2") with the tensors of an OPT-shaped pack; the
    tokenizer metadata comes from `tokenizer_gguf` (the embedded model's, the synthetic packs'
    tokenizer), padded with control tokens to the pack's vocabulary size."""
    import gguf  # optional (the test extra); only llama.cpp peers need it

    config, w = load_pack_weights(pack)
    if config.get("model_type") != "opt":
        raise FlashError(f"{pack}: llama.cpp GGUF export is written for OPT-shaped packs only "
                         f"(this is {config.get('model_type')}); pass --gguf FILE")
    reader = gguf.GGUFReader(str(tokenizer_gguf))
    hidden, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    ctx = config["max_position_embeddings"]

    def np_(a):
        a = a.astype(mx.float32) if a.dtype == mx.bfloat16 else a
        return np.array(a)

    tmp = out.with_name(f".{out.stem}.tmp-{os.getpid()}{out.suffix}")
    writer = gguf.GGUFWriter(str(tmp), "gpt2")
    writer.add_name(f"mlx-flash synthetic export of {pack.name}")
    writer.add_context_length(ctx)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(config["ffn_dim"])
    writer.add_block_count(layers)
    writer.add_head_count(config["num_attention_heads"])
    writer.add_layer_norm_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    tokens = [bytes(reader.fields["tokenizer.ggml.tokens"].parts[i])
              for i in reader.fields["tokenizer.ggml.tokens"].data]
    types = [int(reader.fields["tokenizer.ggml.token_type"].parts[i][0])
             for i in reader.fields["tokenizer.ggml.token_type"].data]
    merges = [bytes(reader.fields["tokenizer.ggml.merges"].parts[i])
              for i in reader.fields["tokenizer.ggml.merges"].data]
    for i in range(len(tokens), vocab):
        tokens.append(f"<|synthetic_{i}|>".encode())
        types.append(gguf.TokenType.CONTROL)
    writer.add_tokenizer_model("gpt2")
    if "tokenizer.ggml.pre" in reader.fields:
        f = reader.fields["tokenizer.ggml.pre"]
        writer.add_tokenizer_pre(bytes(f.parts[f.data[0]]).decode())
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for key in ("bos", "eos"):
        f = reader.fields.get(f"tokenizer.ggml.{key}_token_id")
        if f is not None:
            getattr(writer, f"add_{key}_token_id")(int(f.parts[f.data[0]][0]))
    d = "model.decoder."
    writer.add_tensor("token_embd.weight", np_(w[d + "embed_tokens.weight"]))
    writer.add_tensor("position_embd.weight", np_(w[d + "embed_positions.weight"][2: 2 + ctx]))
    writer.add_tensor("output_norm.weight", np_(w[d + "final_layer_norm.weight"]).astype(np.float32))
    writer.add_tensor("output_norm.bias", np_(w[d + "final_layer_norm.bias"]).astype(np.float32))
    for i in range(layers):
        p, b = f"{d}layers.{i}.", f"blk.{i}."

        def t(name):
            return np_(w[p + name])

        qkv = np.concatenate([t(f"self_attn.{n}_proj.weight") for n in "qkv"])
        qkv_b = np.concatenate([t(f"self_attn.{n}_proj.bias") for n in "qkv"]).astype(np.float32)
        pairs = {"attn_norm": "self_attn_layer_norm", "ffn_norm": "final_layer_norm"}
        for g, o in pairs.items():
            writer.add_tensor(f"{b}{g}.weight", t(f"{o}.weight").astype(np.float32))
            writer.add_tensor(f"{b}{g}.bias", t(f"{o}.bias").astype(np.float32))
        writer.add_tensor(f"{b}attn_qkv.weight", qkv)
        writer.add_tensor(f"{b}attn_qkv.bias", qkv_b)
        writer.add_tensor(f"{b}attn_output.weight", t("self_attn.out_proj.weight"))
        writer.add_tensor(f"{b}attn_output.bias", t("self_attn.out_proj.bias").astype(np.float32))
        writer.add_tensor(f"{b}ffn_up.weight", t("fc1.weight"))
        writer.add_tensor(f"{b}ffn_up.bias", t("fc1.bias").astype(np.float32))
        writer.add_tensor(f"{b}ffn_down.weight", t("fc2.weight"))
        writer.add_tensor(f"{b}ffn_down.bias", t("fc2.bias").astype(np.float32))
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        tmp.replace(out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out


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
    if not gguf_path.exists():
        print(f"writing a GGUF of the pack for llama.cpp: {gguf_path}", file=sys.stderr)
        write_gpt2_gguf(suite.pack, gguf_path, default_gguf_path())
    return gguf_path, ("GGUF written from the pack as llama.cpp's gpt2 architecture (llama.cpp "
                       f"has no OPT; same tensors and bytes, dense), default mmap loading{synthetic}")


def _synthetic(pack):
    return is_synthetic(pack) is not None
