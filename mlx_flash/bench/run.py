"""The purge-aware benchmark suite: the paper's protocol, tables and figures on one model.

    python -m mlx_flash.bench run --model PACK --modes dense,naive,hybrid,flash \\
        --memory-budget 0.5 [--cap] [--prompt-tokens 128 --gen-tokens 256] [--repeats N] \\
        [--ablation] [--sweeps budget,window,length] [--peers auto] --out DIR

Protocol (paper section 4.1, DESIGN.md "Honest measurement"): prompts are the first
--prompt-tokens tokens of real text (one document per repeat: --text files, or by default the
reStructuredText sources of Python's documentation that Debian's python3-doc installs), then
--gen-tokens generated tokens. Every run is a fresh child process started after the files it
reads were evicted from the page cache (the method and the residency left are reported). With
--cap each child runs inside a cgroup v1 memory cap (bench/cap.py) of the memory budget plus the
process's own measured baseline (interpreter, MLX, tokenizer) and the KV cache, so the page cache
cannot hide I/O; peers run under the same cap with the same prompts. Mean and standard deviation
over --repeats. Output: DIR/results.json (every figure, machine, package versions, command),
DIR/report.md with tables and PNG plots, and a printed summary.
"""

import glob
import os
import shlex
import shutil
import statistics
import sys
import time
import zlib
from pathlib import Path
from types import SimpleNamespace

from ..calibration.synthetic import is_synthetic
from ..config import parse_memory_budget
from ..cpu import ops
from ..errors import FlashError
from ..io import FlashLoader, evict
from ..io.cache import pack_files
from ..io.planner import profile_file
from ..io.read_cost import describe_profile
from ..model_folder import read_config
from ..models import is_flash_pack, is_moe_pack, load_tokenizer
from ..pack import read_manifest, write_pack
from ..paths import PYTHON_DOC_LIBRARY, flash_home, write_json_atomic
from ..sources import default_gguf_path, is_gguf, resolve_model
from ..sparse.budget import pack_bytes, resolve_budget
from ..sparse.predictor import read_predictors_json
from . import moe as moe_bench
from . import peers as peer_mod
from . import report
from .cap import cgroup_status, run_capped
from .io import write_unbundled
from .report import machine_info, package_versions

MODES = ("dense", "naive", "hybrid", "flash")
SWEEPS = ("budget", "window", "length")


def add_arguments(parser):
    parser.add_argument("--model", help="flash pack, GGUF file or model folder (default: the "
                        "embedded SmolLM2-135M-Instruct; non-packs are converted once into "
                        "$MLX_FLASH_HOME/bench-packs)")
    parser.add_argument("--modes", default="dense,naive,hybrid,flash",
                        help="comma-separated modes to run (default all four)")
    parser.add_argument("--memory-budget", default="0.5",
                        help="weights budget: fraction of the pack (0.5) or a size (1.3GB)")
    parser.add_argument("--cap", action="store_true",
                        help="run every child inside a cgroup memory cap (Linux, root)")
    parser.add_argument("--cap-bytes", help="cap size (default: budget + measured process "
                        "baseline + KV cache)")
    parser.add_argument("--encoding", metavar="ENDOR_PACK",
                        help="the same pruned model converted with --encoding endor: every mode "
                        "also runs on it (rows MODE+endor) at the same budget in bytes (resolved "
                        "against --model) under the same cap, alternated with the --model rows")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--gen-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="cold runs per row (mean, std)")
    parser.add_argument("--window", type=int, default=5, help="flash window k (tokens)")
    parser.add_argument("--threads", type=int, default=32, help="reads in flight")
    parser.add_argument("--text", nargs="+", help="text files for prompts (default: python3-doc "
                        f"sources, {PYTHON_DOC_LIBRARY})")
    parser.add_argument("--ablation", action="store_true",
                        help="Table 2 rows: +Predictor (no window, unbundled), +Windowing "
                        "(unbundled), +Bundling")
    parser.add_argument("--sweeps", default="",
                        help=f"comma-separated from {','.join(SWEEPS)} (PNG plots: Fig. 7 / 8, "
                        "greedy vs nucleus in the length sweep)")
    parser.add_argument("--sweep-budgets", default="0.4,0.5,0.65,0.8,0.95")
    parser.add_argument("--sweep-windows", default="1,2,4,8")
    parser.add_argument("--sweep-length", type=int, default=1000,
                        help="tokens generated in the length sweep (capped by the context)")
    parser.add_argument("--sweep-gen-tokens", type=int, default=64,
                        help="tokens generated per budget/window sweep point")
    parser.add_argument("--peers", default="auto",
                        help="mlx-lm,llama.cpp, 'auto' (those installed) or 'none'")
    parser.add_argument("--io-exp-pack", help="MoE packs: the same model with wider experts (8-bit "
                        "or float16) for EdgeMoE's IO-EXP row (naive reads of those experts); the "
                        "--model pack's naive row is IO-QEXP")
    parser.add_argument("--no-kernels", action="store_true",
                        help="every row on MLX's own ops instead of the CPU kernels (as "
                        "MLX_FLASH_KERNELS=0; MoE packs: experts through gather_qmm, bit-identical "
                        "to mlx-lm)")
    parser.add_argument("--mlx-rows", action="store_true",
                        help="MoE packs: each row also runs on MLX's own ops (kernels off), "
                        "alternated with its run on the CPU kernels")
    parser.add_argument("--temp", type=float, default=0.0,
                        help="sample generated tokens at this temperature (every row, seeded by the "
                        "repeat; MoE packs: ours and llama.cpp; default greedy). A small or synthetic "
                        "model's greedy output repeats tokens, which flatters neuron and expert caches")
    parser.add_argument("--moe-policy", default="layer", choices=("lru", "lfu", "layer"),
                        help="MoE packs: expert-cache eviction policy (default: EdgeMoE's layer-aware)")
    parser.add_argument("--moe-rows", nargs="+", default=None, metavar="ROW",
                        choices=("io-free", "io-exp", "io-qexp", "cache", "preload", "ours"),
                        help="MoE packs: run only these rows (default all: io-free io-exp io-qexp "
                        "cache preload ours), alternated in this order every repeat")
    parser.add_argument("--gguf", help="GGUF of the same model for llama.cpp (default: the "
                        "source GGUF, or one written from the pack)")
    parser.add_argument("--drop-caches", action="store_true",
                        help="also write /proc/sys/vm/drop_caches when fadvise leaves pages (root)")
    parser.add_argument("--timeout", type=float, default=7200, help="seconds per child run")
    parser.add_argument("--out", required=True, help="output folder (created; files replaced)")
    parser.add_argument("--verbose", action="store_true")


# ---- inputs -------------------------------------------------------------------------------------

def resolve_pack(model) -> dict:
    """{"pack", "mlx_folder" (or None), "gguf" (or None), "converted"} for a --model value."""
    if model is not None and is_flash_pack(Path(model).expanduser()):
        return {"pack": Path(model).expanduser(), "mlx_folder": None, "gguf": None,
                "converted": False}
    gguf = None
    if model is None:
        gguf = default_gguf_path()
    elif Path(model).expanduser().is_file() and is_gguf(Path(model).expanduser()):
        gguf = Path(model).expanduser()
    folder = resolve_model(model)
    key = zlib.crc32(str(folder.resolve()).encode())
    pack = flash_home() / "bench-packs" / f"{folder.name}-{key:08x}"
    if not pack.exists():

        print(f"converting {folder} into a flash pack at {pack} (once)", file=sys.stderr)
        write_pack(folder, pack, progress=False)
    return {"pack": pack, "mlx_folder": folder, "gguf": gguf, "converted": True}


def text_sources(paths) -> list[Path]:
    """The prompt text files: --text, else python3-doc's .rst sources; FlashError if none."""
    if paths:
        files = [Path(p).expanduser() for p in paths]
        for f in files:
            if not f.is_file():
                raise FlashError(f"--text {f}: no such file")
        return files
    files = [Path(p) for p in sorted(glob.glob(PYTHON_DOC_LIBRARY))]
    if not files:
        raise FlashError("--text: no prompt text given and python3-doc's sources are not installed "
                         f"({PYTHON_DOC_LIBRARY}); pass --text FILE or apt-get install python3-doc")
    return files


def make_prompts(tokenizer, files, n_prompts, n_tokens) -> list[dict]:
    """`n_prompts` prompts of exactly `n_tokens` token ids: the first tokens of successive files
    (of successive chunks when one file is given), like the paper's first 128 tokens of C4 docs."""
    prompts = []
    for f in files:
        try:
            text = f.read_text(errors="replace")
        except OSError as e:
            raise FlashError(f"--text {f}: cannot read ({e.strerror})") from None
        ids = tokenizer.encode(text)
        chunks = range(0, len(ids) - n_tokens + 1, n_tokens) if len(files) == 1 else [0]
        for start in chunks:
            if len(ids) >= start + n_tokens:
                prompts.append({"source": str(f), "start_token": start,
                                "ids": [int(t) for t in ids[start: start + n_tokens]]})
            if len(prompts) == n_prompts:
                return prompts
    if not prompts:
        raise FlashError(f"--text: no file has {n_tokens} tokens (--prompt-tokens)")
    while len(prompts) < n_prompts:  # short texts: reuse prompts rather than fail
        prompts.append(prompts[len(prompts) % len(prompts)])
    return prompts


# ---- running children ---------------------------------------------------------------------------

class Suite:
    """Runs cold children for one pack and keeps every result."""
    def __init__(self, args, model_info):

        self.args = args
        self.pack = Path(model_info["pack"])
        self.model_info = model_info
        self.manifest = read_manifest(self.pack)
        self.pack_bytes = pack_bytes(self.manifest)
        self.budget_bytes = resolve_budget(parse_memory_budget(args.memory_budget, "--memory-budget"),
                                           self.manifest)
        self.runs = []
        self.out = None
        self.evictions = {}
        self.extra_paths = []
        usable, reason = cgroup_status()
        self.cap = {"asked": args.cap, "used": bool(args.cap and usable), "reason": reason}
        if args.cap and not usable:
            print(f"note: --cap asked but not available ({reason}); running uncapped",
                  file=sys.stderr)
        self.use_cgroup = usable  # peak memory from an (unlimited) cgroup even without --cap

    # -- cap size
    def measure_baseline(self, prompt):
        """Memory a run needs besides its weights budget: a short uncapped naive run's peak RSS
        minus the weights its plan holds (interpreter, MLX, loader threads, activations), plus an
        upper bound of the KV cache for the longest run (float32)."""

        kwargs = {"pack": str(self.pack), "mode": "naive", "prompt": prompt["ids"][:8],
                  "gen_tokens": 4, "threads": self.args.threads}
        if is_moe_pack(self.manifest):
            function = "mlx_flash.bench.moe:generate_moe"
        else:
            function = "mlx_flash.bench.measure:generate_flash"
            kwargs["keep_steps"] = False
        r = run_capped(function, kwargs, use_cgroup=False, timeout=self.args.timeout)
        if not r.ok:
            raise FlashError(f"{self.pack}: the baseline run (naive, uncapped) failed: {r.error}")
        v = r.value
        self.baseline_bytes = max(0, v["summary"]["peak_rss"] - v["plan_weights_bytes"])
        cfg = read_config(self.pack)
        layers = cfg.get("num_hidden_layers", len(self.manifest.bundles))
        hidden = cfg.get("hidden_size", 0)
        heads = cfg.get("num_attention_heads", 1)
        kv_dim = hidden // heads * (cfg.get("num_key_value_heads") or heads)
        tokens = self.args.prompt_tokens + max(self.args.gen_tokens, self.sweep_length())
        self.kv_bytes = tokens * layers * 2 * kv_dim * 4
        self.cap["baseline_bytes"] = self.baseline_bytes
        self.cap["baseline_method"] = ("peak RSS of an uncapped 4-token naive run minus the "
                                       "weights its memory plan holds")
        self.cap["kv_cache_bytes"] = self.kv_bytes

    def cap_for(self, budget_bytes):
        """Cap bytes for a run whose weights budget is `budget_bytes` (None when uncapped)."""
        if not self.cap["used"]:
            return None
        if self.args.cap_bytes:
            return parse_memory_budget(self.args.cap_bytes, "--cap-bytes").bytes_for(self.pack_bytes)
        return int(budget_bytes + self.baseline_bytes + self.kv_bytes)

    def sweep_length(self):
        if "length" not in self.sweeps():
            return 0
        cfg = read_config(self.pack)
        limit = cfg.get("max_position_embeddings") or 10**9
        return max(1, min(self.args.sweep_length, limit - self.args.prompt_tokens - 2))

    def sweeps(self):
        names = [s for s in self.args.sweeps.split(",") if s]
        for s in names:
            if s not in SWEEPS:
                raise FlashError(f"--sweeps {s}: unknown sweep (choose from {', '.join(SWEEPS)})")
        return names

    def evict(self, paths):

        files = [f for p in map(Path, paths) for f in (pack_files(p) if p.is_dir() else [p])]
        r = evict(files, drop_caches=self.args.drop_caches)
        self.evictions[r["method"]] = max(self.evictions.get(r["method"], 0.0), r["residency"] or 0.0)
        return r

    def child(self, group, label, function, kwargs, *, budget_bytes, paths=None, repeat=0,
              extra=None) -> dict:
        """One cold child run; appends and returns its record."""

        cap = self.cap_for(budget_bytes) if budget_bytes is not None else self.cap_for(self.pack_bytes)
        ev = self.evict(paths or [self.pack] + self.extra_paths)
        t0 = time.perf_counter()
        r = run_capped(function, kwargs, cap_bytes=cap, use_cgroup=self.use_cgroup,
                       timeout=self.args.timeout)
        rec = {"group": group, "label": label, "repeat": repeat, "function": function,
               "kwargs": {k: v for k, v in kwargs.items() if k != "prompt"},
               "evict": ev, "cap_bytes": cap, "ok": r.ok, "error": r.error,
               "peak_bytes": r.peak_bytes, "peak_source": r.peak_source, "oom_killed": r.oom_killed,
               "failcnt": r.failcnt, "seconds": round(time.perf_counter() - t0, 2),
               "value": r.value, **(extra or {})}
        if not r.ok and self.args.verbose:
            print(r.stderr_tail, file=sys.stderr)
        state = "ok" if r.ok else f"FAILED: {r.error}"
        total = (r.value or {}).get("summary", {}).get("total_ms") if r.ok else None
        print(f"  [{group}] {label} #{repeat + 1}: {state}"
              + (f", {total:.1f} ms/token" if total is not None else "")
              + (f", peak {r.peak_bytes / 1e9:.3f} GB" if r.peak_bytes else ""), file=sys.stderr)
        self.runs.append(rec)
        if self.out is not None:  # what is done so far survives an interrupted suite

            write_json_atomic(self.out / "runs.partial.json", self.runs, default=str)
        return rec

    def flash_run(self, group, label, mode, prompt, *, budget=None, window=None, gen_tokens=None,
                  repeat=0, pack=None, **kw):
        budget = self.args.memory_budget if budget is None else budget

        # dense holds every weight whatever the budget; its cap is the same as every mode's,
        # so under a cap below the model size it is reported as not fitting
        weights_budget = None if mode == "dense" else budget
        budget_bytes = resolve_budget(parse_memory_budget(budget, "--memory-budget"), self.manifest)
        if self.args.temp and "temp" not in kw:  # sampled rows: the same seed for every mode
            kw = dict(kw, temp=self.args.temp, seed=repeat)
        kwargs = {"pack": str(pack or self.pack), "mode": mode, "prompt": prompt["ids"],
                  "gen_tokens": gen_tokens or self.args.gen_tokens, "budget": weights_budget,
                  "window": window or self.args.window, "threads": self.args.threads, **kw}
        return self.child(group, label, "mlx_flash.bench.measure:generate_flash", kwargs,
                          budget_bytes=budget_bytes, repeat=repeat,
                          paths=[pack] + self.extra_paths if pack else None,
                          extra={"mode": mode, "memory_budget": budget,
                                 "budget_bytes": budget_bytes,
                                 "prompt_source": prompt["source"]})


# ---- aggregation --------------------------------------------------------------------------------

def mean_std(values):
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def aggregate(records) -> dict:
    """Mean/std over the repeats of one row (records of the same label)."""
    ok = [r for r in records if r["ok"]]
    row = {"label": records[0]["label"], "runs": len(records), "ok_runs": len(ok),
           "errors": sorted({r["error"] for r in records if not r["ok"]}),
           "peak_bytes": max((r["peak_bytes"] or 0 for r in records), default=None),
           "cap_bytes": records[0]["cap_bytes"]}
    for key in ("mode", "memory_budget", "budget_bytes"):
        if key in records[0]:
            row[key] = records[0][key]
    if not ok:
        return row
    summaries = [r["value"]["summary"] for r in ok]
    for key in ("total_ms", "io_ms", "io_read_ms", "decode_ms", "mem_ms", "compute_ms", "bytes_read",
                "neurons_loaded", "hit_rate", "window", "prompt_ms", "peak_memory", "peak_rss"):
        row[key], row[key + "_std"] = mean_std([s.get(key) for s in summaries])
    row["plan_weights_bytes"] = ok[0]["value"].get("plan_weights_bytes")
    row["plan"] = ok[0]["value"].get("plan")
    row["tokens"] = summaries[0]["tokens"]
    row["active_fraction"], _ = mean_std([r["value"].get("active_fraction") for r in ok])
    row["layers"] = layer_means([s.get("layers") or {} for s in summaries])
    row["sparse_layers"] = ok[0]["value"].get("sparse_layers")
    ahead = [r["value"].get("lookahead") for r in ok]
    row["lookahead"] = {k: statistics.fmean(a[k] for a in ahead) for k in ("read", "used")} \
        if all(ahead) else None
    row["ffn_layers"] = ok[0]["value"].get("ffn_layers")
    row["load_s"], row["load_s_std"] = mean_std([r["value"]["load_s"] for r in ok])
    io = [s["io_ms"] for s in summaries]
    row["throughput_gbps"] = (row["bytes_read"] / (statistics.fmean(io) / 1e3) / 1e9
                              if io and statistics.fmean(io) > 0 else None)
    acc = [r["value"]["accounting"] for r in ok]
    sizes = {}
    for a in acc:
        for size, n in (a.get("decode_read_sizes") or {}).items():
            sizes[int(size)] = sizes.get(int(size), 0) + n
    row["read_sizes"] = sizes
    row["reads_per_call"], _ = mean_std([a.get("decode_reads_per_call") for a in acc])
    row["accounting_ok"] = all(
        a["decode_bytes_stats"] == a["decode_bytes_loader"] and a["all_bytes_stats"] == a["all_bytes_loader"]
        and a["cache_rows_loaded"] == a["cache_rows_logged"] + a.get("cache_rows_from_lookahead", 0)
        + a.get("cache_rows_from_stream", 0)
        and a["neurons_loaded_stats"] == a["neurons_read_loader"]
        and a["useful_bytes_loader"] == a["useful_bytes_expected"] for a in acc)
    return row


def layer_means(per_run: list) -> dict:
    """{layer: FlashStats.layer_summary values, numbers averaged over the runs} (JSON keys)."""
    out = {}
    for layer in sorted({int(k) for run in per_run for k in run}):
        rows = [run[k] for run in per_run for k in run if int(k) == layer]
        out[layer] = {k: (statistics.fmean([r[k] for r in rows if r[k] is not None])
                          if isinstance(v, (int, float)) and not isinstance(v, bool)
                          and any(r[k] is not None for r in rows) else v)
                      for k, v in rows[0].items()}
    return out


def layer_lines(result) -> str:
    """Markdown: the flash row's per-layer profile per token (decode steps, mean over repeats)."""
    row = next((r for r in result["modes"].values() if r.get("mode") == "flash" and r.get("layers")), None)
    if row is None:
        return ""
    lines = ["", "Flash per layer, per token (call ms: the FFN call's wall time, its reads and, when "
             "sparse, the host sync that evaluates the layers before it; plan I/O ms: the read time "
             "the memory plan priced for the layer's option with the stored read-cost curve):", "",
             "| layer | kind | cache rows | needed | hit rate | loaded | MB read | I/O ms | plan I/O ms | mem ms "
             "| call ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    if row.get("lookahead"):
        la = row["lookahead"]
        lines[1:1] = [f"Lookahead: {la['read']:.0f} neurons read ahead per token, {la['used']:.0f} of them "
                      f"({100 * la['used'] / la['read']:.1f}%) then needed (on with MLX_FLASH_LOOKAHEAD=1).", ""]
    for layer, r in sorted(row["layers"].items(), key=lambda kv: int(kv[0])):
        hit = "-" if r.get("hit_rate") is None else f"{100 * r['hit_rate']:.1f}%"
        rows = "-" if r.get("cache_rows") is None else f"{r['cache_rows']:.0f}"
        priced = "-" if r.get("plan_io_ms") is None else f"{r['plan_io_ms']:.2f}"
        lines.append(f"| {layer} | {r['kind']} | {rows} | {r['needed']:.0f} | {hit} | {r['loaded']:.0f} | "
                     f"{r['mb_read']:.2f} | {r['io_ms']:.2f} | {priced} | {r['mem_ms']:.2f} | {r['call_ms']:.2f} |")
    return "\n".join(lines) + "\n"


def add_fio_reference(row, bundle_paths, threads, total_bytes=64 << 20, runs=3):
    """A flash row's I/O reference: fio's O_DIRECT random-read throughput on the pack's bundle
    files at the row's decode read sizes (bench.io.fio_throughput) with as many reads in flight as
    its loader calls had (mean reads per call, at most `threads`); row["fio_ms"] = bytes read per
    token / that throughput, row["io_over_fio"] = the row's I/O ms / fio_ms. fio runs `runs` times
    and the median throughput is the reference (a shared disk moves it between runs; all are kept
    in row["fio"]["gbps_runs"]). Nothing without fio or without reads."""
    from .io import fio_throughput

    if not row.get("read_sizes") or not row.get("bytes_read"):
        return
    depth = max(1, min(int(threads), round(row.get("reads_per_call") or 1)))
    refs = [fio_throughput(bundle_paths, row["read_sizes"], depth, total_bytes) for _ in range(max(1, runs))]
    if refs[0] is None:
        row["fio"] = "fio not installed"
        return
    ref = sorted(refs, key=lambda r: r["gbps"])[len(refs) // 2]
    row["fio"] = {**ref, "depth": depth, "gbps_runs": [r["gbps"] for r in refs]}
    row["fio_ms"] = row["bytes_read"] / (ref["gbps"] * 1e9) * 1e3
    row["io_over_fio"] = row["io_ms"] / row["fio_ms"] if row["fio_ms"] > 0 else None


def fio_lines(result) -> str:
    """One line per flash row with a fio reference: I/O ms per token vs fio's ms for its bytes."""
    lines = []
    for group in ("modes", "ablation"):
        for label, row in result[group].items():
            if isinstance(row.get("fio"), dict):
                lines.append(f"- {group} {label}: I/O {row['io_ms']:.1f} ms/token vs fio {row['fio_ms']:.1f} ms "
                             f"for its {row['bytes_read'] / 1e6:.2f} MB at its read sizes, depth "
                             f"{row['fio']['depth']} ({row['fio']['gbps']:.3f} GB/s): "
                             f"{row['io_over_fio']:.2f}x (`{row['fio']['command']}`)")
    return ("\n\nI/O vs fio (flash rows; target <= 1.2x):\n" + "\n".join(lines)) if lines else ""


def rows_by_label(runs, group) -> dict:
    labels = {}
    for r in runs:
        if r["group"] == group:
            labels.setdefault(r["label"], []).append(r)
    return {label: aggregate(recs) for label, recs in labels.items()}


# ---- the suite ----------------------------------------------------------------------------------

def run(args) -> int:
    if args.no_kernels:  # this process and every child (they inherit the environment)
        os.environ["MLX_FLASH_KERNELS"] = "0"
        ops.set_kernels_enabled(False)
    if args.mlx_rows and args.no_kernels:
        raise FlashError("--mlx-rows: adds MLX-ops rows next to the kernel rows; with --no-kernels "
                         "every row is on MLX's ops already")
    for name, value in (("--prompt-tokens", args.prompt_tokens), ("--gen-tokens", args.gen_tokens),
                        ("--repeats", args.repeats)):
        if value < 1:
            raise FlashError(f"{name} {value}: must be at least 1")
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            raise FlashError(f"--modes {m}: unknown mode (choose from {', '.join(MODES)})")
    out = Path(args.out).expanduser()
    if out.exists() and not out.is_dir():
        raise FlashError(f"--out {out}: exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    peer_names = peer_mod.choose(args.peers)
    model_info = resolve_pack(args.model)
    suite = Suite(args, model_info)
    suite.out = out
    suite.sweeps()
    endor_pack = check_encoding_pack(args.encoding, suite) if args.encoding else None
    # the ENDOR rows get the --model rows' budget in bytes (a fraction would resolve against
    # the smaller ENDOR pack)
    endor_budget = str(suite.budget_bytes) if endor_pack else None

    synthetic = is_synthetic(suite.pack)
    files = text_sources(args.text)
    tokenizer = load_tokenizer(suite.pack)
    n_prompts = max(args.repeats, 1)
    prompts = make_prompts(tokenizer, files, n_prompts, args.prompt_tokens)
    if suite.cap["used"]:
        suite.measure_baseline(prompts[0])
    command = _command(args)
    profile_line = stored_profile_line(suite.pack, args.threads)  # what prices the runs' reads
    print(profile_line, file=sys.stderr)
    if is_moe_pack(suite.manifest):  # EdgeMoE's rows; --modes, --ablation, --sweeps are for FFN packs
        return moe_bench.run_suite(suite, args, prompts, peer_names, out, command, machine_info(),
                                   package_versions(), profile_line)
    if "flash" in modes or args.ablation or suite.sweeps():

        if read_predictors_json(suite.pack) is None:
            raise FlashError(f"{suite.pack}: --mode flash (and --ablation/--sweeps) need predictors; "
                             f"run python -m mlx_flash.calibrate --model {suite.pack}, or drop flash "
                             f"from --modes")
    print(f"pack {suite.pack} ({suite.pack_bytes / 1e9:.3f} GB"
          + (", SYNTHETIC: random weights, speed only" if synthetic else "")
          + f"), budget {suite.budget_bytes / 1e9:.3f} GB, cap: "
          + (f"{suite.cap_for(suite.budget_bytes) / 1e9:.3f} GB" if suite.cap["used"] else
             f"none ({suite.cap['reason'] if args.cap else 'not asked'})"), file=sys.stderr)

    # 1. the modes (Table 3)
    for rep in range(args.repeats):  # repeats outermost: background load hits every mode alike
        for mode in modes:
            suite.flash_run("modes", mode, mode, prompts[rep], repeat=rep)
            if endor_pack:
                suite.flash_run("modes", f"{mode}+endor", mode, prompts[rep], repeat=rep,
                                pack=endor_pack, budget=endor_budget)
    # 2. Table 2 ablation: the two unbundled rows (naive/hybrid/flash rows come from step 1)
    unbundled = None
    if args.ablation:
        unbundled = write_unbundled_copy(suite.pack, out / "unbundled-copy")
        suite.extra_paths = [Path(unbundled["path"])]
        for rep in range(args.repeats):
            suite.flash_run("ablation", "+predictor", "flash", prompts[rep], repeat=rep,
                            unbundled=unbundled, no_window=True)
            suite.flash_run("ablation", "+windowing", "flash", prompts[rep], repeat=rep,
                            unbundled=unbundled)
        for mode in ("naive", "hybrid", "flash"):
            if mode not in modes:
                for rep in range(args.repeats):
                    suite.flash_run("modes", mode, mode, prompts[rep], repeat=rep)
        suite.extra_paths = []

        shutil.rmtree(unbundled["path"], ignore_errors=True)
    # 3. sweeps (one cold run per point)
    sweeps = suite.sweeps()
    if "budget" in sweeps:
        for b in args.sweep_budgets.split(","):
            for mode in ("hybrid", "flash"):
                suite.flash_run("sweep-budget", f"{mode}@{b}", mode, prompts[0], budget=b,
                                gen_tokens=args.sweep_gen_tokens)
    if "window" in sweeps:
        for w in args.sweep_windows.split(","):
            suite.flash_run("sweep-window", f"flash@w{w}", "flash", prompts[0], window=int(w),
                            gen_tokens=args.sweep_gen_tokens)
    if "length" in sweeps:
        n = suite.sweep_length()
        suite.flash_run("sweep-length", "greedy", "flash", prompts[0], gen_tokens=n)
        suite.flash_run("sweep-length", "nucleus (top-p 0.9, temp 1.0)", "flash", prompts[0],
                        gen_tokens=n, temp=1.0, top_p=0.9, seed=1)
    # 4. peers under the same cap and prompts
    peer_results = peer_mod.run_peers(suite, peer_names, prompts, out)

    result = {
        "command": command, "cwd": os.getcwd(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine_info(), "packages": package_versions(),
        "model": {"pack": str(suite.pack), "pack_bytes": suite.pack_bytes,
                  "resident_bytes": suite.manifest.resident.length,
                  "layers": len(suite.manifest.bundles), "synthetic": synthetic,
                  "mlx_folder": str(model_info["mlx_folder"] or ""),
                  "gguf": str(model_info["gguf"] or ""), "converted": model_info["converted"]},
        "protocol": {"prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens,
                     "repeats": args.repeats, "window": args.window, "threads": args.threads,
                     "memory_budget": args.memory_budget, "budget_bytes": suite.budget_bytes,
                     "prompts": [{k: v for k, v in p.items() if k != "ids"} for p in prompts],
                     "eviction": {m: {"max_residency_after": r} for m, r in suite.evictions.items()},
                     "cap": {**suite.cap, "cap_bytes": suite.cap_for(suite.budget_bytes)}},
        "modes": rows_by_label(suite.runs, "modes"),
        "ablation": rows_by_label(suite.runs, "ablation"),
        "sweeps": {name: rows_by_label(suite.runs, f"sweep-{name}") for name in sweeps},
        "length_steps": {r["label"]: r["value"]["steps"] for r in suite.runs
                         if r["group"] == "sweep-length" and r["ok"]},
        "peers": peer_results,
        "read_cost_profile": profile_line,
        "runs": suite.runs,
    }
    if endor_pack:
        result["encoding"] = {"pack": str(endor_pack), "budget_bytes": suite.budget_bytes,
                              "rows": encoding_rows(result["modes"], modes)}
    paths = [suite.pack / b.file for b in suite.manifest.bundles]
    for group in ("modes", "ablation"):
        for row in result[group].values():
            if row.get("mode") == "flash":
                add_fio_reference(row, paths, args.threads)
    result["table2"] = report.table2_rows(result)
    result["table3"] = report.table3_rows(result)
    result["speedups"] = report.speedups(result)
    result["plots"] = report.plots(result, out)
    write_json_atomic(out / "results.json", result, default=str)
    endor_table = (encoding_markdown(result) if endor_pack else "") + fio_lines(result) + layer_lines(result)
    report.write_text(out / "report.md", report.markdown(result) + endor_table)
    (out / "runs.partial.json").unlink(missing_ok=True)
    print(report.summary(result) + endor_table)
    print(f"\nresults: {out / 'results.json'}\nreport:  {out / 'report.md'}")
    return 0


def check_encoding_pack(value, suite) -> Path:
    """The --encoding pack: ENDOR-encoded, with the --model pack's layers and neurons."""
    pack = Path(value).expanduser()
    if not is_flash_pack(pack):
        raise FlashError(f"--encoding {pack}: not a flash pack")
    manifest = read_manifest(pack)
    if not any(b.encoding == "endor" for b in manifest.bundles):
        raise FlashError(f"--encoding {pack}: no ENDOR-encoded layers (convert with --encoding endor)")
    if [(b.layer, b.count) for b in manifest.bundles] != [(b.layer, b.count) for b in suite.manifest.bundles]:
        raise FlashError(f"--encoding {pack}: its layers or neurons differ from --model {suite.pack}")
    return pack


def encoding_rows(mode_rows: dict, modes) -> list:
    """Each mode on the --model pack vs the ENDOR pack: tokens/s, speedup, per-token ms and bytes."""
    rows = []
    for mode in modes:
        d, e = mode_rows.get(mode), mode_rows.get(f"{mode}+endor")
        if not d or not e or not d.get("ok_runs") or not e.get("ok_runs"):
            rows.append({"mode": mode, "ok": False})
            continue
        rows.append({
            "mode": mode, "ok": True, "dense_tps": 1e3 / d["total_ms"], "endor_tps": 1e3 / e["total_ms"],
            "speedup": d["total_ms"] / e["total_ms"],
            **{f"{side}_{k}": r.get(k) for side, r in (("dense", d), ("endor", e))
               for k in ("io_ms", "io_read_ms", "decode_ms", "compute_ms", "bytes_read", "plan")},
            "bytes_ratio": e["bytes_read"] / d["bytes_read"] if d.get("bytes_read") else None,
            # decode time / the I/O time ENDOR saves before decoding (as if no decode overlapped
            # a read: I/O ms includes the check + decode)
            "decode_over_saved_read": (e["decode_ms"] / (d["io_ms"] - (e["io_ms"] - e["decode_ms"]))
                                       if e.get("decode_ms") is not None
                                       and d["io_ms"] > e["io_ms"] - e["decode_ms"] else None),
        })
    return rows


def encoding_markdown(result) -> str:
    """The ENDOR table (--encoding): each mode on the dense pack vs the ENDOR pack."""
    enc = result["encoding"]
    lines = ["", "", f"## ENDOR rows (--encoding {enc['pack']}, same budget {enc['budget_bytes'] / 1e6:.1f} MB "
             "and cap)", "", "| mode | dense tok/s | ENDOR tok/s | speedup | I/O ms dense / ENDOR | "
             "decode ms (in I/O) | compute ms dense / ENDOR | MB read/token dense / ENDOR | decode / "
             "read saved | ENDOR plan |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in enc["rows"]:
        if not r["ok"]:
            lines.append(f"| {r['mode']} | no successful run on both packs |||||||||")
            continue
        dec = r["decode_over_saved_read"]
        lines.append(
            f"| {r['mode']} | {r['dense_tps']:.2f} | {r['endor_tps']:.2f} | {r['speedup']:.2f}x | "
            f"{r['dense_io_ms']:.0f} / {r['endor_io_ms']:.0f} | {r['endor_decode_ms']:.1f} | "
            f"{r['dense_compute_ms']:.0f} / {r['endor_compute_ms']:.0f} | "
            f"{r['dense_bytes_read'] / 1e6:.1f} / {r['endor_bytes_read'] / 1e6:.1f} | "
            + (f"{dec:.0%}" if dec is not None else "n/a") + f" | {r['endor_plan']} |")
    return "\n".join(lines) + "\n"


def stored_profile_line(pack, threads) -> str:
    """describe_profile of the read-cost profile stored for the pack's device and the loader's
    engine at `threads` in flight: what the runs' planners price reads with (a run measures and
    stores one when none is)."""
    probe = FlashLoader(pack, threads=threads, plan=False)
    try:
        return describe_profile(probe.stored_cost(), profile_file())
    finally:
        probe.close()


def _command(args) -> str:
    """The command line that reproduces this run (set by bench/__main__, else rebuilt from the
    parsed options when run() is called from Python)."""
    if getattr(args, "command_line", None):
        return args.command_line
    parts = ["python", "-m", "mlx_flash.bench", "run"]
    for key, value in vars(args).items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            parts.append(flag)
        elif value not in (None, False):
            parts += [flag, *(map(str, value) if isinstance(value, list) else [str(value)])]
    return shlex.join(parts)


def write_unbundled_copy(pack: Path, dest: Path) -> dict:
    """The matrix-major (unbundled) copy bench io compares against, written by bench.io's own
    writer; {"path", "layer_map": {pack layer: [copy layers]}}. Rewritten on every call."""


    manifest = read_manifest(pack)
    entries = {b.layer: b for b in manifest.bundles}
    shutil.rmtree(dest, ignore_errors=True)
    view = SimpleNamespace(pack=pack, manifest=manifest, layers=sorted(entries), entries=entries)
    layer_map = write_unbundled(view, dest)
    return {"path": str(dest), "layer_map": {str(k): v for k, v in layer_map.items()}}
