"""Tables, plots and the markdown report of `python -m mlx_flash.bench run` (from results.json),
and the machine and package description every bench report records.

Table 2 (paper): Naive / Hybrid / +Predictor / +Windowing / +Bundling with DRAM (GB of weights
the memory plan holds), flash -> DRAM (MB per token), effective read throughput (GB/s = bytes
read / I/O time) and I/O latency (ms per token). Table 3: per token I/O, memory management,
compute and total ms for each mode and peer.
"""

import os
import platform
from importlib import metadata
from pathlib import Path

from ..paths import write_file_atomic, write_text_atomic

TABLE2 = (("Naive", "modes", "naive", (0, 0, 0, 0)),
          ("Hybrid", "modes", "hybrid", (1, 0, 0, 0)),
          ("+Predictor", "ablation", "+predictor", (1, 1, 0, 0)),
          ("+Windowing", "ablation", "+windowing", (1, 1, 1, 0)),
          ("+Bundling", "modes", "flash", (1, 1, 1, 1)))


def machine_info() -> dict:
    """The machine a report's figures come from (bench run, bench io): platform, Python, CPU
    model and count, memory bytes, load average (1, 5, 15 min) now."""
    info = {"platform": platform.platform(), "python": platform.python_version(),
            "machine": platform.machine(), "cpus": os.cpu_count(),
            "load_average": [round(x, 2) for x in os.getloadavg()]}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["memory_bytes"] = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    return info


def package_versions() -> dict:
    """{distribution: version} of the installed packages behind a report's figures."""
    out = {}
    for name in ("mlx", "mlx-lm", "mlx-flash-runtime", "numpy", "llama_cpp_python", "gguf",
                 "matplotlib"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def write_text(path: Path, text: str):
    write_text_atomic(path, text)


def _get(result, group, label):
    return (result.get(group) or {}).get(label)


def table2_rows(result) -> list:
    """The ablation rows (empty unless --ablation ran)."""
    if not result.get("ablation"):
        return []
    rows = []
    for name, group, label, flags in TABLE2:
        r = _get(result, group, label)
        if r is None:
            continue
        row = {"row": name, "hybrid": bool(flags[0]), "predictor": bool(flags[1]),
               "windowing": bool(flags[2]), "bundling": bool(flags[3]), "ok": r["ok_runs"] > 0,
               "errors": r["errors"]}
        if row["ok"]:
            row.update(dram_gb=(r["plan_weights_bytes"] or 0) / 1e9,
                       peak_gb=(r["peak_bytes"] or 0) / 1e9,
                       flash_to_dram_mb=r["bytes_read"] / 1e6,
                       throughput_gbps=r["throughput_gbps"], io_ms=r["io_ms"],
                       io_ms_std=r["io_ms_std"], total_ms=r["total_ms"])
        rows.append(row)
    return rows


def table3_rows(result) -> list:
    """Per token split for every mode and peer."""
    rows = []
    for label, r in (result.get("modes") or {}).items():
        row = {"method": label, "kind": "mlx-flash", "ok": r["ok_runs"] > 0, "errors": r["errors"],
               "peak_gb": (r["peak_bytes"] or 0) / 1e9, "cap_gb": (r["cap_bytes"] or 0) / 1e9}
        if row["ok"]:
            for k in ("io_ms", "mem_ms", "compute_ms", "total_ms", "total_ms_std", "bytes_read",
                      "hit_rate", "plan_weights_bytes", "accounting_ok", "prompt_ms"):
                row[k] = r.get(k)
        rows.append(row)
    for name, p in (result.get("peers") or {}).items():
        row = {"method": name, "kind": "peer", "ok": p.get("ok", False), "status": p.get("status"),
               "errors": [p["error"]] if p.get("error") else [], "note": p.get("note"),
               "peak_gb": (p.get("peak_bytes") or 0) / 1e9 if p.get("peak_bytes") else None,
               "cap_gb": (p.get("cap_bytes") or 0) / 1e9}
        if row["ok"]:
            row.update(total_ms=p["total_ms"], total_ms_std=p.get("total_ms_std"), prompt_ms=p.get("prompt_ms"))
        rows.append(row)
    return rows


def _over_flash(result, key) -> dict:
    """{"flash_vs_<row>": the row's `key` / flash's} for every row of Table 3 that measured it."""
    rows = {r["method"]: r for r in table3_rows(result)}
    flash = rows.get("flash")
    if not flash or not flash["ok"] or not flash.get(key):
        return {}
    return {f"flash_vs_{name}": r[key] / flash[key] for name, r in rows.items()
            if name != "flash" and r["ok"] and r.get(key)}


def speedups(result) -> dict:
    """Ratios of per-token latency: how many times faster flash is than each other row."""
    return _over_flash(result, "total_ms")


def byte_ratios(result) -> dict:
    """How many times the bytes flash read per token each other mode read (peers report none).
    Where a token is its reads plus about the same compute in every mode, the speed-ups sit near
    these."""
    return _over_flash(result, "bytes_read")


def speedup_line(result) -> str:
    """The speed-ups of flash, with the byte ratios beside them when the modes read any."""
    line = ", ".join(f"{k.removeprefix('flash_vs_')} {v:.2f}x" for k, v in result["speedups"].items())
    ratios = byte_ratios(result)
    if ratios:
        line += " (bytes read per token: " + ", ".join(
            f"{k.removeprefix('flash_vs_')} {v:.2f}x flash's" for k, v in ratios.items()) + ")"
    return line


def plots(result, out: Path) -> dict:
    """PNG files for the sweeps that ran: {name: file name} (or {"skipped": reason})."""
    sweeps = result.get("sweeps") or {}
    if not sweeps:
        return {}
    try:
        import matplotlib
    except ImportError:
        return {"skipped": "matplotlib is not installed (pip install matplotlib)"}
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = {}
    pack_bytes = result["model"]["pack_bytes"]
    if sweeps.get("budget"):
        fig, ax = plt.subplots(figsize=(6, 4))
        for mode in ("hybrid", "flash"):
            pts = sorted(((r["plan_weights_bytes"] or 0) / pack_bytes, r["total_ms"])
                         for label, r in sweeps["budget"].items()
                         if label.startswith(mode + "@") and r["ok_runs"])
            if pts:
                ax.plot(*zip(*pts), marker="o", label=mode)
        ax.set_xlabel("weights held in memory (fraction of the model)")
        ax.set_ylabel("latency per token (ms)")
        ax.set_title("Latency vs memory budget (cf. paper Fig. 7)", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend()
        made["budget"] = _save(fig, out / "sweep_budget.png", plt)
    if sweeps.get("window"):
        rows = sorted((int(label.split("@w")[1]), r) for label, r in sweeps["window"].items()
                      if r["ok_runs"])
        if rows:
            fig, ax = plt.subplots(figsize=(6, 4))
            ws = [w for w, _ in rows]
            ax.plot(ws, [r["total_ms"] for _, r in rows], marker="o", label="total ms/token")
            ax.plot(ws, [r["io_ms"] for _, r in rows], marker="s", label="I/O ms/token")
            ax.set_xlabel("window k (tokens)")
            ax.set_ylabel("ms per token")
            ax2 = ax.twinx()
            ax2.plot(ws, [(r["plan_weights_bytes"] or 0) / 1e9 for _, r in rows], "k--",
                     marker="^", label="weights in DRAM (GB)")
            ax2.set_ylabel("weights in DRAM (GB)")
            ax.legend(loc="upper left", fontsize=8)
            ax2.legend(loc="upper right", fontsize=8)
            ax.set_title("Window size: latency vs DRAM (cf. paper Fig. 7)", fontsize=9)
            ax.grid(alpha=0.3)
            made["window"] = _save(fig, out / "sweep_window.png", plt)
    steps = result.get("length_steps") or {}
    if steps:
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, s in steps.items():
            io = s["io_ms"]
            k = max(1, min(16, len(io) // 10))
            smooth = [sum(io[max(0, i - k + 1): i + 1]) / len(io[max(0, i - k + 1): i + 1])
                      for i in range(len(io))]
            ax.plot(range(1, len(io) + 1), smooth, label=f"{label} (mean of {k})")
        ax.set_xlabel("generated token")
        ax.set_ylabel("flash I/O per token (ms)")
        ax.set_title("Weight loading latency over generation (cf. paper Fig. 8)", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        made["length"] = _save(fig, out / "sweep_length.png", plt)
    return made


def _save(fig, path, plt):
    fig.tight_layout()
    # the temporary keeps the suffix, from which savefig takes the format
    write_file_atomic(path, lambda tmp: fig.savefig(tmp, dpi=110), suffix=path.suffix)
    plt.close(fig)
    return path.name


def _ms(v, std=None):
    if v is None:
        return "-"
    return f"{v:.1f}" + (f" ± {std:.1f}" if std else "")


def _table3_md(result) -> list:
    """Table 3's rows; "prompt ms": the first prompt after loading (its forward pass for mlx-flash,
    the time to the first token for peers), the time a user waits before the first token."""
    lines = ["| Method | I/O ms | Mem ms | Compute ms | Total ms/token | MB read/token | hit rate "
             "| weights held GB | peak GB (cap) | prompt ms |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["table3"]:
        cap = f" ({r['cap_gb']:.2f})" if r.get("cap_gb") else ""
        if not r["ok"]:
            err = "; ".join(r["errors"])[:160]
            if r.get("status") in ("not installed", "not run"):  # nothing ran: no figures
                lines.append(f"| {r['method']} | {r['status']}: {err} | | | | | | | | |")
                continue
            peak = "-" if r["peak_gb"] is None else f"{r['peak_gb']:.2f}{cap}"
            lines.append(f"| {r['method']} | does not fit / failed: {err} | | | | | | | {peak} | |")
            continue
        prompt = _ms(r.get("prompt_ms"))
        if r["kind"] == "peer":
            lines.append(f"| {r['method']} | - | - | - | {_ms(r['total_ms'], r.get('total_ms_std'))} "
                         f"| - | - | - | {r['peak_gb']:.2f}{cap} | {prompt} |")
            continue
        hit = "-" if r["hit_rate"] is None else f"{100 * r['hit_rate']:.1f}%"
        lines.append(f"| {r['method']} | {_ms(r['io_ms'])} | {_ms(r['mem_ms'])} | "
                     f"{_ms(r['compute_ms'])} | {_ms(r['total_ms'], r['total_ms_std'])} | "
                     f"{r['bytes_read'] / 1e6:.2f} | {hit} | {(r['plan_weights_bytes'] or 0) / 1e9:.3f} "
                     f"| {r['peak_gb']:.2f}{cap} | {prompt} |")
    return lines


def _table2_md(result) -> list:
    lines = ["| Hybrid | Predictor | Windowing | Bundling | DRAM GB (weights) | Flash→DRAM MB/token "
             "| Throughput GB/s | I/O ms/token |", "|---|---|---|---|---|---|---|---|"]

    def tick(b):
        return "✓" if b else "✗"

    for r in result["table2"]:
        flags = " | ".join(tick(r[k]) for k in ("hybrid", "predictor", "windowing", "bundling"))
        if not r["ok"]:
            lines.append(f"| {flags} | failed: {'; '.join(r['errors'])[:120]} | | | |")
            continue
        tp = "-" if r["throughput_gbps"] is None else f"{r['throughput_gbps']:.2f}"
        lines.append(f"| {flags} | {r['dram_gb']:.3f} | {r['flash_to_dram_mb']:.2f} | {tp} | "
                     f"{_ms(r['io_ms'], r['io_ms_std'])} |")
    return lines


def markdown(result) -> str:
    """report.md: what ran, how, and every table and plot."""
    m, p = result["model"], result["protocol"]
    syn = m.get("synthetic")
    out = ["# mlx-flash benchmark report", ""]
    if syn:
        out += [f"**SYNTHETIC pack** ({syn.get('arch')}, {syn.get('sparsity'):.0%} FFN sparsity, "
                f"{syn.get('dtype')}): random weights in a real architecture's shape, for speed only; "
                "the generated text is meaningless.", ""]
    cap = p["cap"]
    cap_text = (f"cgroup v1 memory cap {cap['cap_bytes'] / 1e9:.3f} GB per run (weights budget "
                f"{p['budget_bytes'] / 1e9:.3f} GB + measured process baseline "
                f"{cap.get('baseline_bytes', 0) / 1e9:.3f} GB + KV cache bound "
                f"{cap.get('kv_cache_bytes', 0) / 1e9:.3f} GB); page cache included"
                if cap["used"] else f"no memory cap ({cap['reason'] if cap['asked'] else 'not asked'})")
    ev = ", ".join(f"{k} (max residency left {v['max_residency_after']:.1%})"
                   for k, v in p["eviction"].items())
    mc = result["machine"]
    out += [f"- Command: `{result['command']}`",
            f"- Model: `{m['pack']}`, {m['pack_bytes'] / 1e9:.3f} GB, resident part "
            f"{m['resident_bytes'] / 1e9:.3f} GB ({m['resident_bytes'] / m['pack_bytes']:.0%}), "
            f"{m['layers']} FFN layers",
            f"- Machine: {mc.get('cpu', mc['machine'])}, {mc['cpus']} CPUs, "
            f"{mc.get('memory_bytes', 0) / 1e9:.1f} GB RAM, {mc['platform']}; load average at "
            f"the end {mc['load_average']}",
            f"- Packages: {', '.join(f'{k} {v}' for k, v in result['packages'].items())}",
            f"- Protocol: {p['prompt_tokens']}-token prompts of real text ("
            f"{', '.join(sorted({Path(x['source']).name for x in p['prompts']}))}), "
            f"{p['gen_tokens']} generated tokens (greedy), {p['repeats']} cold repeats (mean ± std), "
            f"window {p['window']}, {p['threads']} reads in flight, memory budget "
            f"{p['memory_budget']} = {p['budget_bytes'] / 1e9:.3f} GB of weights",
            f"- Cold runs: before every run the files it reads were evicted with {ev}",
            f"- Memory: {cap_text}"]
    if result.get("read_cost_profile"):
        out.append(f"- Reads priced by the {result['read_cost_profile']}")
    out.append("")
    out += ["## Per token, end to end (cf. paper Table 3)", ""] + _table3_md(result) + [""]
    out += ["I/O = reads from the pack, Mem = neuron-cache management, Compute = the rest of each "
            "decode step; dense runs need every weight (they do not fit under a cap below the "
            "model size). Peaks are the cgroup's max usage (anon + page cache) when cgroups are "
            "available, else ru_maxrss.", ""]
    acc = [r for r in result["table3"] if r["kind"] == "mlx-flash" and r["ok"]]
    if acc:
        good = all(r.get("accounting_ok") for r in acc)
        out += [f"Byte accounting: bytes counted per token by the statistics "
                f"{'equal' if good else 'DO NOT equal'} the bytes the loader read, and neuron-cache "
                f"row counters equal the reads that landed in caches, in every run.", ""]
    fl = (result.get("modes") or {}).get("flash") or {}
    if fl.get("active_fraction") is not None:
        out += [flash_sparsity_line(fl), ""]
    if result["speedups"]:
        out += ["Speed-ups of flash (per-token latency ratio): " + speedup_line(result), ""]
    if result["table2"]:
        out += ["## Ablation (cf. paper Table 2)", ""] + _table2_md(result) + [
            "", "+Predictor: flash with every neuron cache emptied before each token (no window); "
            "+Predictor and +Windowing read up rows and down columns as separate requests from a "
            "matrix-major copy (bench io's unbundled copy); +Bundling is the flash mode. DRAM = "
            "weights the memory plan holds.", ""]
    for name, rows in (result.get("sweeps") or {}).items():
        out += [f"## Sweep: {name}", "", "| run | weights held GB | total ms/token | I/O ms/token "
                "| MB read/token | hit rate |", "|---|---|---|---|---|---|"]
        for label, r in rows.items():
            if not r["ok_runs"]:
                out.append(f"| {label} | failed: {'; '.join(r['errors'])[:120]} | | | | |")
                continue
            hit = "-" if r["hit_rate"] is None else f"{100 * r['hit_rate']:.1f}%"
            out.append(f"| {label} | {(r['plan_weights_bytes'] or 0) / 1e9:.3f} | {_ms(r['total_ms'])} "
                       f"| {_ms(r['io_ms'])} | {r['bytes_read'] / 1e6:.2f} | {hit} |")
        if name in result.get("plots", {}):
            out += ["", f"![{name}]({result['plots'][name]})"]
        out.append("")
    if "skipped" in result.get("plots", {}):
        out += [f"Plots skipped: {result['plots']['skipped']}", ""]
    if result.get("peers"):
        out += ["## Peers", ""]
        for name, pr in result["peers"].items():
            state = (f"{pr['total_ms']:.1f} ms/token" if pr.get("ok") else
                     f"{pr['status']}: {pr.get('error')}" if pr.get("status") in ("not installed", "not run")
                     else f"does not fit / failed: {pr.get('error')}")
            out.append(f"- **{name}**: {state}. {pr.get('note', '')}")
        out.append("")
    return "\n".join(out)


def flash_sparsity_line(fl) -> str:
    """What the flash runs needed per token, with its denominator (all FFN neurons of the model)."""
    sparse = fl.get("sparse_layers")
    if sparse == 0:
        return ("Flash: the memory plan ran no layer sparse (every FFN neuron of every layer was "
                "computed: resident or streamed whole).")
    layers = "" if sparse is None else f"; {sparse} of {fl.get('ffn_layers')} layers ran sparse"
    return (f"Flash: {100 * fl['active_fraction']:.1f}% of the model's FFN neurons were needed per "
            f"token on average (predicted-active neurons of the sparse layers plus every neuron of "
            f"the others{layers}).")


def summary(result) -> str:
    """The printed summary: Table 3, speed-ups, Table 2."""
    lines = ["", "== mlx-flash bench run ==", f"command: {result['command']}"]
    if result["model"].get("synthetic"):
        lines.append("model: SYNTHETIC pack (random weights, speed only)")
    lines += [""] + _table3_md(result)
    if result["speedups"]:
        lines += ["", "flash speed-up: " + speedup_line(result)]
    if result["table2"]:
        lines += [""] + _table2_md(result)
    return "\n".join(lines)
