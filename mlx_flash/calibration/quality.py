"""Quality of a run mode: perplexity and greedy-token agreement against dense, and the
sparsity-vs-perplexity sweep (predictors calibrated at several target sparsities, each evaluated).

The text is tokenized, cut into sequences of `seq_len` tokens (the remainder dropped, as
mlx-lm's perplexity does) and each sequence is run one token at a time with a fresh KV cache, the
way generation runs: every step is a decode step, so the predictor, the neuron cache and its window
see exactly what they see when generating. The dense model runs the same sequences the same way;
per position we keep the negative log-likelihood of the next token and the greedy (argmax) token.
Reported: perplexity (and mlx-lm's delta-method standard error), the dense perplexity, their
ratio, and agreement = the fraction of positions whose greedy token equals dense's.

`sweep` calibrates predictors at several target sparsities (one dense pass over the calibration
text, reused), writes each into a scratch view of the pack (symlinks + its own predictors files;
the pack itself is not touched) and evaluates it in flash mode: the sparsity-vs-perplexity curve.
"""

import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache
from tqdm import tqdm

from ..config import FlashConfig
from ..errors import FlashError
from ..models import build_flash_model, context_length, load, load_tokenizer
from ..models.flash import pack_predictors
from ..nll import token_nll
from ..sparse.predictor import PREDICTORS_FILE, PREDICTORS_JSON
from .dense_pass import collect_inputs, text_tokens
from .fit import fit_predictors

DEFAULT_SEQUENCE_LENGTH = 256
DEFAULT_MAX_TOKENS = 1024


def eval_sequences(files, tokenizer, max_tokens=DEFAULT_MAX_TOKENS, seq_len=DEFAULT_SEQUENCE_LENGTH):
    """int32 [n_sequences, seq_len] token ids of the text (at most max_tokens in all)."""
    if seq_len < 2:
        raise FlashError(f"--sequence-length {seq_len}: must be at least 2 tokens")
    tokens = text_tokens(files, tokenizer, max_tokens, min_tokens=seq_len)
    n = len(tokens) // seq_len
    return tokens[: n * seq_len].reshape(n, seq_len)


def score_sequences(model, sequences, progress=True, desc="eval"):
    """(nll float64 [positions], greedy int64 [positions]): per position of every sequence but its
    last token, the next token's negative log-likelihood (nats) and the argmax token, computed one
    token per forward pass with a fresh KV cache per sequence."""
    nll, greedy = [], []
    total = sequences.shape[0] * (sequences.shape[1] - 1)
    with tqdm(total=total, desc=desc, unit="tok", disable=not progress) as bar:
        for seq in sequences:
            cache = make_prompt_cache(model)
            for t in range(len(seq) - 1):
                logits = model(mx.array(seq[t: t + 1])[None], cache=cache)[0, -1].astype(mx.float32)
                loss = token_nll(logits, mx.array(int(seq[t + 1])))
                best = mx.argmax(logits)
                mx.eval(loss, best)
                nll.append(loss.item())
                greedy.append(best.item())
                bar.update(1)
    stats = getattr(model, "flash_stats", None)
    if stats is not None:
        stats.finish()
    return np.asarray(nll, np.float64), np.asarray(greedy, np.int64)


def perplexity(nll) -> tuple:
    """(perplexity, standard error) from per-token NLLs, as mlx_lm.perplexity computes them."""
    mean = float(np.mean(nll))
    ppl = math.exp(mean)
    se = float(np.std(nll, ddof=1)) / math.sqrt(len(nll)) if len(nll) > 1 else 0.0
    return ppl, ppl * se


def compare(nll, greedy, ref_nll, ref_greedy) -> dict:
    """Perplexity of a run vs the dense reference on the same positions."""
    ppl, se = perplexity(nll)
    ref_ppl, ref_se = perplexity(ref_nll)
    return {"tokens": int(len(nll)), "ppl": ppl, "ppl_se": se, "dense_ppl": ref_ppl,
            "dense_ppl_se": ref_se, "ppl_ratio": ppl / ref_ppl,
            "agreement": float(np.mean(greedy == ref_greedy))}


def load_mode(pack, mode, memory_budget=None, window=5, threads=32, all_sparse=False):
    """(model, tokenizer) of a flash pack run in `mode`.

    all_sparse (flash): every layer runs predictor + neuron cache, instead of the per-layer plan
    (which streams or keeps resident the layers whose predictor would save no reads): measures
    the predictors' effect on quality everywhere."""
    if not (Path(pack) / "manifest.json").is_file():
        raise FlashError(f"--model {pack}: not a flash pack (no manifest.json; make one with "
                         "python -m mlx_flash.convert --model SRC --out PACK)")
    if all_sparse and mode == "flash":
        model = build_flash_model(pack, FlashConfig("flash", memory_budget=memory_budget, window=window,
                                                    threads=threads),
                                  predictors=pack_predictors(Path(pack)))
        return model, load_tokenizer(Path(pack))
    config = FlashConfig(mode, memory_budget=memory_budget, window=window, threads=threads)
    return load(str(pack), config, progress=False)


def dense_reference(pack, files, max_tokens, seq_len, progress=True):
    """(sequences, nll, greedy) of the dense model on the text."""
    model, tokenizer = load_mode(pack, "dense")
    limit = context_length(model)
    if limit is not None and seq_len > limit:
        raise FlashError(f"--sequence-length {seq_len}: longer than the model's context of {limit} tokens")
    seqs = eval_sequences(files, tokenizer, max_tokens, seq_len)
    nll, greedy = score_sequences(model, seqs, progress, desc="dense")
    return seqs, nll, greedy


def flash_summary(model) -> dict:
    """The flash runtime's per-token numbers (sparse/stats.py), or {} for a plain model."""
    stats = getattr(model, "flash_stats", None)
    if stats is None:
        return {}
    s = stats.summary()
    keys = ("io_ms", "mem_ms", "compute_ms", "total_ms", "bytes_read", "neurons_loaded", "hit_rate",
            "window", "peak_memory", "budget", "weights_bytes")
    return {k: s[k] for k in keys}


def evaluate_ppl(pack, files, *, mode="dense", memory_budget=None, window=5, threads=32,
                 max_tokens=DEFAULT_MAX_TOKENS, seq_len=DEFAULT_SEQUENCE_LENGTH, reference=None,
                 progress=True, all_sparse=False, source=None) -> dict:
    """Perplexity and greedy agreement of `mode` against dense on the text (see module docstring).

    reference: (sequences, nll, greedy) from dense_reference, to reuse one dense run.
    source: a --model value (GGUF file, model folder) the pack was converted from: its perplexity
    on the same sequences is added as "source_ppl" (is the pack's dense model the source's?).
    Returns compare()'s dict plus mode settings, seconds and the flash runtime's per-token stats.
    """
    seqs, ref_nll, ref_greedy = reference or dense_reference(pack, files, max_tokens, seq_len, progress)
    model, _ = load_mode(pack, mode, memory_budget, window, threads, all_sparse)
    stats = getattr(model, "flash_stats", None)
    if stats is not None:
        stats.reset()
    t0 = time.perf_counter()
    nll, greedy = score_sequences(model, seqs, progress, desc=mode)
    seconds = time.perf_counter() - t0
    budget = getattr(memory_budget, "value", memory_budget)  # as the caller gave it (JSON)
    out = {"model": str(pack), "mode": mode, "memory_budget": budget, "window": window,
           "sequence_length": int(seqs.shape[1]), "sequences": int(seqs.shape[0]),
           "all_sparse": bool(all_sparse and mode == "flash"),
           "plan": stats.plan.describe() if stats is not None and stats.plan else None,
           **compare(nll, greedy, ref_nll, ref_greedy), "seconds": seconds,
           "flash_stats": flash_summary(model)}
    if source is not None:
        src_model, _ = load(source, progress=progress)
        src_nll, _ = score_sequences(src_model, seqs, progress, desc="source")
        out["source"], out["source_ppl"] = str(source), float(np.exp(src_nll.mean()))
    return out


def format_ppl(r: dict) -> str:
    lines = [f"Model: {r['model']}  mode {r['mode']}"
             + (f", memory budget {r['memory_budget']}" if r["memory_budget"] is not None else "")
             + (f", window {r['window']}" if r["mode"] == "flash" else "")
             + (", every layer sparse" if r.get("all_sparse") else ""),
             f"Tokens: {r['tokens']} ({r['sequences']} sequences of {r['sequence_length']})",
             f"Perplexity: {r['ppl']:.3f} ± {r['ppl_se']:.3f}   dense {r['dense_ppl']:.3f} ± "
             f"{r['dense_ppl_se']:.3f}   ratio {r['ppl_ratio']:.4f} ({100 * (r['ppl_ratio'] - 1):+.2f}%)",
             f"Greedy agreement with dense: {100 * r['agreement']:.2f}%"]
    if r.get("source_ppl") is not None:
        lines.append(f"Source model {r['source']}: perplexity {r['source_ppl']:.3f}; the pack's dense "
                     f"model {100 * (r['dense_ppl'] / r['source_ppl'] - 1):+.2f}% vs the source")
    fs = r.get("flash_stats")
    if fs:
        hit = "n/a" if fs["hit_rate"] is None else f"{100 * fs['hit_rate']:.1f}%"
        lines.append(f"Per token: {fs['neurons_loaded']:.0f} neurons loaded, {fs['bytes_read'] / 1e6:.2f} MB "
                     f"read, cache hit rate {hit}, {fs['total_ms']:.1f} ms")
    if r.get("plan"):
        lines.append(f"Memory plan: {r['plan']}")
    return "\n".join(lines)


# ---- sweep: the sparsity-vs-perplexity curve -----------------------------------------------------

def pack_view(pack: Path, parent: Path) -> Path:
    """A directory of symlinks to `pack`'s files (not its predictors), for scratch predictors."""
    view = Path(tempfile.mkdtemp(prefix="pack-view-", dir=parent))
    for entry in pack.iterdir():
        if entry.name not in (PREDICTORS_FILE, PREDICTORS_JSON) and not entry.name.startswith("."):
            os.symlink(entry.resolve(), view / entry.name)
    return view


def sweep(pack, calib_files, eval_files, *, target_sparsities, memory_budget=0.65, window=5,
          threads=32, max_tokens=DEFAULT_MAX_TOKENS, seq_len=DEFAULT_SEQUENCE_LENGTH,
          calib_tokens=16384, progress=True, out=None, **settings) -> list:
    """Rows of the sparsity-vs-perplexity curve: for each target sparsity, predictors calibrated on
    calib_files (settings: see calibrate.resolve_settings) evaluated in flash mode on eval_files,
    with every layer sparse (the predictors' effect on quality, whatever the memory plan picks)."""
    pack = Path(pack)
    say = (lambda *a: print(*a, file=out or sys.stdout, flush=True)) if progress else (lambda *a: None)
    overlap = {Path(f).resolve() for f in calib_files} & {Path(f).resolve() for f in eval_files}
    if overlap:
        raise FlashError(f"--text: {sorted(map(str, overlap))[0]} is also calibration text; "
                         "calibration and evaluation texts must be disjoint")
    reference = dense_reference(pack, eval_files, max_tokens, seq_len, progress)
    data = collect_inputs(pack, calib_files, max_tokens=calib_tokens, progress=progress)
    scratch = Path(tempfile.mkdtemp(prefix="mlx-flash-sweep-"))
    rows = []
    try:
        for sparsity in target_sparsities:
            view = pack_view(pack, scratch)
            doc = fit_predictors(data, view, target_sparsity=sparsity, progress=progress, **settings)
            layer_stats = [e["stats"] for e in doc["layers"].values()]
            r = evaluate_ppl(view, eval_files, mode="flash", memory_budget=memory_budget,
                             window=window, threads=threads, max_tokens=max_tokens, seq_len=seq_len,
                             reference=reference, progress=progress, all_sparse=True)
            r.update(model=str(pack), target_sparsity=sparsity, kind=doc["calibration"]["kind"],
                     rank=doc["calibration"]["rank"], recall_setting=doc["calibration"]["recall"],
                     calib_tokens=doc["calibration"]["tokens"],
                     active=float(np.mean([s["active"] for s in layer_stats])),
                     predicted=float(np.mean([s["predicted"] for s in layer_stats])),
                     recall=float(np.mean([s["recall"] for s in layer_stats])))
            rows.append(r)
            say(format_ppl(r))
            shutil.rmtree(view)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return rows


def format_sweep(rows) -> str:
    """Markdown table of sweep rows."""
    head = ("| target sparsity | kind | rank | active % | predicted % | recall % | flash ppl | dense ppl "
            "| ppl vs dense | greedy agreement | neurons loaded / token | MB read / token | hit rate |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        fs = r["flash_stats"]
        hit = "n/a" if fs.get("hit_rate") is None else f"{100 * fs['hit_rate']:.1f}%"
        lines.append(f"| {r['target_sparsity']:g} | {r['kind']} | {r['rank']} | {100 * r['active']:.1f} | "
                     f"{100 * r['predicted']:.1f} | {100 * r['recall']:.1f} | {r['ppl']:.3f} | "
                     f"{r['dense_ppl']:.3f} | {100 * (r['ppl_ratio'] - 1):+.2f}% | "
                     f"{100 * r['agreement']:.1f}% | {fs['neurons_loaded']:.0f} | "
                     f"{fs['bytes_read'] / 1e6:.2f} | {hit} |")
    return "\n".join(lines)
