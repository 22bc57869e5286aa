"""Cold-cache read throughput of the flash loader (the paper's Figure 2b) on one pack.

    python -m mlx_flash.bench io --pack PACK [--json FILE] [--plot FILE] [--parts large,experts]

Every timed run starts cold: the pack's pages are evicted first (mlx_flash.io.evict; the method
is reported) and the loader reads with O_DIRECT. Measured:
  1. chunk sweep: bundles read in chunks of k consecutive neurons, at several thread counts;
  2. ceiling: a plain large sequential O_DIRECT read of the same bundle files;
  3. bundled vs unbundled: the same random neuron sets read from the pack's bundles, and from a
     matrix-major copy (gate rows, up rows, down rows in separate regions: one request each);
  4. planner on vs off on the same neuron sets;
  5. fio --direct=1 --rw=randread on the same files, with the loader's read sizes and threads;
  6. large reads (64 KiB - 4 MiB, as MoE experts need): k consecutive bundles per read through
     FlashLoader.read_many into `alloc` destinations, next to fio at the same read size and depth;
  7. MoE packs: expert reads as the store issues them (top_k experts of one layer per call), next
     to fio at the block size with top_k in flight;
  8. where reads land: the AIO engine alone reading into memory of several kinds (a ring of fio's
     footprint, one buffer per read in shared / private / fresh / pre-faulted / huge-page /
     mlock'd / 512-byte-offset pages, an MLX array), next to fio (destination_kinds).
  9. segments per read: the same reads into the same huge-page memory as one piece, three pieces
     or size / 4 KiB iovecs (end to end, or dealt over three arrays as zero-copy neuron reads
     land), next to fio (--parts segments; destination_kinds with SEGMENT_KINDS).
 10. the read-cost profile of the pack's device (--parts profile): its table, when it was
     measured and how loaded the machine was then; with --calibrate that device's entry alone is
     measured again (the profile file's other entries are kept):
        python -m mlx_flash.bench io --pack PACK --parts profile --calibrate
--parts picks sections (sweep = 1-2, compare = 3-5, large = 6, experts = 7, dest = 8,
segments = 9, profile = 10; the default is all but dest, segments and profile). --baseline DIR runs
the FlashLoader of another checkout (DIR/mlx_flash, e.g. a worktree of an older commit) in 6 and 7
too, taking turns with this one and fio: old and new measured in one run under the same load.
Throughputs are GB/s = 1e9 bytes/s of useful bundle bytes unless marked "device" (bytes the
device returned, including alignment edges and merged gaps).
"""

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from ..errors import FlashError
from ..io import FlashLoader, ReadCost, evict
from ..io.loader import measure_cost
from ..io.planner import profile_file
from ..io.read_cost import (FREE_COPY, REMEASURE_COMMAND, describe_load, describe_profile, landing_terms,
                            segment_iovecs)
from ..io import aio
from ..io.files import FileLayer, address, aligned_buffer, read_full
from ..pack import FORMAT, FORMAT_VERSION, read_layer_components, read_manifest, write_bundle_file, write_manifest
from ..paths import write_json_atomic
from .report import machine_info, package_versions


def add_arguments(parser):
    parser.add_argument("--pack", required=True, help="flash pack directory")
    parser.add_argument("--json", help="write all results to this JSON file")
    parser.add_argument("--plot", help="PNG like the paper's Fig. 2b (default: io_bench.png "
                        "beside --json, else in the current directory); 'none' to skip")
    parser.add_argument("--threads", default="1,2,4,8,16,32", help="thread counts to sweep")
    parser.add_argument("--chunks", default="1,2,4,8,16,32,64",
                        help="consecutive bundles per read in the sweep")
    parser.add_argument("--fraction", type=float, default=0.1,
                        help="fraction of each layer's neurons read per run (default 0.1)")
    parser.add_argument("--sweep-fraction", type=float, default=0.5,
                        help="fraction of each layer read per chunk-sweep run (default 0.5: "
                        "enough reads at large chunk sizes to keep the queue full)")
    parser.add_argument("--repeat", type=int, default=3, help="cold runs per point (median kept)")
    parser.add_argument("--drop-caches", action="store_true",
                        help="also write /proc/sys/vm/drop_caches when fadvise leaves pages (root)")
    parser.add_argument("--no-fio", action="store_true", help="skip the fio comparison")
    parser.add_argument("--calibrate", action="store_true",
                        help="re-measure the read-cost profile of the pack's device (once per run; that "
                        "device's entry only) even if one is stored")
    parser.add_argument("--large-sizes", default="64K,128K,256K,512K,1M,2M,4M",
                        help="read sizes of the large-read table (bytes, K or M suffix)")
    parser.add_argument("--large-mb", type=int, default=256,
                        help="MB read per large-read run (at least 4 reads per slot in flight)")
    parser.add_argument("--parts", default="sweep,compare,large,experts",
                        help="what to measure: sweep (chunk sweep + sequential ceiling), compare "
                        "(bundled vs unbundled, planner, fio on the loader's read mix), large "
                        "(64 KiB - 4 MiB reads vs fio), experts (MoE packs: the store's reads vs fio), "
                        "dest (the AIO engine alone into memory of several kinds vs fio, at --large-sizes), "
                        "segments (the same reads as 1, 3 or size / 4 KiB iovec segments vs fio), "
                        "profile (the pack's device's stored read-cost profile, its date and the load "
                        "it was measured under; with --calibrate that device's entry alone measured "
                        "again, the other entries kept)")
    parser.add_argument("--large-verify", action="store_true",
                        help="large part: the loaders check each bundle's crc32, as a runtime does "
                        "(default off: the device's throughput alone)")
    parser.add_argument("--landing-paths", action="store_true",
                        help="large part: also run this loader with zero copy forced and with staging "
                        "forced, alternated (the two paths its read-cost profile chooses between)")
    parser.add_argument("--experts-per-call", type=int, metavar="K",
                        help="experts part: experts read per call (default: the model's top_k; "
                        "1-2 = the misses of a cached runtime's layer call), fio at depth K")
    parser.add_argument("--baseline", metavar="DIR",
                        help="large and experts parts: also run the FlashLoader of the mlx_flash "
                        "checkout in DIR (its repository root), alternated with this one and fio")
    parser.add_argument("--seed", type=int, default=0)


def baseline_loader(root):
    """The FlashLoader class of the mlx_flash checkout under `root`, imported as the package
    `mlx_flash_baseline` (only its io layer and what that imports: no model code)."""
    import importlib
    import types

    pkg_dir = Path(root).expanduser() / "mlx_flash"
    if not (pkg_dir / "io" / "loader.py").exists():
        raise FlashError(f"--baseline {root}: no mlx_flash/io/loader.py there")
    name = "mlx_flash_baseline"
    if name not in sys.modules:
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(pkg_dir)]  # a namespace for its submodules; its __init__ is not run
        sys.modules[name] = pkg
    return importlib.import_module(f"{name}.io.loader").FlashLoader


def _gb(nbytes, seconds):
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


class Bench:
    def __init__(self, args):
        self.args = args
        self.pack = Path(args.pack)
        self.manifest = read_manifest(self.pack)
        self.layers = sorted(b.layer for b in self.manifest.bundles)
        self.entries = {b.layer: b for b in self.manifest.bundles}
        self.rng = np.random.default_rng(args.seed)
        self.evict_fn = evict
        self.evict_methods = set()
        self.extra_paths = []
        self.baseline = baseline_loader(args.baseline) if getattr(args, "baseline", None) else None
        self.measured_profiles = {}  # depth -> the cost model measured in this run

    def paths(self):
        """The pack's bundle files."""
        return sorted({self.pack / e.file for e in self.entries.values()})

    def evict(self):
        paths = self.paths() + self.extra_paths
        r = self.evict_fn(paths, drop_caches=self.args.drop_caches)
        self.evict_methods.add(r["method"])
        if r["residency"] and r["residency"] > 0.01:
            print(f"warning: {r['residency']:.1%} of the pack still cached after {r['method']}",
                  file=sys.stderr)

    def cold(self, fn):
        """Median over --repeat cold runs of fn() -> ReadStats-like (seconds, bytes...)."""
        runs = []
        for _ in range(self.args.repeat):
            self.evict()
            runs.append(fn())
        runs.sort(key=lambda s: s.seconds)
        return runs[len(runs) // 2]


def _random_sets(bench, fraction):
    out = {}
    for layer in bench.layers:
        count = bench.entries[layer].count
        n = max(1, int(round(fraction * count)))
        out[layer] = np.sort(bench.rng.choice(count, n, replace=False))
    return out


def _chunk_sets(bench, fraction, k):
    out = {}
    for layer in bench.layers:
        count = bench.entries[layer].count
        chunks = max(1, count // k)
        n = max(1, min(chunks, int(round(fraction * count / k))))
        starts = np.sort(bench.rng.choice(chunks, n, replace=False)) * k
        out[layer] = (starts[:, None] + np.arange(k)[None, :]).reshape(-1)
    return out


def _read_sets(loader, sets, dests, layer_map=None):
    """One read_many over all layers (layer_map: pack layer -> loader layers, for unbundled)."""
    reqs = []
    for layer, ids in sets.items():
        for target in (layer_map or {layer: [layer]})[layer]:
            reqs.append((target, ids, dests[target], None))
    return loader.read_many(reqs)


def _alloc(loader, sets, layer_map=None):
    dests = {}
    for layer, ids in sets.items():
        for target in (layer_map or {layer: [layer]})[layer]:
            dests[target] = loader.alloc(target, len(ids))
    return dests


def chunk_sweep(bench, threads_list, chunks):
    stride = bench.entries[bench.layers[0]].stride
    align = bench.manifest.alignment
    rows = []
    for k in chunks:
        sets = _chunk_sets(bench, bench.args.sweep_fraction, k)
        for t in threads_list:
            # merge only touching bundles: one read per chunk
            max_read = -(-k * stride // align) * align + align
            with FlashLoader(bench.pack, threads=t, verify=False, cost=ReadCost(0.0, 1e9),
                             max_read=max_read) as loader:
                dests = _alloc(loader, sets)
                s = bench.cold(lambda: _read_sets(loader, sets, dests))
            rows.append({"chunk_bundles": k, "chunk_bytes": k * stride, "threads": t,
                         "gbps": _gb(s.bytes_useful, s.seconds),
                         "device_gbps": _gb(s.bytes_read, s.seconds), "reads": s.reads,
                         "seconds": s.seconds, "direct": s.direct})
    return rows


def parse_size(text) -> int:
    """'64K' / '4M' / '65536' -> bytes."""
    t = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20}.get(t[-1:], 1)
    try:
        return int(t[:-1] if mult > 1 else t) * mult
    except ValueError:
        raise FlashError(f"--large-sizes: {text!r} is not a size (bytes, or with K or M)") from None


def large_reads(bench, sizes, depth, total_bytes, with_fio, verify=False, landing_paths=False):
    """Per read size: random runs of k consecutive bundles (k x stride ~ the size) of every bundle
    file, read cold through FlashLoader.read_many into `alloc` destinations with `depth` reads in
    flight, and fio at the loader's read size, depth and files; the two take turns (--repeat).
    Sizes below one bundle are skipped. One untimed run first: steady state, where the loader's
    staging buffer exists (its first touch costs page faults a runtime pays once).
    landing_paths: also this loader with zero copy forced (no segment term) and with staging
    forced (segments priced at 1 s, the copy free), alternated with the rest: the two paths the
    device profile chooses between ("zero_copy_gbps", "staged_gbps")."""
    loader_keys = {}
    probe = FlashLoader(bench.pack, threads=depth, plan=False)
    try:  # readable bundles (an expert-bits layer is read per width group)
        loader_keys = {k: e for k, e in probe.bundles.items() if not getattr(e, "groups", None)}
    finally:
        probe.close()
    stride = max(e.stride for e in loader_keys.values())
    align = bench.manifest.alignment
    profile = device_profile(bench, depth)
    rows = []
    for size in sizes:
        k = max(1, round(size / stride))
        if k * stride > 2 * size:
            rows.append({"size": size, "skipped": f"bundles are {stride} bytes"})
            continue
        reads = max(4 * depth, total_bytes // (k * stride))
        sets = {}
        for key in loader_keys:
            count = loader_keys[key].count
            n = min(count // k, -(-reads // len(loader_keys)))
            if n:
                starts = np.sort(bench.rng.choice(count // k, n, replace=False)) * k
                sets[key] = (starts[:, None] + np.arange(k)[None, :]).reshape(-1)
        if not sets:
            rows.append({"size": size, "skipped": f"bundle files hold fewer than {k} bundles"})
            continue
        max_read = -(-k * stride // align) * align + align  # one read per run of k bundles
        # the device profile as the loader prices reads (its curve's read time plus the segment
        # and copy terms at this read size choose zero copy or staging); max_read keeps one read
        # per run of k bundles whatever its merge gap
        seg_s, copy_s = (float(t) for t in landing_terms(profile, k * stride))
        landing = (seg_s, 1 / copy_s if copy_s > 0 else 0.0)
        cost = profile.at_depth(depth) if hasattr(profile, "at_depth") else ReadCost(0.0, 1e9, *landing)
        loaders = {name: cls(bench.pack, threads=depth, verify=verify, cost=cost,
                             max_read=max_read) for name, cls in loader_classes(bench).items()}
        if landing_paths:
            for name, forced in (("zero_copy", ReadCost(0.0, 1e9)), ("staged", ReadCost(0.0, 1e9, 1.0, FREE_COPY))):
                loaders[name] = FlashLoader(bench.pack, threads=depth, verify=verify, cost=forced,
                                            max_read=max_read)
        try:
            dests = {name: _alloc(ld, sets) for name, ld in loaders.items()}
            warm = {name: _read_sets(ld, sets, dests[name]) for name, ld in loaders.items()}["loader"]
            read_bytes = max(warm.read_sizes, key=warm.read_sizes.get)
            fns = {name: (lambda ld=ld, d=dests[name]: _read_sets(ld, sets, d))
                   for name, ld in loaders.items()}
            if aio.available():  # the engine alone: into a ring as small as fio's buffers, and
                # into one buffer per read, as large as the loader's destinations
                fns["aio_ring"] = lambda: aio_ring(bench.paths(), read_bytes, warm.reads, depth,
                                                   bench.rng)
                fns["aio_dest"] = lambda: aio_ring(bench.paths(), read_bytes, warm.reads, depth,
                                                   bench.rng, ring=warm.reads)
            cmd = fio_command(bench.paths(), depth, {read_bytes: 1}, warm.bytes_read, "libaio") \
                if with_fio else None
            fns = {name: _with_cpu(fn) for name, fn in fns.items()}
            if cmd:
                fns["fio"] = lambda: run_fio(cmd)
            res = interleaved(bench, fns)
            del dests
        finally:
            for ld in loaders.values():
                ld.close()
        s = res["loader"]
        parts = max(len(e.components) for e in loader_keys.values())
        segments = k * parts if parts > 1 else 1  # destination pieces of one zero-copy read
        row = {"size": size, "bundles_per_read": k, "read_bytes": read_bytes, "reads": s.reads,
               "zero_copy": s.zero_copy_reads == s.reads, "segment_s": landing[0],
               "copy_bandwidth": landing[1], "segments_per_read": segments,
               "profile_load": getattr(profile, "load", None),
               # what the profile adds to each read's time on either path (stage_saves_time)
               "read_s": float(cost.seconds(read_bytes)),
               "zero_copy_extra_s": (segments - 1) * landing[0],
               "staged_extra_s": read_bytes / landing[1] if landing[1] > 0 else float("inf"),
               "gbps": _gb(s.bytes_useful, s.seconds),
               "device_gbps": _gb(s.bytes_read, s.seconds), "seconds": s.seconds, "depth": depth,
               "verify": verify, "direct": s.direct}
        for name in ("aio_ring", "aio_dest", "baseline", "zero_copy", "staged"):
            if name in res:
                row[f"{name}_gbps"] = _gb(res[name].bytes_read, res[name].seconds)
        for name in ("zero_copy", "staged"):
            if name in res:
                row[f"{name}_zero_copy_reads"] = res[name].zero_copy_reads
        for name, r in res.items():  # CPU per read: what each reader spends besides the device
            if getattr(r, "cpu_s", None) is not None:
                reads_done = getattr(r, "reads", 0) or max(1, r.bytes_read // read_bytes)
                row[f"{name}_cpu_us_per_read"] = r.cpu_s / reads_done * 1e6
        if cmd:
            fio = res["fio"].bw / 1e9
            row.update(fio_gbps=fio, loader_over_fio=row["device_gbps"] / fio, fio_command=" ".join(cmd))
            for name in ("baseline", "zero_copy", "staged"):
                if f"{name}_gbps" in row:
                    row[f"{name}_over_fio"] = row[f"{name}_gbps"] / fio
        else:
            row["fio"] = "skipped (--no-fio)" if not with_fio else "fio not installed"
        rows.append(row)
    return rows


def _with_cpu(fn):
    """fn, its result given `cpu_s`: the process's CPU seconds (every thread: reading, copying,
    checking) during the call."""
    def run():
        c = time.process_time()
        r = fn()
        if getattr(r, "cpu_s", None) is None:  # (the engine alone times its reads itself)
            r.cpu_s = time.process_time() - c
        return r
    return run


def device_profile(bench, depth):
    """The pack's device's read-cost profile for the loader's engine, priced at `depth` in
    flight: the stored one, else (none stored, or --calibrate: once per run) measured now and
    stored in that device's entry, the profile file's other entries kept. Its segment and copy
    terms (io.read_cost.landing_terms, per read size) choose zero copy or staging
    (io.read_cost.stage_saves_time). None when it can be neither loaded nor measured."""
    if depth in bench.measured_profiles:
        return bench.measured_profiles[depth]
    probe = FlashLoader(bench.pack, threads=depth, plan=False)
    try:
        kind = probe.cost_engine()
        cost = None if bench.args.calibrate else probe.stored_cost()
    finally:
        probe.close()
    if cost is None:
        print(f"measuring the read cost model ({depth} in flight, {kind})...", file=sys.stderr)
        cost = bench.measured_profiles[depth] = measure_cost(bench.paths(), depth, kind)
    return cost


def profile_report(bench, depth) -> dict:
    """The profile part: the read-cost profile of the pack's device as device_profile gives it
    (with --calibrate: that device's entry measured again), for the report."""
    cost = device_profile(bench, depth)
    return {"file": str(profile_file()), "depth": depth, "engine": getattr(cost, "engine", None),
            "measured": getattr(cost, "measured", None), "load": getattr(cost, "load", None),
            "description": describe_profile(cost, profile_file()),
            "curve": cost.to_dict() if hasattr(cost, "to_dict") else None}


def curve_lines(curve: dict) -> list:
    """The lines of a ReadCostCurve.to_dict() table: microseconds per read by depth and size."""
    lines = ["measured us per read (rows: reads in flight; columns: read size)",
             "depth " + " ".join(f"{s // 1024:>7}K" for s in curve["sizes"])]
    lines += [f"{d:>5} " + " ".join(f"{t * 1e6:>8.1f}" for t in row)
              for d, row in zip(curve["depths"], curve["table"])]
    return lines


def print_profile(row):
    print(f"\nread-cost profile of the pack's device ({row['engine'] or 'straight line'}, priced at "
          f"depth {row['depth']}; re-measure this entry alone: {REMEASURE_COMMAND})")
    if row["curve"]:
        print("\n".join(curve_lines(row["curve"])))
        landing = row["curve"].get("landing")
        if landing:
            print("per extra destination segment: " + ", ".join(
                f"{s // 1024}K {t * 1e6:.2f} us" for s, t in zip(landing["sizes"], landing["segment_s"]))
                + "; staged copy: " + ", ".join(f"{s // 1024}K {b / 1e9:.2f} GB/s"
                                                for s, b in zip(landing["sizes"], landing["copy_bandwidth"])))
    print(row["description"])


def aio_ring(paths, read_bytes, reads, depth, rng, ring=None):
    """`reads` random O_DIRECT reads of `read_bytes` (4 KiB-aligned offsets) over `paths` by
    io/aio.py alone, `depth` in flight, into `ring` buffers (default `depth`: fio's buffer
    footprint) reused in turn: what the AIO engine does with no loader around it; ring=reads
    lands every read in memory of its own, as the loader's destinations do. Timed like
    ReadStats (seconds, bytes_read)."""
    ring = ring or depth
    buf = aligned_buffer(ring * read_bytes)  # faulted in (huge pages where granted), as alloc()'s
    addresses = address(buf) + (np.arange(reads) % ring) * read_bytes
    return aio_reads(paths, read_bytes, reads, depth, rng, addresses)


DEST_KINDS = ("ring_shared", "ring_private", "dest_shared", "dest_private", "dest_fresh",
              "dest_populate", "dest_hugepage", "dest_scattered", "dest_mlock", "dest_512", "dest_mlx")
# --parts segments: the same bytes into the same huge-page memory, one read = 1 segment (contiguous),
# 3 (one piece per component array), or size / 4 KiB iovecs (adjacent, or dealt over three arrays)
SEGMENT_KINDS = ("dest_hugepage", "dest_thirds", "dest_adjacent", "dest_scattered")
VECTORED_KINDS = ("dest_thirds", "dest_adjacent", "dest_scattered")


def _mapping(nbytes, private=True, populate=False, hugepage=False, lock=False):
    """An anonymous mmap of `nbytes` (+ 2 MiB so a 2 MiB-aligned start exists): shared (what
    io.files.aligned_buffer gave: shmem pages) or private, optionally MAP_POPULATE'd, advised
    MADV_HUGEPAGE before its first touch, or mlock'd. Returns (mmap, 2 MiB-aligned address)."""
    import ctypes
    import mmap

    flags = (mmap.MAP_PRIVATE if private else mmap.MAP_SHARED) | mmap.MAP_ANONYMOUS
    m = mmap.mmap(-1, nbytes + (2 << 20), flags=flags | (mmap.MAP_POPULATE if populate else 0))
    if hugepage:
        m.madvise(mmap.MADV_HUGEPAGE)
    base = address(m)
    if lock and ctypes.CDLL(None, use_errno=True).mlock(ctypes.c_void_p(base), ctypes.c_size_t(len(m))):
        raise FlashError(f"mlock of {len(m)} bytes failed (errno {ctypes.get_errno()})")
    return m, base + (-base % (2 << 20))


def destination_kinds(bench, sizes, depth, total_bytes, with_fio, kinds=DEST_KINDS):
    """Why landing reads in destinations costs: per read size, `total_bytes` of random O_DIRECT
    reads over the pack's bundle files by io/aio.py alone (no loader), `depth` in flight, into
    memory of each kind, taking turns with fio at that size and depth (--repeat, medians):
      ring_shared / ring_private: a ring of `depth` buffers reused in turn (fio's footprint), in
        shared (shmem) / private anonymous pages;
      dest_shared / dest_private: one buffer per read, touched once before the runs (a slot bank
        reused every call), shared / private pages;
      dest_fresh: one buffer per read, a new untouched private mapping every run (first touch
        inside the read); dest_populate: the same, MAP_POPULATE'd (pre-faulted at allocation);
      dest_hugepage: dest_private advised MADV_HUGEPAGE before its touch (2 MiB pages when the
        kernel grants them; the row says how many were granted); dest_scattered: the same memory,
        each read a vectored read of 4 KiB pieces dealt round-robin over three arrays, as a
        zero-copy read of neuron bundles lands its gate / up / down rows; dest_adjacent: the same
        memory, each read size / 4 KiB iovecs of 4 KiB laid end to end (as contiguous as
        dest_hugepage: iovecs alone); dest_thirds: the same memory, each read 3 iovecs, one run of
        whole rows per array (bundles stored component-major: 3 segments per read);
      dest_mlock: dest_private, mlock'd; dest_512: dest_private, each read 512 bytes past a page
        boundary (one more page per read); dest_mlx: an MLX array (mx.zeros: the loader's alloc).
    Returns rows {"size", "reads", "<kind>_gbps", "<kind>_over_fio", "fio_gbps", "fio_command",
    "hugepages_kb"} (device GB/s)."""
    import mlx.core as mx

    paths = bench.paths()
    rows = []
    for size in sizes:
        size = -(-size // 4096) * 4096
        reads = max(4 * depth, total_bytes // size)
        span = np.array([os.stat(p).st_size - size for p in paths]) // 4096
        if (span < 0).all():
            rows.append({"size": size, "skipped": "bundle files are smaller than one read"})
            continue
        keep = {}  # buffers that live across runs (slot banks)

        def touched(kind):
            if kind not in keep:
                n = reads * (size + 2 * 4096) + 512  # (dest_scattered: three arrays of whole rows)
                if kind == "dest_mlx":
                    arr = mx.zeros((n + 4096,), mx.uint8)
                    mx.eval(arr)
                    a = address(memoryview(arr))
                    keep[kind] = (arr, a + (-a % 4096))
                else:
                    m, a = _mapping(n, private=kind != "dest_shared",
                                    hugepage=kind == "dest_hugepage" or kind in VECTORED_KINDS,
                                    lock=kind == "dest_mlock")
                    np.frombuffer(m, np.uint8)[:] = 1
                    keep[kind] = (m, a)
            return keep[kind][1]

        def run(kind):
            if kind.startswith("ring"):
                m, base = _mapping(depth * size, private=kind == "ring_private")
                np.frombuffer(m, np.uint8)[:] = 1
                ring = depth
            elif kind in ("dest_fresh", "dest_populate"):
                m, base = _mapping(reads * size, populate=kind == "dest_populate")
                ring = reads
            else:
                m, base, ring = None, touched(kind) + (512 if kind == "dest_512" else 0), reads
            if kind in VECTORED_KINDS:
                iov = segment_iovecs(kind, base, size, reads)
                per = len(iov) // reads
                return aio_reads(paths, size, reads, depth, bench.rng, iov.ctypes.data
                                 + np.arange(reads) * per * aio.IOVEC.itemsize, iovecs=(iov, per))
            return aio_reads(paths, size, reads, depth, bench.rng, base + (np.arange(reads) % ring) * size)

        fns = {kind: (lambda k=kind: run(k)) for kind in kinds}
        cmd = fio_command(paths, depth, {size: 1}, reads * size, "libaio") if with_fio else None
        if cmd:
            fns["fio"] = lambda: run_fio(cmd)
        for kind in kinds:
            if kind not in ("dest_fresh", "dest_populate") and not kind.startswith("ring"):
                touched(kind)
        huge = sum(int(line.split()[1]) for line in open("/proc/self/smaps_rollup")
                   if line.startswith("AnonHugePages")) if os.path.exists("/proc/self/smaps_rollup") else 0
        res = interleaved(bench, fns)
        keep.clear()
        row = {"size": size, "reads": reads, "depth": depth, "hugepages_kb": huge}
        for kind in kinds:
            row[f"{kind}_gbps"] = _gb(res[kind].bytes_read, res[kind].seconds)
        if cmd:
            row["fio_gbps"] = res["fio"].bw / 1e9
            row["fio_command"] = " ".join(cmd)
            for kind in kinds:
                row[f"{kind}_over_fio"] = row[f"{kind}_gbps"] / row["fio_gbps"]
        rows.append(row)
    return rows


def aio_reads(paths, read_bytes, reads, depth, rng, addresses, iovecs=None):
    """`reads` random O_DIRECT reads of `read_bytes` (4 KiB-aligned offsets) over `paths` by
    io/aio.py alone, `depth` in flight, read i landing at addresses[i]; iovecs=(IOVEC array,
    iovecs per read): vectored reads, addresses[i] = the address of read i's first iovec (the
    array is kept alive here). Timed like ReadStats."""
    fds = [os.open(p, os.O_RDONLY | os.O_DIRECT) for p in paths]
    ctx = aio.AioContext(depth)
    try:
        span = np.maximum(np.array([os.fstat(fd).st_size - read_bytes for fd in fds]) // 4096, 0)
        usable = np.flatnonzero(span > 0)
        which = usable[rng.integers(0, len(usable), reads)]
        offsets = (rng.random(reads) * span[which]).astype(np.int64) * 4096
        t0, c0 = time.perf_counter(), time.process_time()
        counts = np.full(reads, read_bytes if iovecs is None else iovecs[1])
        res = ctx.read(np.array(fds)[which], offsets, counts, np.asarray(addresses, np.uint64),
                       None if iovecs is None else np.ones(reads, bool))
        seconds, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    finally:
        ctx.close()
        for fd in fds:
            os.close(fd)
    calls = _Calls(seconds, int(res[res > 0].sum()))
    calls.cpu_s = cpu_s  # the reads alone (not the buffers' allocation)
    return calls


def print_destination_kinds(rows, kinds=DEST_KINDS):
    if kinds == SEGMENT_KINDS:
        print("\nsegments per read (io/aio.py alone, no loader; device GB/s, % of fio in the same "
              "run): the same reads into the same huge-page memory as 1 piece (dest_hugepage), 3 "
              "pieces (dest_thirds), or 4 KiB iovecs end to end (dest_adjacent) or dealt over "
              "three arrays (dest_scattered: a zero-copy read of neuron bundles); see "
              "io.read_cost.segment_iovecs")
    else:
        print("\nwhere reads land (io/aio.py alone, no loader; device GB/s, % of fio in the same run; "
              "ring = fio's footprint of depth buffers, dest = one buffer per read; see "
              "bench.io.destination_kinds)")
    for r in rows:
        if "skipped" in r:
            print(f"  {r['size']}: skipped: {r['skipped']}")
            continue
        fio = f"fio {r['fio_gbps']:.3f}" if "fio_gbps" in r else "no fio"
        print(f"  {r['size'] >> 10} KiB x {r['reads']} reads, depth {r['depth']}: {fio}; "
              f"AnonHugePages {r['hugepages_kb']} kB")
        for kind in kinds:
            share = f" ({r[kind + '_over_fio']:.0%})" if kind + "_over_fio" in r else ""
            print(f"    {kind:<14} {r[kind + '_gbps']:.3f}{share}")


class _Calls:
    """Sequential loader calls timed as one run, shaped like ReadStats (seconds, bytes_read)."""
    def __init__(self, seconds, bytes_read):
        self.seconds, self.bytes_read = seconds, bytes_read


def expert_reads(bench, total_bytes, with_fio, per_call=None):
    """MoE packs: the expert store's read pattern, cold. Each call reads top_k (or `per_call`:
    e.g. 1-2, the misses of a cached runtime's layer call) random experts of
    one MoE layer (one read per expert block) into a slot bank, calls one after another through
    the layers; fio reads the same files at bs = the block size with iodepth = top_k. Returns
    {"top_k", "block_bytes", "calls", "ms_per_call", "device_gbps", fio: "fio_ms_per_call",
    "over_fio" = ms_per_call / fio_ms_per_call (the issue's target: <= 1.3)} or None (no
    uniform-width expert layers)."""
    from ..models.moe import top_k_of

    experts = {b.layer: b for b in bench.manifest.bundles if b.kind == "experts" and not b.groups}
    if not experts:
        return None
    top_k = per_call or top_k_of(bench.manifest.config)
    stride = max(e.stride for e in experts.values())
    calls = max(2 * len(experts), total_bytes // (top_k * stride))
    layers = [list(experts)[i % len(experts)] for i in range(calls)]
    picks = [np.sort(bench.rng.choice(experts[key].count, top_k, replace=False)) for key in layers]
    slots = np.arange(top_k)

    def calls_of(loader, bank):
        def run_calls():
            t0, nbytes = time.perf_counter(), 0
            for key, ids in zip(layers, picks):
                nbytes += loader.read(key, ids, bank, slots).bytes_read
            return _Calls(time.perf_counter() - t0, nbytes)
        return run_calls

    loaders = {name: cls(bench.pack, threads=max(32, top_k), cost=ReadCost(0.0, 1e9))
               for name, cls in loader_classes(bench).items()}
    try:
        fns = {name: calls_of(ld, ld.alloc(layers[0], top_k)) for name, ld in loaders.items()}
        for fn in fns.values():
            fn()  # untimed: opens the files, reads the checksum tables
        ref_cmd = fio_command(bench.paths(), top_k, {stride: 1}, calls * top_k * stride, "libaio") \
            if with_fio else None
        if ref_cmd:
            fns["fio"] = lambda: run_fio(ref_cmd)
        res = interleaved(bench, fns)
    finally:
        for ld in loaders.values():
            ld.close()
    s = res["loader"]
    row = {"top_k": top_k, "block_bytes": stride, "calls": calls, "verify": True,
           "ms_per_call": 1e3 * s.seconds / calls, "device_gbps": _gb(s.bytes_read, s.seconds)}
    if "baseline" in res:
        row["baseline_ms_per_call"] = 1e3 * res["baseline"].seconds / calls
    if ref_cmd:
        fio_gbps = res["fio"].bw / 1e9
        row.update(fio_gbps=fio_gbps, fio_ms_per_call=top_k * stride / fio_gbps / 1e6,
                   fio_command=" ".join(ref_cmd))
        row["over_fio"] = row["ms_per_call"] / row["fio_ms_per_call"]
        if "baseline" in res:
            row["baseline_over_fio"] = row["baseline_ms_per_call"] / row["fio_ms_per_call"]
    else:
        row["fio"] = "skipped (--no-fio)" if not with_fio else "fio not installed"
    return row


def loader_classes(bench) -> dict:
    """{"loader": this FlashLoader, "baseline": --baseline's (when given)}."""
    return {"loader": FlashLoader, **({"baseline": bench.baseline} if bench.baseline else {})}


def print_expert_reads(row):
    print(f"\nexpert reads as the MoE store issues them: {row['top_k']} random experts of one "
          f"layer per call ({row['block_bytes']}-byte blocks, one read each, crc32 checked), "
          f"{row['calls']} calls in sequence, cold")
    if "fio_gbps" in row:
        print(f"  loader {row['ms_per_call']:.2f} ms per call ({row['device_gbps']:.3f} GB/s); fio "
              f"--bs={row['block_bytes']} --iodepth={row['top_k']}: {row['fio_gbps']:.3f} GB/s -> "
              f"{row['fio_ms_per_call']:.2f} ms for the same bytes; loader / fio time = "
              f"{row['over_fio']:.2f}x")
        if "baseline_ms_per_call" in row:
            print(f"  baseline (--baseline) {row['baseline_ms_per_call']:.2f} ms per call: "
                  f"{row['baseline_over_fio']:.2f}x fio's time")
    else:
        print(f"  loader {row['ms_per_call']:.2f} ms per call ({row['device_gbps']:.3f} GB/s); "
              f"{row['fio']}")


def print_large_reads(rows, depth):
    print(f"\nlarge reads: k consecutive bundles per read into alloc() destinations, {depth} in "
          f"flight, vs fio --rw=randread --ioengine=libaio --iodepth={depth} --bs=<read bytes> on "
          f"the same files, runs interleaved (device GB/s)"
          + ("; the loaders check every bundle's crc32" if any(r.get("verify") for r in rows) else ""))
    print("(aio ring: io/aio.py alone, the same number of reads of that size, into a ring of "
          f"{depth} buffers as fio does; aio dest: the same into one buffer per read, as large as "
          "the loader's destinations, where the loader lands its reads; baseline: --baseline's loader)")
    if rows and any("segment_s" in r for r in rows):
        terms = ", ".join(f"{r['read_bytes'] >> 10} KiB: {r['segment_s'] * 1e6:.2f} us, "
                          f"{r['copy_bandwidth'] / 1e9:.2f} GB/s" for r in rows if "segment_s" in r)
        print(f"(path: zero-copy or staged, chosen by the device profile's terms at each read size, "
              f"seconds per extra segment and the copy's GB/s ({terms}; the copy's is the time "
              f"copying out adds end to end, on the loader's finishing threads): staged when read + "
              f"copy saves >= 10% of read + extra segments, io.read_cost.stage_saves_time; +seg / "
              f"+copy: microseconds each adds per read, to the profile's read time `read`)")
        print(f"(profile {describe_load(next(r for r in rows if 'segment_s' in r).get('profile_load'))})")
    others = [(name, head) for name, head in (("baseline", "baseline"), ("zero_copy", "zero-copy"),
                                              ("staged", "staged"))
              if any(f"{name}_gbps" in r for r in rows)]
    if any(name != "baseline" for name, _ in others):
        print("(zero-copy / staged: this loader with that path forced, --landing-paths)")
    print(f"{'size':>6} {'k':>4} {'read bytes':>10} {'reads':>6} {'read':>6} {'+seg':>6} {'+copy':>6} {'path':>9} {'loader':>7} "
          f"{'aio ring':>8} {'aio dest':>8} {'fio':>7} {'loader/fio':>10}"
          + "".join(f" {head:>9} {'/fio':>5}" for _, head in others))
    for r in rows:
        name = f"{r['size'] >> 20}M" if r["size"] >= 1 << 20 else f"{r['size'] >> 10}K"
        if "skipped" in r:
            print(f"{name:>6}  skipped: {r['skipped']}")
            continue
        fio = (f"{r['fio_gbps']:7.3f} {r['loader_over_fio']:10.0%}" if "fio_gbps" in r
               else f"  {r['fio']}")
        ring, dest = (f"{r[k]:8.3f}" if k in r else f"{'-':>8}" for k in ("aio_ring_gbps", "aio_dest_gbps"))
        extra = "".join(f" {r.get(name + '_gbps', float('nan')):9.3f} " + (
            f"{r[name + '_over_fio']:5.0%}" if name + "_over_fio" in r else f"{'-':>5}")
            for name, _ in others)
        print(f"{name:>6} {r['bundles_per_read']:>4} {r['read_bytes']:>10} {r['reads']:>6} "
              f"{r.get('read_s', float('nan')) * 1e6:6.0f} {r.get('zero_copy_extra_s', float('nan')) * 1e6:6.1f} "
              f"{r.get('staged_extra_s', float('nan')) * 1e6:6.1f} "
              f"{'zero-copy' if r['zero_copy'] else 'staged':>9} {r['device_gbps']:7.3f} {ring} "
              f"{dest} {fio}{extra}")
    cpu = [(r, [(name, r[f"{name}_cpu_us_per_read"]) for name in
                ("fio", "aio_ring", "aio_dest", "loader", "baseline", "zero_copy", "staged")
                if f"{name}_cpu_us_per_read" in r]) for r in rows if "skipped" not in r]
    if any(c for _, c in cpu):
        print("CPU per read, microseconds (the process's every thread; fio: its user + system time):")
        for r, c in cpu:
            print(f"{r['read_bytes']:>17}  " + "  ".join(f"{name.replace('_', ' ')} {us:.1f}" for name, us in c))


def sequential_ceiling(bench, block=4 << 20):
    """Plain large sequential O_DIRECT reads of every bundle file, one thread."""
    files = FileLayer()
    buf = aligned_buffer(block)
    paths = [bench.pack / bench.entries[layer].file for layer in bench.layers]
    best = []
    for _ in range(bench.args.repeat):
        bench.evict()
        total, t0 = 0, time.perf_counter()
        for p in paths:
            fd, direct = files.open(p, True)
            try:
                size = os.fstat(fd).st_size
                for off in range(0, size, block):
                    n = min(block, size - off)
                    read_full(files, fd, [buf[:n]], off, p)
                    total += n
            finally:
                files.close(fd)
        best.append(time.perf_counter() - t0)
    seconds = statistics.median(best)
    return {"gbps": _gb(total, seconds), "bytes": total, "block": block, "seconds": seconds}


def write_unbundled(bench, out: Path):
    """A matrix-major copy of the pack's FFN: per layer one file, one aligned region per matrix
    (gate / up / down_t rows with their scales and biases). Layer L matrix j -> layer 3L+j."""
    align = bench.manifest.alignment
    (out / "bundles").mkdir(parents=True)
    bundles, layer_map = [], {}
    for layer in bench.layers:
        e = bench.entries[layer]
        arrays = read_layer_components(bench.pack, e, verify=False)
        groups = {}
        for c in e.components:
            groups.setdefault(c.name.split(".")[0], []).append(
                (c.name, c.source, arrays[c.name], c.quantization))
        rel = f"bundles/layer_{layer:03d}.bin"
        layer_map[layer] = []
        for j, record in enumerate(write_bundle_file(out / rel, list(groups.values()), align)):
            lid = 3 * layer + j
            layer_map[layer].append(lid)
            bundles.append({"layer": lid, "kind": "neurons", "file": rel, "encoding": "dense", **record})
    write_manifest(out, {"format": FORMAT, "format_version": FORMAT_VERSION, "alignment": align,
                         "bundles": bundles, "note": "mlx_flash.bench io: unbundled comparison copy"})
    return layer_map


class _FioRun:
    """fio result shaped like ReadStats (seconds for the bytes it read; cpu_s: its user + system
    CPU seconds, None when fio did not say)."""
    def __init__(self, bw_bytes, iops, io_bytes, cpu_s=None):
        self.bw, self.iops, self.bytes_read, self.cpu_s = bw_bytes, iops, io_bytes, cpu_s
        self.seconds = io_bytes / bw_bytes if bw_bytes else float("inf")


def fio_command(paths, threads, read_sizes, total_bytes, engine):
    """fio randread on `paths` (bundle files) with a read-size mix ({bytes: reads}) and `threads`
    reads in flight (psync: that many jobs; libaio: that queue depth); None without fio."""
    fio = shutil.which("fio")
    if fio is None:
        return None
    files = ":".join(str(p).replace(":", "\\:") for p in paths)
    split = ":".join(f"{size}/{pct}" for size, pct in bssplit(read_sizes))  # fio: size/percent:...
    jobs, depth = (threads, 1) if engine == "psync" else (1, threads)
    return [fio, "--name=flashbench", f"--filename={files}", "--direct=1", "--rw=randread",
            f"--ioengine={engine}", f"--iodepth={depth}", f"--numjobs={jobs}", "--thread",
            "--group_reporting", f"--bs={next(iter(read_sizes))}" if len(read_sizes) == 1
            else f"--bssplit={split}", "--blockalign=4096", "--norandommap",
            f"--io_size={max(1 << 20, total_bytes // jobs)}", "--output-format=json"]


BSSPLIT_SIZES = 16  # read sizes a fio mix keeps (bssplit)


def bssplit(read_sizes, max_sizes=BSSPLIT_SIZES, block=4096) -> list:
    """fio's --bssplit for a read-size mix {bytes: reads}: [(size, percent of reads)], the
    percentages whole numbers summing to 100 (fio reads only the first sizes of a split summing
    to more, e.g. 4 KiB alone for a flash row's ~150 sizes). More than `max_sizes` sizes are
    grouped into that many log-spaced bins, each read at its reads' mean size (a multiple of
    `block`), so the mix keeps the reads' mean size; every bin with reads gets at least 1%."""
    sizes = np.array(sorted(read_sizes), np.float64)
    counts = np.array([read_sizes[k] for k in sorted(read_sizes)], np.float64)
    keep = counts > 0
    sizes, counts = sizes[keep], counts[keep]
    if len(sizes) > max_sizes:
        edges = np.geomspace(sizes[0], sizes[-1] * (1 + 1e-9), max_sizes + 1)
        idx = np.clip(np.searchsorted(edges, sizes, side="right") - 1, 0, max_sizes - 1)
        n = np.bincount(idx, counts, max_sizes)
        mean = np.bincount(idx, counts * sizes, max_sizes) / np.maximum(n, 1)
        sizes, counts = mean[n > 0], n[n > 0]
    sizes = np.maximum(block, np.round(sizes / block) * block).astype(np.int64)
    share = 100 * counts / counts.sum()
    pct = np.maximum(1, np.floor(share)).astype(np.int64)
    while pct.sum() > 100:  # the 1% floors took more than their share: take it from the largest
        pct[np.argmax(pct)] -= 1
    for i in np.argsort(-(share - np.floor(share)), kind="stable")[:100 - pct.sum()]:
        pct[i] += 1  # largest remainders first
    out = {}
    for size, p in zip(sizes.tolist(), pct.tolist()):
        out[size] = out.get(size, 0) + p  # bins rounding to one size merge
    return sorted(out.items())


def fio_throughput(paths, read_sizes, depth, total_bytes) -> dict | None:
    """fio's O_DIRECT random-read throughput on `paths` with the read-size mix `read_sizes`
    ({bytes per read: reads}) and `depth` reads in flight (libaio): {"gbps" (1e9 bytes/s),
    "iops", "command"}; None when fio is not installed. The reference for "I/O time per token
    vs bytes missed / fio throughput at that read size and depth"."""
    cmd = fio_command(paths, depth, read_sizes, total_bytes, "libaio")
    if cmd is None:
        return None
    r = run_fio(cmd)
    return {"gbps": r.bw / 1e9, "iops": r.iops, "command": " ".join(cmd)}


def expert_fio_reference(pack, depth, total_bytes=256 << 20) -> dict | None:
    """fio's O_DIRECT random-read throughput on a MoE pack's expert bundle files, at its expert
    block sizes (one read per block, as the expert store reads them; mixed widths weighted by
    their expert counts) with `depth` reads in flight: {"gbps", "read_sizes" {bytes: experts},
    "depth", "command"}; None without fio. A MoE report prints its I/O ms per token next to
    `fio_ms(bytes missed per token, reference)`, with `depth` = the reads its loader calls had
    in flight (misses per layer call)."""
    manifest = read_manifest(pack)
    sizes, paths = {}, set()
    for b in manifest.bundles:
        if b.kind != "experts":
            continue
        paths.add(Path(pack) / b.file)
        for g in b.groups or (b,):
            sizes[g.stride] = sizes.get(g.stride, 0) + g.count
    if not sizes:
        raise FlashError(f"{pack}: no expert bundles (not a MoE pack)")
    ref = fio_throughput(sorted(paths), sizes, max(1, int(depth)), total_bytes)
    return None if ref is None else {**ref, "read_sizes": sizes, "depth": max(1, int(depth))}


def fio_ms(nbytes, reference) -> float:
    """Milliseconds fio needs for `nbytes` at a reference's throughput (expert_fio_reference)."""
    return nbytes / (reference["gbps"] * 1e9) * 1e3


def run_fio(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise FlashError(f"fio failed: {' '.join(p.stderr.strip().splitlines()[-1:])}")
    job = json.loads(p.stdout)["jobs"][0]
    cpu_s = None
    if "job_runtime" in job and "usr_cpu" in job:  # percentages of its run time (ms)
        cpu_s = (job["usr_cpu"] + job.get("sys_cpu", 0.0)) / 100 * job["job_runtime"] / 1e3
    read = job["read"]
    return _FioRun(read["bw_bytes"], read["iops"], read["io_bytes"], cpu_s)


def interleaved(bench, fns):
    """Median (by seconds) of --repeat cold runs of each fn, the variants taking turns so that
    background load on the machine hits them alike."""
    runs = {name: [] for name in fns}
    for _ in range(bench.args.repeat):
        for name, fn in fns.items():
            bench.evict()
            runs[name].append(fn())
    out = {}
    for name, rs in runs.items():
        rs.sort(key=lambda r: r.seconds)
        out[name] = rs[len(rs) // 2]
    return out


def bundled_vs_unbundled(bench, threads, fractions, with_fio):
    """Same random neuron sets: bundled / unbundled, planner off / on, verify; fio alongside."""
    unb = Path(str(bench.pack).rstrip("/") + f".unbundled-bench-{os.getpid()}")
    cost = device_profile(bench, threads)
    if cost is None:
        raise FlashError(f"{bench.pack}: cannot measure the read cost (bundle files under "
                         f"16 MiB and a cache home on another device)")
    rows, fio, loaders = [], {}, []
    try:
        layer_map = write_unbundled(bench, unb)
        bench.extra_paths = [unb / f"bundles/layer_{layer:03d}.bin" for layer in bench.layers]
        variants = {"bundled": (bench.pack, None, False, False, "auto"),
                    "bundled_planned": (bench.pack, None, True, False, "auto"),
                    "unbundled": (unb, layer_map, False, False, "auto"),
                    "unbundled_planned": (unb, layer_map, True, False, "auto"),
                    "bundled_planned_verified": (bench.pack, None, True, True, "auto"),
                    "bundled_threadpool": (bench.pack, None, False, False, "threads")}
        for path, lmap, plan, verify, engine in variants.values():
            loaders.append(FlashLoader(path, threads=threads, verify=verify, plan=plan, cost=cost,
                                       engine=engine))
        for fraction in fractions:
            sets = _random_sets(bench, fraction)
            fns = {}
            for (name, (path, lmap, plan, verify, _)), loader in zip(variants.items(), loaders):
                dests = _alloc(loader, sets, lmap)
                fns[name] = (lambda ld=loader, d=dests, m=lmap: _read_sets(ld, sets, d, m))
            cmds = {}
            if with_fio and fraction == bench.args.fraction:
                bench.evict()
                probe = fns["bundled"]()  # the read-size mix fio replays
                for engine in ("psync", "libaio"):
                    cmd = fio_command(bench.paths(), threads, probe.read_sizes, probe.bytes_read,
                                      engine)
                    if cmd:
                        cmds[engine] = cmd
                        fns[f"fio_{engine}"] = (lambda c=cmd: run_fio(c))
            res = interleaved(bench, fns)
            row = {"fraction": fraction, "threads": threads}
            for name in variants:
                r = res[name]
                row[name] = {"gbps": _gb(r.bytes_useful, r.seconds),
                             "device_gbps": _gb(r.bytes_read, r.seconds), "reads": r.reads,
                             "seconds": r.seconds, "read_sizes": r.read_sizes,
                             "bytes_read": r.bytes_read, "bytes_useful": r.bytes_useful}
            row["bundled_over_unbundled"] = row["unbundled"]["seconds"] / row["bundled"]["seconds"]
            row["planner_speedup"] = row["bundled"]["seconds"] / row["bundled_planned"]["seconds"]
            row["unbundled_planner_speedup"] = (row["unbundled"]["seconds"]
                                                / row["unbundled_planned"]["seconds"])
            for engine, cmd in cmds.items():
                r = res[f"fio_{engine}"]
                fio[engine] = {"device_gbps": r.bw / 1e9, "iops": r.iops, "engine": engine,
                               "threads": threads, "command": " ".join(cmd),
                               "loader_device_gbps": row["bundled"]["device_gbps"],
                               "loader_over_fio": row["bundled"]["device_gbps"] / (r.bw / 1e9),
                               "threadpool_over_fio": (row["bundled_threadpool"]["device_gbps"]
                                                       / (r.bw / 1e9))}
            rows.append(row)
    finally:
        for loader in loaders:
            loader.close()
        shutil.rmtree(unb, ignore_errors=True)
        bench.extra_paths = []
    return rows, fio, {"latency_us": cost.latency_s * 1e6, "bandwidth_gbps": cost.bandwidth / 1e9,
                       "merge_gap_bytes": cost.merge_gap,
                       "curve": cost.to_dict() if hasattr(cost, "to_dict") else None}


def plot(result, path):
    try:
        import matplotlib
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    sweep = result["chunk_sweep"]
    for t in sorted({r["threads"] for r in sweep}):
        pts = sorted((r["chunk_bytes"] / 1024, r["gbps"]) for r in sweep if r["threads"] == t)
        ax.plot(*zip(*pts), marker="o", label=f"{t} threads")
    ax.axhline(result["sequential"]["gbps"], color="k", linestyle="--",
               label="sequential read (ceiling)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("chunk size (KiB of bundles per read)")
    ax.set_ylabel("random read throughput (GB/s)")
    ax.set_title(f"Cold reads from {Path(result['pack']).name} ({result['evict_method']})",
                 fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def print_sweep(result, args, threads_list, chunks, stride):
    seq, sweep = result["sequential"], result["chunk_sweep"]
    print(f"\nsequential O_DIRECT read of the bundle files (4 MiB reads, 1 thread): "
          f"{seq['gbps']:.2f} GB/s")
    print(f"\nchunk sweep (GB/s useful, {args.sweep_fraction:.0%} of each layer per run), rows: "
          f"bundles per read (bytes), columns: reads in flight")
    print(f"{'chunk':>16} " + " ".join(f"{t:>7}" for t in threads_list))
    for k in chunks:
        vals = {r["threads"]: r["gbps"] for r in sweep if r["chunk_bundles"] == k}
        print(f"{k:>5} ({k * stride:>8}) " + " ".join(f"{vals[t]:7.3f}" for t in threads_list))


def print_compare(result, args, top):
    cost, comparisons, fio = result["cost_model"], result["bundled_vs_unbundled"], result["fio"]
    main = next(r for r in comparisons if r["fraction"] == args.fraction)
    print(f"\ncost model ({top} threads): latency {cost['latency_us']:.1f} us, bandwidth "
          f"{cost['bandwidth_gbps']:.2f} GB/s -> merge gaps up to {cost['merge_gap_bytes']} bytes")
    if cost.get("curve"):
        c = cost["curve"]
        print("\n".join(curve_lines(c)))
        print(describe_load(c.get("load")))
    print(f"\nrandom neuron sets, queue depth {top} (GB/s useful; reads issued)")
    print(f"{'fraction':>8} {'bundled':>14} {'unbundled':>14} {'ratio':>6} {'bundled+plan':>14} "
          f"{'unbundled+plan':>15} {'plan x':>6} {'+verify':>8}")
    for r in comparisons:
        def cell(x):
            return f"{x['gbps']:.3f} ({x['reads']})"
        print(f"{r['fraction']:>8} {cell(r['bundled']):>14} {cell(r['unbundled']):>14} "
              f"{r['bundled_over_unbundled']:6.2f} {cell(r['bundled_planned']):>14} "
              f"{cell(r['unbundled_planned']):>15} {r['planner_speedup']:6.2f} "
              f"{r['bundled_planned_verified']['gbps']:8.3f}")
    if fio:
        b = main["bundled"]
        sizes = "/".join(f"{k}:{v}" for k, v in sorted(b["read_sizes"].items()))
        print(f"\nfio vs loader: same files, same read-size mix (bytes:reads {sizes}), {top} "
              f"threads / queue depth, runs interleaved (device GB/s)")
        tp = main["bundled_threadpool"]
        print(f"  loader, fraction {args.fraction}: {b['device_gbps']:.3f} (native AIO, depth {top}), "
              f"{tp['device_gbps']:.3f} (thread pool, {top} threads)")
        for engine, f in fio.items():
            print(f"  fio {engine:<7}: {f['device_gbps']:.3f} ({f['iops']:.0f} IOPS) -> loader = "
                  f"{f['loader_over_fio']:.0%} (AIO), {f['threadpool_over_fio']:.0%} (threads) of fio")


PARTS = ("sweep", "compare", "large", "experts", "dest", "segments", "profile")


def run(args) -> int:
    bench = Bench(args)
    threads_list = [int(t) for t in args.threads.split(",")]
    chunks = [int(c) for c in args.chunks.split(",")]
    sizes = [parse_size(x) for x in args.large_sizes.split(",") if x.strip()]
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if not parts or set(parts) - set(PARTS):
        raise FlashError(f"--parts: {args.parts!r}: choose from {', '.join(PARTS)}")
    if "compare" in parts and any(b.kind != "neurons" for b in bench.manifest.bundles):
        print("note: expert layers are measured as bundles like neurons", file=sys.stderr)
    top, with_fio = max(threads_list), not args.no_fio
    e0 = bench.entries[bench.layers[0]]
    print(f"pack {bench.pack}: {len(bench.layers)} bundle files, {e0['count']} bundles of "
          f"{e0['stride']} bytes per layer")
    result = {"pack": str(bench.pack), "machine": machine_info(),
              "packages": package_versions(), "command": args.command_line,
              "fraction": args.fraction, "parts": parts}
    if "profile" in parts:
        result["profile"] = profile_report(bench, top)
    if "sweep" in parts:
        result["sequential"] = sequential_ceiling(bench)
        result["chunk_sweep"] = chunk_sweep(bench, threads_list, chunks)
    if "compare" in parts:
        result["bundled_vs_unbundled"], result["fio"], result["cost_model"] = bundled_vs_unbundled(
            bench, top, sorted({0.05, args.fraction, 0.25}), with_fio=with_fio)
        if with_fio and not result["fio"]:
            print("fio not found: skipping the fio comparison (apt-get install fio)", file=sys.stderr)
    if "large" in parts:
        result["large_reads"] = large_reads(bench, sizes, top, args.large_mb << 20, with_fio, args.large_verify,
                                            args.landing_paths)
    if "experts" in parts:
        result["expert_reads"] = expert_reads(bench, args.large_mb << 20, with_fio, args.experts_per_call)
    if "dest" in parts:
        result["destination_kinds"] = destination_kinds(bench, sizes, top, args.large_mb << 20, with_fio)
    if "segments" in parts:
        result["segment_kinds"] = destination_kinds(bench, sizes, top, args.large_mb << 20, with_fio,
                                                    SEGMENT_KINDS)
    result["evict_method"] = ", ".join(sorted(bench.evict_methods))

    print(f"\nmachine: {result['machine']}\ncommand: {result['command']}")
    print(f"cold runs: pages evicted with {result['evict_method']} before each run; "
          f"median of {args.repeat}; GB/s = 1e9 useful bytes/s")
    if "profile" in parts:
        print_profile(result["profile"])
    if "sweep" in parts:
        print_sweep(result, args, threads_list, chunks, e0["stride"])
    if "compare" in parts:
        print_compare(result, args, top)
    if "large" in parts:
        print_large_reads(result["large_reads"], top)
    if result.get("expert_reads"):
        print_expert_reads(result["expert_reads"])
    if "dest" in parts:
        print_destination_kinds(result["destination_kinds"])
    if "segments" in parts:
        print_destination_kinds(result["segment_kinds"], SEGMENT_KINDS)
    if args.json:
        write_json_atomic(args.json, result)
        print(f"\nresults: {args.json}")
    if "sweep" in parts and (args.plot or "").lower() != "none":
        path = args.plot or (Path(args.json).with_suffix(".png") if args.json else Path("io_bench.png"))
        if out := plot(result, path):
            print(f"plot: {out}")
    return 0
