"""python -m mlx_flash.bench endor: ENDOR's Figure 5 per layer — cold read + decode of one FFN
layer stored dense, as ENDOR (bitmap + non-zeros) and as zstd-compressed dense bytes.

    python -m mlx_flash.bench endor --pack ENDOR_PACK [--dense DENSE_PACK] [--layers 0,5,10]
        [--repeats 3] [--zstd-level 3] [--isa avx2,avx512] [--json OUT]
    python -m mlx_flash.bench endor --pack ENDOR_PACK --warm [--isa scalar,avx2,avx512] [--repeats 20]
        (check + decode speed of layers in memory, per instruction set, one core and the pool)
    python -m mlx_flash.bench endor --pack ENDOR_PACK --ffn [--layers ...] [--repeats 20]
        (one token's FFN of a layer held encoded, warm: decode + matvecs vs decode-matvec)
    python -m mlx_flash.bench endor --compare-runs DENSE_RUN ENDOR_RUN
        (end to end: two `bench run --out` folders of the dense and the ENDOR pack of one model,
        same modes, budget and cap: tokens/s, I/O ms and bytes per token side by side)

Per layer and repeat, in rotating order (so background load hits every format alike), each format
is read cold (pages evicted first; O_DIRECT where the file system allows it) as one read of its
whole bundle region, then decoded into dense rows:
    dense  the dense pack's layer file (--dense), else the ENDOR layer's rows decoded and written
           to a scratch file in the dense pack layout; no decode step
    endor  the ENDOR layer file's bundle region, decoded by the C++ kernel (mlx_flash/endor)
    zstd   the dense bytes compressed with zstandard (level --zstd-level) in a scratch file,
           decompressed with zstandard (one thread)
    with --dense, also the runtime's own path, cold, through FlashLoader (native AIO direct
    reads, crc32 checks, ENDOR bundles checked + decoded as their reads land):
    dense-loader / endor-loader  one whole-layer read into decoded rows; decode ms = the part of
           the wall time spent in the check + decode pass (overlapped with the reads in flight)
--isa LIST: the ENDOR decode (and endor-loader) rows once per instruction set listed, alternated
with the others in every repeat: `endor` / `endor-loader` run the kernels' active ISA (the best
this CPU has unless MLX_FLASH_ISA says otherwise), `endor@ISA` / `endor-loader@ISA` the others.
Reported: bytes read, read ms, decode ms, their sum, bytes and total time relative to dense,
and decode time as a fraction of the read time ENDOR saves. Timings are medians over repeats.

--warm: each layer's bundles already in memory, checked (crc32) and decoded into rows by every
instruction set listed (default: all this CPU runs), on one core and on the kernels' thread pool,
rotated in each repeat: median wall ms, GB/s of encoded bytes in and of decoded rows out, and on
one core the thread's CPU ms (what a loaded machine's time slicing does not inflate).

--ffn: for a layer held ENDOR-encoded (as hybrid holds them, bundles in memory), one token's FFN
two ways, alternated in each repeat: `decode+matvec` = decode_into the layer's rows (the check-free
decode of FlashLoader.decode_encoded) then the CPU kernels' matvecs (half_matvec gate and up,
silu(g) * u, gather_matvec_t down); `decode-matvec` = mlx_flash.cpu.endor.endor_ffn_cpu, which
never writes the decoded rows. Both outputs are compared (float32 x, relative 1e-3).
"""

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ..errors import FlashError
from ..paths import write_json_atomic


def add_arguments(parser):
    parser.add_argument("--pack", help="a pack converted with --encoding endor")
    parser.add_argument("--compare-runs", nargs=2, metavar=("DENSE_RUN", "ENDOR_RUN"),
                        help="instead: compare two `bench run` output folders (results.json)")
    parser.add_argument("--dense", help="the dense pack of the same model (default: the ENDOR "
                                        "layers decoded into a scratch dense file)")
    parser.add_argument("--layers", default="", help="comma-separated layer indices (default: 4 "
                                                     "spread over the model)")
    parser.add_argument("--repeats", type=int, default=3, help="cold runs per layer and format")
    parser.add_argument("--zstd-level", type=int, default=3)
    parser.add_argument("--drop-caches", action="store_true",
                        help="as root, also drop the page cache if fadvise leaves pages cached")
    parser.add_argument("--isa", default="", help="comma-separated instruction sets (scalar, avx2, "
                                                  "avx512) to time the ENDOR decode with, alternated "
                                                  "(default: the kernels' active one)")
    parser.add_argument("--warm", action="store_true",
                        help="instead: check + decode speed of layers in memory, per instruction set")
    parser.add_argument("--ffn", action="store_true",
                        help="instead: one token's FFN of held-encoded layers, decode + matvecs vs "
                             "the CPU decode-matvec (warm)")
    parser.add_argument("--json", help="write the results here too")
    parser.add_argument("--verbose", action="store_true")


def _cold_read(path: Path, start: int, length: int, drop_caches: bool) -> tuple:
    """(bytes object-like uint8 view of [start, start+length), seconds, bytes read): evict the
    file, then read the covering 4 KiB-aligned range with O_DIRECT (buffered if refused)."""
    from ..io import evict
    from ..io.files import FileLayer, aligned_buffer, read_full

    evict([path], drop_caches=drop_caches)
    align = 4096
    a0 = start // align * align
    a1 = -(-(start + length) // align) * align
    size = os.path.getsize(path)
    a1 = min(a1, -(-size // align) * align)
    files = FileLayer()
    fd, direct = files.open(path, True)
    buf = aligned_buffer(a1 - a0)
    try:
        t0 = time.perf_counter()
        read_full(files, fd, [buf], a0, path)
        seconds = time.perf_counter() - t0
    except FlashError:
        files.close(fd)  # the aligned range ran past the end of the file: read it buffered
        fd, direct = files.open(path, False)
        t0 = time.perf_counter()
        n = os.preadv(fd, [buf], a0)
        seconds = time.perf_counter() - t0
        buf = buf[:n]
    finally:
        files.close(fd)
    view = np.frombuffer(buf, np.uint8)[start - a0: start - a0 + length]
    return view, seconds, a1 - a0, direct


def _dense_region(entry, comps: dict) -> np.ndarray:
    """uint8 [count * stride] bytes of decoded rows in the dense pack's bundle layout."""
    from ..pack.layout import round_up

    count = entry["count"]
    widths = [c["length"] for c in entry["components"]]
    offsets, pos = [], 0
    for w in widths:
        offsets.append(pos)
        pos = round_up(pos + w, 4)
    data = np.zeros((count, pos), np.uint8)
    for c, off in zip(entry["components"], offsets):
        data[:, off: off + c["length"]] = comps[c["name"]]
    return data.reshape(-1)


def layer_formats(pack: Path, entry, dense_pack, scratch: Path, level: int) -> dict:
    """{format: (path, start, length)} of one layer, writing the scratch files needed."""
    import zstandard

    from ..pack.bitmap import decode_into
    from ..pack.reader import endor_roles, read_bundle_index

    path = pack / entry["file"]
    index = read_bundle_index(path, entry)
    data = np.fromfile(path, np.uint8)
    dest = {c["name"]: np.zeros((entry["count"], c["length"]), np.uint8) for c in entry["components"]}
    decode_into(data, index[:-1], np.diff(index), np.arange(entry["count"]), endor_roles(entry, dest), str(path))
    dense_bytes = _dense_region(entry, dest)
    formats = {"endor": (path, int(index[0]), int(index[-1] - index[0]))}
    if dense_pack is not None:
        from ..pack import layer_bundles, read_manifest

        d = layer_bundles(read_manifest(dense_pack))[entry["layer"]]
        formats["dense"] = (dense_pack / d["file"], d["offset"], d["count"] * d["stride"])
        dense_bytes = np.fromfile(dense_pack / d["file"], np.uint8)[d["offset"]: d["offset"] + d["count"] * d["stride"]]
    else:
        p = scratch / f"dense_{entry['layer']:03d}.bin"
        p.write_bytes(dense_bytes.tobytes())
        formats["dense"] = (p, 0, dense_bytes.size)
    z = zstandard.ZstdCompressor(level=level).compress(dense_bytes.tobytes())
    zp = scratch / f"zstd_{entry['layer']:03d}.zst"
    zp.write_bytes(z)
    formats["zstd"] = (zp, 0, len(z), dense_bytes.size)
    return formats, dest


def measure_layer(entry, index, formats, dest, repeats, drop_caches, loaders=None, isas=None) -> dict:
    """{format: {"bytes", "read_ms", "decode_ms", "total_ms"}} medians over cold repeats.
    loaders: {"dense-loader": FlashLoader, "endor-loader": FlashLoader} to time the runtime path;
    isas: {"endor@avx2": "avx2", "endor-loader@avx2": "avx2", ...}: more ENDOR rows, each decoded
    with that instruction set (formats["endor"] and loaders["endor-loader"] are read for them)."""
    import zstandard

    from ..pack.bitmap import decode_into
    from ..pack.reader import endor_roles

    roles = endor_roles(entry, dest)
    isas = isas or {}
    order = ["dense", "endor", "zstd"] + sorted(loaders or {}) + list(isas)
    times = {f: {"read": [], "decode": []} for f in order}
    nbytes = {}
    dctx = zstandard.ZstdDecompressor()
    for r in range(repeats):
        for f in order[r % len(order):] + order[: r % len(order)]:
            base = f.split("@")[0]
            if base in (loaders or {}):
                nbytes[f], read_s, decode_s = _loader_read(loaders[base], entry.layer, drop_caches, isas.get(f))
                times[f]["read"].append(read_s - decode_s)
                times[f]["decode"].append(decode_s)
                continue
            path, start, length = formats[base][:3]
            view, read_s, read_bytes, _ = _cold_read(path, start, length, drop_caches)
            nbytes[f] = length
            t0 = time.perf_counter()
            if base == "endor":
                decode_into(view, index[:-1] - start, np.diff(index), np.arange(entry.count), roles,
                            str(path), isa=isas.get(f))
            elif f == "zstd":
                out = dctx.decompress(view.tobytes(), max_output_size=formats["zstd"][3])
                if len(out) != formats["zstd"][3]:
                    raise FlashError(f"{path}: zstd output {len(out)} bytes, want {formats['zstd'][3]}")
            decode_s = time.perf_counter() - t0
            times[f]["read"].append(read_s)
            times[f]["decode"].append(decode_s)
    out = {}
    for f in order:
        read = statistics.median(times[f]["read"]) * 1e3
        dec = statistics.median(times[f]["decode"]) * 1e3
        out[f] = {"bytes": nbytes[f], "read_ms": read, "decode_ms": dec, "total_ms": read + dec}
    return out


FORMATS = ("dense", "endor", "zstd", "dense-loader", "endor-loader")
_LOADER_DEST = {}  # (loader, layer) -> destination rows, reused as the runtime reuses its buffers


def _loader_read(loader, layer, drop_caches, isa=None) -> tuple:
    """(bytes read, wall seconds, check + decode seconds) of one cold whole-layer loader.read into
    rows allocated and touched before the first timed read (no page faults timed); isa: the
    kernels' instruction set for this read (None: the active one)."""
    from ..io import evict
    from ..pack.bitmap import _extension

    entry = loader.entry(layer)
    key = (loader, layer)  # the loader itself (hashed by identity), so no later loader can match it
    if key not in _LOADER_DEST:
        _LOADER_DEST.clear()
        _LOADER_DEST[key] = loader.alloc(layer, entry.count)
        loader.read(layer, np.arange(entry.count), _LOADER_DEST[key])  # opens tables, faults pages
    evict([loader.pack / entry.file], drop_caches=drop_caches)
    ext = _extension() if isa else None
    active = ext.isa() if ext else None
    try:
        if ext:
            ext.set_isa(isa)
        stats = loader.read(layer, np.arange(entry.count), _LOADER_DEST[key])
    finally:
        if ext:
            ext.set_isa(active)
    return stats.bytes_read, stats.seconds, stats.decode_seconds


def compare_runs(dense_dir, endor_dir) -> str:
    """Markdown table of two `bench run` results (dense pack vs ENDOR pack), mode by mode."""
    runs = []
    for d in (dense_dir, endor_dir):
        path = Path(d) / "results.json"
        try:
            runs.append(json.loads(path.read_text()))
        except (OSError, ValueError) as e:
            raise FlashError(f"--compare-runs {path}: unreadable ({e})") from None
    dense, endor = runs
    lines = [f"dense: `{dense['command']}`", f"ENDOR: `{endor['command']}`", "",
             "| mode | dense tok/s | ENDOR tok/s | speedup | dense I/O ms | ENDOR I/O ms | "
             "dense MB/tok | ENDOR MB/tok | bytes ratio |", "|---|---|---|---|---|---|---|---|---|"]
    for mode, d in dense["modes"].items():
        e = endor["modes"].get(mode)
        if not e or not d.get("ok_runs") or not e.get("ok_runs"):
            continue
        lines.append(f"| {mode} | {1e3 / d['total_ms']:.2f} | {1e3 / e['total_ms']:.2f} | "
                     f"{d['total_ms'] / e['total_ms']:.2f}x | {d['io_ms']:.0f} | {e['io_ms']:.0f} | "
                     f"{d['bytes_read'] / 1e6:.1f} | {e['bytes_read'] / 1e6:.1f} | "
                     f"{e['bytes_read'] / d['bytes_read']:.3f} |")
    return "\n".join(lines)


def run(args) -> int:
    from ..pack.bitmap import _extension
    from ..pack import layer_bundles, read_manifest
    from ..pack.reader import read_bundle_index

    if args.compare_runs:
        print(compare_runs(*args.compare_runs))
        return 0
    if not args.pack:
        raise FlashError("--pack: required (or --compare-runs DENSE_RUN ENDOR_RUN)")
    if args.repeats < 1:
        raise FlashError(f"--repeats {args.repeats}: must be at least 1")
    pack = Path(args.pack)
    manifest = read_manifest(pack)
    bundles = layer_bundles(manifest)
    endor_layers = sorted(i for i, b in bundles.items() if b.encoding == "endor")
    if not endor_layers:
        raise FlashError(f"--pack {pack}: no ENDOR-encoded layers (convert with --encoding endor)")
    dense = Path(args.dense) if args.dense else None
    if dense is not None:
        read_manifest(dense)
    if args.layers:
        try:
            layers = [int(x) for x in args.layers.split(",") if x.strip()]
        except ValueError:
            raise FlashError(f"--layers {args.layers!r}: comma-separated integers") from None
        missing = [i for i in layers if i not in endor_layers]
        if missing:
            raise FlashError(f"--layers {missing[0]}: not an ENDOR layer of {pack}")
    else:
        k = min(4, len(endor_layers))
        layers = [endor_layers[round(j * (len(endor_layers) - 1) / max(k - 1, 1))] for j in range(k)]
    isa_list = _isa_list(args.isa)
    if args.ffn:
        return _run_ffn(args, pack, bundles, layers)
    if args.warm:
        return _run_warm(args, pack, bundles, layers)
    rows = {}
    scratch_root = Path(tempfile.mkdtemp(prefix=".endor-bench-", dir=pack))
    loaders = {}
    if dense is not None:
        from ..io import FlashLoader

        loaders = {"dense-loader": FlashLoader(dense), "endor-loader": FlashLoader(pack)}
    active = _extension().isa() if _extension() is not None else None
    isas = {f"{base}@{isa}": isa for isa in isa_list if isa != active
            for base in ["endor"] + (["endor-loader"] if loaders else [])}
    names = ["dense", "endor", "zstd"] + sorted(loaders) + list(isas)
    try:
        for layer in layers:
            entry = bundles[layer]
            index = read_bundle_index(pack / entry.file, entry)
            formats, dest = layer_formats(pack, entry, dense, scratch_root, args.zstd_level)
            rows[layer] = measure_layer(entry, index, formats, dest, args.repeats, args.drop_caches, loaders,
                                        isas)
            r = rows[layer]
            print(f"layer {layer:3d}: " + "  ".join(
                f"{f} {r[f]['bytes'] / 1e6:.2f} MB {r[f]['read_ms']:.2f}+{r[f]['decode_ms']:.2f} ms"
                for f in names), file=sys.stderr)
    finally:
        import shutil

        for loader in loaders.values():
            loader.close()
        shutil.rmtree(scratch_root, ignore_errors=True)
    total = {f: {k: sum(rows[i][f][k] for i in layers) for k in ("bytes", "read_ms", "decode_ms", "total_ms")}
             for f in names}
    saved_read = total["dense"]["read_ms"] - total["endor"]["read_ms"]
    summary = {
        "endor_bytes_ratio": total["endor"]["bytes"] / total["dense"]["bytes"],
        "zstd_bytes_ratio": total["zstd"]["bytes"] / total["dense"]["bytes"],
        "endor_speedup": total["dense"]["total_ms"] / total["endor"]["total_ms"],
        "zstd_speedup": total["dense"]["total_ms"] / total["zstd"]["total_ms"],
        "endor_vs_zstd": total["zstd"]["total_ms"] / total["endor"]["total_ms"],
        "decode_over_saved_read": (total["endor"]["decode_ms"] / saved_read) if saved_read > 0 else None,
    }
    if loaders:
        summary["loader_speedup"] = total["dense-loader"]["total_ms"] / total["endor-loader"]["total_ms"]
    # decode / read saved per decoding row: the plain reads' and the loader's (dense-loader's
    # wall time minus the ENDOR loader read's non-decode part)
    summary["decode_over_saved_by_row"] = {}
    for f in names:
        base = f.split("@")[0]
        if base in ("endor", "endor-loader"):
            ref = "dense" if base == "endor" else "dense-loader"
            saved = total[ref]["total_ms"] - total[f]["read_ms"]
            summary["decode_over_saved_by_row"][f] = total[f]["decode_ms"] / saved if saved > 0 else None
    result = {"command": args.command_line, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "pack": str(pack), "dense": str(dense) if dense else "decoded scratch copy", "isa": active,
              "kernel": _extension() is not None, "repeats": args.repeats, "layers": rows,
              "total": total, "summary": summary}
    print(markdown(result))
    if args.json:
        write_json_atomic(args.json, result)
    return 0


def ffn_two_ways(entry, flat, offsets, x, repeats: int) -> dict:
    """{"decode+matvec": ms, "decode-matvec": ms, "max_rel_diff"}: medians over repeats of one
    token's FFN (gate, up, down bundles of float16 / bfloat16 blocks) from bundles in memory."""
    import mlx.core as mx

    from ..cpu import ops
    from ..cpu.endor import endor_ffn_cpu
    from ..pack.bitmap import decode_into
    from ..pack.reader import endor_roles

    names = [c.name for c in entry.components]
    if names != ["gate.weight", "up.weight", "down_t.weight"]:
        raise FlashError(f"--ffn: layer {entry.layer} holds {names}, not gate/up/down rows")
    payload = entry.components[0].endor
    dtype = {"float16": mx.float16, "bfloat16": mx.bfloat16}.get((payload or {}).get("dtype"))
    if dtype is None:
        raise FlashError(f"--ffn: layer {entry.layer}'s payload {payload} is not float16 / bfloat16")
    rows = {c.name: mx.zeros((entry.count, *c.shape), dtype) for c in entry.components}
    mx.eval(list(rows.values()))
    from ..io.loader import host_bytes

    dest = {name: host_bytes(r).reshape(entry.count, -1) for name, r in rows.items()}
    roles = endor_roles(entry, dest)
    starts, lengths, slots = offsets[:-1], np.diff(offsets), np.arange(entry.count)
    columns, down_columns = entry.components[1].shape[-1], entry.components[2].shape[-1]

    def decode_then_matvec():
        decode_into(flat, starts, lengths, slots, roles, "bench")
        g = ops.half_matvec(x, rows["gate.weight"])
        u = ops.half_matvec(x, rows["up.weight"])
        y = ops.gather_matvec_t(g * mx.sigmoid(g) * u, rows["down_t.weight"], n=entry.count)
        mx.eval(y)
        return y

    def fused():
        y = endor_ffn_cpu(x, flat, offsets, columns=columns, down_columns=down_columns, payload=payload)
        mx.eval(y)
        return y

    ways = {"decode+matvec": decode_then_matvec, "decode-matvec": fused}
    times = {k: [] for k in ways}
    outs = {k: f() for k, f in ways.items()}  # warm-up, and the outputs compared
    for r in range(repeats):
        for k in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
            t0 = time.perf_counter()
            ways[k]()
            times[k].append(time.perf_counter() - t0)
    a, b = (np.array(outs[k].astype(mx.float32)) for k in ways)
    rel = float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30))
    return {**{k: statistics.median(v) * 1e3 for k, v in times.items()}, "max_rel_diff": rel}


def _run_warm(args, pack, bundles, layers) -> int:
    """bench endor --warm: check + decode of in-memory layers per ISA and thread setting."""
    from ..cpu.ops import KERNEL_ISAS
    from ..pack.bitmap import _extension, decode_into
    from ..pack.reader import endor_roles, read_bundle_index, read_checksum_table

    ext = _extension()
    if ext is None:
        raise FlashError("--warm: the CPU kernels are not built (mlx_flash._ext)")
    isas = _isa_list(args.isa) or list(KERNEL_ISAS[: KERNEL_ISAS.index(ext.best_isa()) + 1])
    ways = [(isa, parallel) for isa in isas for parallel in (False, True)]
    times = {w: [] for w in ways}
    enc = dec = 0
    data = {}
    for layer in layers:
        entry = bundles[layer]
        path = pack / entry.file
        index = read_bundle_index(path, entry)
        dest = {c.name: np.zeros((entry.count, c.length), np.uint8) for c in entry.components}
        data[layer] = (np.fromfile(path, np.uint8), index, read_checksum_table(path, entry),
                       endor_roles(entry, dest), str(path), entry.count)
        enc += int(index[-1] - index[0])
        dec += sum(d.nbytes for d in dest.values())
    cpu = {w: [] for w in ways}
    for r in range(args.repeats + 1):  # the first round warms caches and pages up, untimed
        for isa, parallel in ways[r % len(ways):] + ways[: r % len(ways)]:
            t0, c0 = time.perf_counter(), time.thread_time()
            for flat, index, crcs, roles, where, count in data.values():
                decode_into(flat, index[:-1], np.diff(index), np.arange(count), roles, where, isa=isa,
                            crcs=crcs, parallel=parallel)
            if r:
                times[(isa, parallel)].append(time.perf_counter() - t0)
                cpu[(isa, parallel)].append(time.thread_time() - c0)
    lines = [f"`{args.command_line}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; layers "
             f"{','.join(map(str, layers))}: {enc / 1e6:.2f} MB encoded -> {dec / 1e6:.2f} MB of rows; "
             f"crc32 check + decode, medians of {args.repeats}; pool: {ext.num_threads()} threads)", "",
             "| ISA | threads | wall ms | GB/s in (encoded) | GB/s out (rows) | CPU ms (one core) | "
             "GB/s out per CPU second |", "|---|---|---|---|---|---|---|"]
    result = {}
    for isa, parallel in ways:
        s = statistics.median(times[(isa, parallel)])
        result[f"{isa}/{'pool' if parallel else 'one'}"] = s * 1e3
        # one core: the calling thread's CPU time, which time slices given to other jobs do not inflate
        c = None if parallel else statistics.median(cpu[(isa, parallel)])
        if c is not None:
            result[f"{isa}/one/cpu"] = c * 1e3
        lines.append(f"| {isa} | {'pool' if parallel else 'one core'} | {s * 1e3:.3f} | {enc / s / 1e9:.2f} | "
                     f"{dec / s / 1e9:.2f} | " + (f"{c * 1e3:.3f} | {dec / c / 1e9:.2f} |" if c else "| |"))
    print("\n".join(lines))
    if args.json:
        write_json_atomic(args.json, {"command": args.command_line, "ms": result,
                                      "encoded_bytes": enc, "decoded_bytes": dec})
    return 0


def _run_ffn(args, pack, bundles, layers) -> int:
    """bench endor --ffn: the table of ffn_two_ways over the layers."""
    import mlx.core as mx

    from ..pack.bitmap import _extension
    from ..pack.reader import read_bundle_index

    rows = {}
    for layer in layers:
        entry = bundles[layer]
        path = pack / entry.file
        index = read_bundle_index(path, entry)
        data = np.fromfile(path, np.uint8)
        flat = data[int(index[0]): int(index[-1])]
        x = mx.random.normal((1, entry.components[1].shape[-1]), key=mx.random.key(layer)).astype(mx.float32)
        rows[layer] = ffn_two_ways(entry, flat, index - index[0], x, args.repeats)
        if rows[layer]["max_rel_diff"] > 1e-3:
            raise FlashError(f"--ffn: layer {layer}: the two ways differ by {rows[layer]['max_rel_diff']:.2g}")
    ext = _extension()
    lines = [f"`{args.command_line}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; kernels: "
             f"{ext.isa() if ext else 'none'}, {ext.num_threads() if ext else 0} threads; one token, "
             f"medians of {args.repeats})", "",
             "| layer | decode + matvec ms | decode-matvec ms | speedup | max rel diff |", "|---|---|---|---|---|"]
    for layer, r in rows.items():
        lines.append(f"| {layer} | {r['decode+matvec']:.3f} | {r['decode-matvec']:.3f} | "
                     f"{r['decode+matvec'] / r['decode-matvec']:.2f}x | {r['max_rel_diff']:.1e} |")
    a = sum(r["decode+matvec"] for r in rows.values())
    b = sum(r["decode-matvec"] for r in rows.values())
    lines.append(f"| all | {a:.3f} | {b:.3f} | {a / b:.2f}x | |")
    print("\n".join(lines))
    if args.json:
        write_json_atomic(args.json, {"command": args.command_line, "layers": rows})
    return 0


def _isa_list(value: str) -> list:
    """--isa's instruction sets, each one this CPU runs (FlashError naming the flag otherwise)."""
    from ..cpu.ops import KERNEL_ISAS
    from ..pack.bitmap import _extension

    names = [x.strip() for x in value.split(",") if x.strip()]
    ext = _extension()
    if names and ext is None:
        raise FlashError("--isa: the CPU kernels are not built (mlx_flash._ext)")
    for name in names:
        if name not in KERNEL_ISAS:
            raise FlashError(f"--isa {name!r:.40}: unknown instruction set (choose from {', '.join(KERNEL_ISAS)})")
        if KERNEL_ISAS.index(name) > KERNEL_ISAS.index(ext.best_isa()):
            raise FlashError(f"--isa {name}: this CPU cannot run it (best: {ext.best_isa()})")
    return names


def markdown(result) -> str:
    lines = [f"`{result['command']}` ({result['date']}; dense = {result['dense']}; "
             f"medians of {result['repeats']} cold reads)", "",
             "| layer | format | MB read | read ms | decode ms | total ms | bytes vs dense | time vs dense |",
             "|---|---|---|---|---|---|---|---|"]
    items = list(result["layers"].items()) + [("all", result["total"])]
    for layer, r in items:
        for f in [f for f in r if f.split("@")[0] in FORMATS]:
            x = r[f]
            lines.append(f"| {layer} | {f} | {x['bytes'] / 1e6:.3f} | {x['read_ms']:.2f} | "
                         f"{x['decode_ms']:.2f} | {x['total_ms']:.2f} | "
                         f"{x['bytes'] / r['dense']['bytes']:.3f} | "
                         f"{x['total_ms'] / r['dense']['total_ms']:.3f} |")
    s = result["summary"]
    dec = s["decode_over_saved_read"]
    lines += ["", f"ENDOR: {s['endor_bytes_ratio']:.3f} of dense bytes, {s['endor_speedup']:.2f}x dense "
                  f"(read + decode), {s['endor_vs_zstd']:.2f}x zstd; zstd: {s['zstd_bytes_ratio']:.3f} "
                  f"of dense bytes, {s['zstd_speedup']:.2f}x dense; ENDOR decode = "
                  + (f"{dec:.1%} of the read time it saves" if dec is not None else
                     "n/a (no read time saved)")]
    by_row = s.get("decode_over_saved_by_row", {})
    if len(by_row) > 2 or result.get("isa"):
        lines.append(f"Decode / read saved per row (`endor`, `endor-loader`: {result.get('isa')}): " + ", ".join(
            f"{f} {v:.1%}" if v is not None else f"{f} n/a" for f, v in by_row.items()))
    if "loader_speedup" in s:
        lines.append(f"Through FlashLoader (the runtime's path, check + decode overlapped with the reads): "
                     f"ENDOR {s['loader_speedup']:.2f}x dense")
    return "\n".join(lines)
