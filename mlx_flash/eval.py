"""python -m mlx_flash.eval: perplexity and greedy-token agreement of a run mode against dense.

    python -m mlx_flash.eval ppl --model PACK --mode flash [--memory-budget 0.65] [--window 5]
        --text FILE [FILE ...] [--max-tokens 1024] [--sequence-length 256] [--json OUT]
    python -m mlx_flash.eval sweep --model PACK --calib-text FILE... --text FILE...
        [--target-sparsity 0.1 0.2 ...] [--rank 64] [--memory-budget 0.65] [--window 5] [--json OUT]

The text is tokenized, cut into sequences of --sequence-length tokens (the remainder dropped, as
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

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from .errors import FlashError
from .flash_config import MODES

DEFAULT_SEQUENCE_LENGTH = 256
DEFAULT_MAX_TOKENS = 1024


def eval_sequences(files, tokenizer, max_tokens=DEFAULT_MAX_TOKENS, seq_len=DEFAULT_SEQUENCE_LENGTH):
    """int32 [n_sequences, seq_len] token ids of the text (at most max_tokens in all)."""
    from .calibrate import text_tokens

    if seq_len < 2:
        raise FlashError(f"--sequence-length {seq_len}: must be at least 2 tokens")
    tokens = text_tokens(files, tokenizer, max_tokens, min_tokens=seq_len)
    n = len(tokens) // seq_len
    return tokens[: n * seq_len].reshape(n, seq_len)


def score_sequences(model, sequences, progress=True, desc="eval"):
    """(nll float64 [positions], greedy int64 [positions]): per position of every sequence but its
    last token, the next token's negative log-likelihood (nats) and the argmax token, computed one
    token per forward pass with a fresh KV cache per sequence."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from tqdm import tqdm

    nll, greedy = [], []
    total = sequences.shape[0] * (sequences.shape[1] - 1)
    with tqdm(total=total, desc=desc, unit="tok", disable=not progress) as bar:
        for seq in sequences:
            cache = make_prompt_cache(model)
            for t in range(len(seq) - 1):
                logits = model(mx.array(seq[t: t + 1])[None], cache=cache)[0, -1].astype(mx.float32)
                loss = mx.logsumexp(logits) - logits[int(seq[t + 1])]
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
    from .api import load

    if not (Path(pack) / "manifest.json").is_file():
        raise FlashError(f"--model {pack}: not a flash pack (no manifest.json; make one with "
                         "python -m mlx_flash.convert --model SRC --out PACK)")
    if all_sparse and mode == "flash":
        from .flash_config import FlashConfig
        from .models import load_tokenizer
        from .models.flash import _pack_predictors, build_flash_model

        model = build_flash_model(pack, FlashConfig("flash", memory_budget=memory_budget, window=window,
                                                    threads=threads),
                                  predictors=_pack_predictors(Path(pack)))
        return model, load_tokenizer(Path(pack))
    return load(str(pack), mode=mode, memory_budget=memory_budget, window=window, threads=threads,
                progress=False)


def dense_reference(pack, files, max_tokens, seq_len, progress=True):
    """(sequences, nll, greedy) of the dense model on the text."""
    from .api import context_length

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
                 progress=True, all_sparse=False) -> dict:
    """Perplexity and greedy agreement of `mode` against dense on the text (see module docstring).

    reference: (sequences, nll, greedy) from dense_reference, to reuse one dense run.
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
    out = {"model": str(pack), "mode": mode, "memory_budget": memory_budget, "window": window,
           "sequence_length": int(seqs.shape[1]), "sequences": int(seqs.shape[0]),
           "all_sparse": bool(all_sparse and mode == "flash"),
           "plan": stats.plan.describe() if stats is not None and stats.plan else None,
           **compare(nll, greedy, ref_nll, ref_greedy), "seconds": seconds,
           "flash_stats": flash_summary(model)}
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
    from .sparse.predictor import PREDICTORS_FILE, PREDICTORS_JSON

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
    import shutil

    from .calibrate import collect_inputs, fit_predictors

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


# ---- CLI -------------------------------------------------------------------------------------------

def _common(p):
    p.add_argument("--model", required=True, help="a flash pack (python -m mlx_flash.convert --out PACK)")
    p.add_argument("--text", nargs="+", required=True, metavar="FILE", help="evaluation text files (UTF-8)")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help=f"evaluate at most this many tokens (default {DEFAULT_MAX_TOKENS})")
    p.add_argument("--sequence-length", type=int, default=DEFAULT_SEQUENCE_LENGTH,
                   help=f"tokens per sequence, each with a fresh KV cache (default {DEFAULT_SEQUENCE_LENGTH})")
    p.add_argument("--memory-budget", default=None,
                   help="fraction of the pack (0.65) or size (6GB) for weights (default: no limit; "
                        "sweep: 0.65)")
    p.add_argument("--window", type=int, default=5, help="flash: neuron-cache window in tokens (default 5)")
    p.add_argument("--threads", type=int, default=32, help="parallel flash reads (default 32)")
    p.add_argument("--json", default=None, metavar="OUT", help="also write the results as JSON ('-' = stdout)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--verbose", action="store_true", help="show tracebacks on errors")


def build_parser():
    from .calibrate import DEFAULTS, KINDS

    parser = argparse.ArgumentParser(prog="python -m mlx_flash.eval",
                                     description="Perplexity and greedy agreement against dense.")
    sub = parser.add_subparsers(dest="command", required=True)
    ppl = sub.add_parser("ppl", help="perplexity of one mode vs dense on the same text")
    _common(ppl)
    ppl.add_argument("--mode", choices=MODES, default="flash", help="run mode to evaluate (default flash)")
    ppl.add_argument("--all-sparse", action="store_true",
                     help="flash: run every layer with its predictor and neuron cache instead of the "
                          "per-layer memory plan (measures the predictors' effect on quality)")
    sw = sub.add_parser("sweep", help="calibrate at several target sparsities, evaluate each in flash mode")
    _common(sw)
    sw.add_argument("--calib-text", nargs="+", required=True, metavar="FILE",
                    help="calibration text files (must not overlap --text)")
    sw.add_argument("--calib-tokens", type=int, default=16384, help="calibration tokens (default 16384)")
    sw.add_argument("--target-sparsity", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.4, 0.5],
                    help="target sparsities to calibrate (default 0.1 0.2 0.3 0.4 0.5)")
    sw.add_argument("--kind", choices=KINDS, default=None, help="predictor kind (calibrate's default)")
    sw.add_argument("--rank", type=int, default=None, help=f"predictor rank (default {DEFAULTS['rank']})")
    sw.add_argument("--recall", type=float, default=None,
                    help=f"low-rank-gate target recall (default {DEFAULTS['recall']})")
    sw.add_argument("--threshold", type=float, default=None, help="low-rank sigmoid cutoff")
    sw.add_argument("--markdown", default=None, metavar="OUT", help="write the curve as a markdown table")
    return parser


def _write_json(dest, obj):
    text = json.dumps(obj, indent=1)
    if dest == "-":
        print(text)
        return
    path = Path(dest)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _main(argv):
    args = build_parser().parse_args(argv)
    if args.max_tokens < 2:
        raise FlashError(f"--max-tokens {args.max_tokens}: must be at least 2")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    progress = not args.quiet
    if args.command == "ppl":
        r = evaluate_ppl(args.model, args.text, mode=args.mode, memory_budget=args.memory_budget,
                         window=args.window, threads=args.threads, max_tokens=args.max_tokens,
                         seq_len=args.sequence_length, progress=progress, all_sparse=args.all_sparse)
        print(format_ppl(r))
        if args.json:
            _write_json(args.json, r)
        return 0
    budget = 0.65 if args.memory_budget is None else args.memory_budget
    rows = sweep(args.model, args.calib_text, args.text, target_sparsities=args.target_sparsity,
                 memory_budget=budget, window=args.window, threads=args.threads,
                 max_tokens=args.max_tokens, seq_len=args.sequence_length,
                 calib_tokens=args.calib_tokens, progress=progress, kind=args.kind, rank=args.rank,
                 recall=args.recall, threshold=args.threshold)
    table = format_sweep(rows)
    print(table)
    if args.markdown:
        path = Path(args.markdown)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(table + "\n")
        os.replace(tmp, path)
    if args.json:
        _write_json(args.json, rows)
    return 0


def main(argv=None):
    from .cli import run_cli

    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
