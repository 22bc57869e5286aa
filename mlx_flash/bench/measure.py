"""What one benchmark child process does: load a flash pack in one mode, generate, report.

Called through bench.cap.run_capped("mlx_flash.bench.measure:generate_flash", {...}) so each run
is a fresh process (cold, optionally inside a cgroup memory cap). Every read the runtime makes
goes through `LoggedReads`, which records it per step, so the report can check that the bytes
the statistics count are the bytes the loader read, and that the neuron caches' own counters
agree with the reads that landed in them.

Emulations used only by the ablation rows (paper Table 2):
  unbundled: reads go to a matrix-major copy of the pack written by bench.io.write_unbundled
             (up rows and down columns as separate requests), into the same destination rows;
  no_window: every neuron cache is emptied before each token, so every predicted neuron is
             read again (the predictor without the sliding window).
"""

import time

import numpy as np


class LoggedReads:
    """Stands in for the runtime's FlashLoader: forwards layout calls, logs every read.

    log rows: (step index, layer, bundles, bytes read from the device, useful bytes, reads,
    seconds, True when the destination is a neuron cache, the bytes those bundles hold in the
    pack: bundles x the bytes per neuron, or for ENDOR layers their lengths in the layer's index)."""

    def __init__(self, loader, stats, caches, unbundled=None, layer_map=None):
        self._loader, self._stats = loader, stats
        self._cache_dests = {id(c.rows) for c in caches.values()}
        self._unbundled, self._layer_map = unbundled, layer_map
        self._endor_index = {}
        self.log = []

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def read(self, layer, ids, dest, slots=None):
        bundle_ids = getattr(ids, "ids", ids)  # ids, or a ReadPlan's (slots follow its ids)
        if self._unbundled is None:
            s = self._loader.read(layer, ids, dest, slots)
        else:
            # one request per matrix, each with only its own destination arrays
            s = self._unbundled.read_many(
                [(lid, bundle_ids, {c.name: dest[c.name] for c in self._unbundled.entry(lid).components},
                  slots) for lid in self._layer_map[layer]])
        self._log_call(layer, bundle_ids, dest, s)
        return s

    def _log_call(self, layer, bundle_ids, dest, s):
        """One log row for a call that read `bundle_ids` of `layer` into `dest` (its ReadStats s)."""
        self.log.append((len(self._stats.steps) - 1, layer, len(bundle_ids), s.bytes_read, s.bytes_useful,
                         s.reads, s.seconds, id(dest) in self._cache_dests, self._pack_bytes(layer, bundle_ids)))

    def read_many(self, requests):
        """FlashLoader.read_many, one log row per request (its plan's reads and bytes; the call's
        seconds shared by bytes). Unbundled copies: each request through `read`."""
        if self._unbundled is not None or not all(hasattr(r[1], "r0") for r in requests):
            stats = [self.read(*r) for r in requests]
            for other in stats[1:]:
                stats[0].add(other)
            return stats[0]
        s = self._loader.read_many(requests)
        sizes = [plan.read_bytes for _, plan, _, _ in requests]
        useful = [self._pack_bytes(layer, plan.ids) for layer, plan, _, _ in requests]
        # the last row takes the rest of the loader's own totals: the log adds up to what it read
        sizes[-1], useful[-1] = s.bytes_read - sum(sizes[:-1]), s.bytes_useful - sum(useful[:-1])
        for (layer, plan, dest, _), nbytes, used in zip(requests, sizes, useful):
            self.log.append((len(self._stats.steps) - 1, layer, len(plan.ids), nbytes, used, len(plan.r0),
                             s.seconds * nbytes / max(1, s.bytes_read), id(dest) in self._cache_dests,
                             self._pack_bytes(layer, plan.ids)))
        return s

    def read_at_once(self, layer, ids, dest, slots=None, max_bytes=None):
        """FlashLoader.read_at_once, logged as `read` logs a call (None: not taken, nothing logged;
        unbundled copies: never taken, their reads go through `read`)."""
        if self._unbundled is not None:
            return None
        s = self._loader.read_at_once(layer, ids, dest, slots, max_bytes)
        if s is not None:
            self._log_call(layer, ids, dest, s)
        return s

    def start_read(self, layer, ids, dest, slots=None, key=0):
        """FlashLoader.start_read (the per-layer path's lookahead), logged as `read` logs a call
        once finish_read reaps it (or now, when the loader read it at once); unbundled copies: read
        now through `read`."""
        if self._unbundled is not None:
            return {"stats": self.read(layer, ids, dest, slots)}
        started = self._loader.start_read(layer, ids, dest, slots, key)
        if "job" in started:
            started["logged"] = (layer, ids, dest)
        else:
            self._log_call(layer, ids, dest, started["stats"])
        return started

    def finish_read(self, started):
        """FlashLoader.finish_read, logging what start_read started."""
        s = self._loader.finish_read(started)
        if "logged" in started:
            self._log_call(*started.pop("logged"), s)
        return s

    def decode_reads(self, layer, dest, staging_bytes=None):
        """FlashLoader.decode_reads (a kernel reads with what it returns; kernel_reads logs them);
        unbundled copies: None, their reads go through `read`."""
        return None if self._unbundled is not None else self._loader.decode_reads(layer, dest, staging_bytes)

    def kernel_reads(self, step, layer, bundles, cache_bundles, nbytes, reads, seconds):
        """FlashLoader.kernel_reads, logged as two rows: the bundles read straight into cache
        rows, then the rest (the bytes, reads and seconds on this one)."""
        rows = [(cache_bundles, True, 0, 0, 0.0), (bundles - cache_bundles, False, nbytes, reads, seconds)]
        for n, into_cache, b, r, sec in rows:
            if n or b:
                self.log.append((step, layer, n, b, self._pack_bytes(layer, range(n)), r, sec, into_cache,
                                 self._pack_bytes(layer, range(n))))

    def read_encoded(self, layer, out=None):
        """FlashLoader.read_encoded (a whole ENDOR layer as stored, for the decode-matvec kernels), logged."""
        words, offsets, s = self._loader.read_encoded(layer, out)
        self._log_call(layer, np.arange(self._loader.entry(layer).count), None, s)
        return words, offsets, s

    def _pack_bytes(self, layer, ids) -> int:
        entry = self._loader.entry(layer)
        if entry.encoding != "endor":
            return len(ids) * sum(c.length for c in entry.components)
        if layer not in self._endor_index:
            from mlx_flash.pack.reader import read_bundle_index

            self._endor_index[layer] = read_bundle_index(self._loader.pack / entry.file, entry)
        index, ids = self._endor_index[layer], np.asarray(ids, np.int64)
        return int((index[ids + 1] - index[ids]).sum())


def _empty_before_update(cache):
    update = cache.update

    def emptied_update(active, step, window, read=True):
        cache.delete(np.arange(cache.num_used))
        return update(active, step, window, read=read)

    cache.update = emptied_update


def generate_flash(pack, mode, prompt, gen_tokens, budget=None, window=5, threads=32, temp=0.0,
                   top_p=1.0, seed=0, unbundled=None, no_window=False, keep_steps=True) -> dict:
    """Load `pack` as `mode`, generate `gen_tokens` tokens after `prompt` (token ids), measure.

    Returns JSON-ready figures: `summary` (sparse.stats.FlashStats.summary(): per-token ms, bytes,
    neurons, hit rate, peak memory in bytes), `steps` (per decode step: io_ms, mem_ms, total_ms,
    bytes_read), `accounting` (loader log vs statistics vs neuron-cache counters), load seconds,
    mlx-lm's tokens/s, the memory plan, and the generated text.
    """
    # a fresh child per run: importing here keeps the parent's imports out of the child's figures
    import mlx.core as mx

    import mlx_flash
    from mlx_flash.io import FlashLoader

    t0 = time.perf_counter()
    model, tokenizer = mlx_flash.load(pack, mode=mode, memory_budget=budget, window=window,
                                      threads=threads, progress=False)
    load_s = time.perf_counter() - t0
    rt, stats = model.flash_runtime, model.flash_stats
    base_rows = {i: c.rows_loaded for i, c in rt.caches.items()}
    extra = None
    if unbundled:
        extra = FlashLoader(unbundled["path"], threads=threads)
        layer_map = {int(k): v for k, v in unbundled["layer_map"].items()}
        reads = LoggedReads(rt.loader, stats, rt.caches, extra, layer_map)
    else:
        reads = LoggedReads(rt.loader, stats, rt.caches)
    rt.loader = reads
    for cache in rt.caches.values():
        cache.loader = reads
        if no_window and mode == "flash":
            _empty_before_update(cache)
    mx.random.seed(seed)
    stats.reset()
    text, last, t1 = [], None, time.perf_counter()
    for r in mlx_flash.stream_generate(model, tokenizer, list(prompt), max_tokens=gen_tokens,
                                       temp=temp, top_p=top_p):
        text.append(r.text)
        last = r
    stats.finish()
    wall_s = time.perf_counter() - t1
    if extra is not None:
        extra.close()
    summary = stats.summary()
    decode = [(i, s) for i, s in enumerate(stats.steps) if s.tokens == 1 and s.end is not None]
    logged = {}
    for step, _, _, nbytes, *_ in reads.log:
        logged[step] = logged.get(step, 0) + nbytes
    cache_rows_logged = sum(r[2] for r in reads.log if r[7])
    io_s = sum(r[6] for r in reads.log)
    useful = sum(r[4] for r in reads.log)
    decode_steps = {i for i, _ in decode}
    read_sizes, decode_calls = {}, 0
    for step, _, _, nbytes, _, n_reads, *_ in reads.log:
        if step in decode_steps and n_reads:
            # a call's reads at their mean size, in 4 KiB units (the fio reference's block sizes)
            size = -(-nbytes // n_reads // 4096) * 4096
            read_sizes[size] = read_sizes.get(size, 0) + n_reads
            decode_calls += 1
    accounting = {
        "decode_read_sizes": {str(k): v for k, v in sorted(read_sizes.items())},
        "decode_reads_per_call": sum(read_sizes.values()) / decode_calls if decode_calls else 0.0,
        "decode_bytes_stats": sum(s.bytes_read for _, s in decode),
        "decode_bytes_loader": sum(logged.get(i, 0) for i, _ in decode),
        "all_bytes_stats": sum(s.bytes_read for s in stats.steps),
        "all_bytes_loader": sum(r[3] for r in reads.log),
        "useful_bytes_loader": useful,
        "useful_bytes_expected": sum(r[8] for r in reads.log),  # the bundles' bytes in the pack
        "reads": sum(r[5] for r in reads.log),
        "cache_rows_loaded": sum(c.rows_loaded - base_rows[i] for i, c in rt.caches.items()),
        "cache_rows_logged": cache_rows_logged,
        "cache_rows_from_lookahead": rt.ahead_copied,  # claimed rows the lookahead's reads filled
        "cache_rows_from_stream": rt.fill_copied,  # fills read with their overflow, copied in
        "neurons_loaded_stats": sum(s.neurons_loaded for s in stats.steps),
        "neurons_read_loader": sum(r[2] for r in reads.log),
        "loader_seconds": io_s,
    }
    out = {
        "mode": mode, "window": window, "budget": budget, "threads": threads, "temp": temp,
        "top_p": top_p, "unbundled": bool(unbundled), "no_window": no_window,
        "load_s": load_s, "generate_s": wall_s, "summary": summary,
        "plan": stats.plan.describe() if stats.plan else None,
        "plan_weights_bytes": stats.plan.weights if stats.plan else None,
        "generation_tps": last.generation_tps if last else None,
        "prompt_tps": last.prompt_tps if last else None,
        "generated_tokens": last.generation_tokens if last else 0,
        "text": "".join(text)[:300], "accounting": accounting,
        # fraction of all the model's FFN neurons needed per decode token (flash): needed counts
        # the predicted neurons of sparse layers and every neuron of resident / streamed ones
        "active_fraction": (sum(s.neurons_needed for _, s in decode) / len(decode)
                            / sum(b.count for b in rt.loader.bundles.values())
                            if mode == "flash" and decode else None),
        "sparse_layers": len(stats.plan.capacity) if mode == "flash" and stats.plan else None,
        # per decode token: neurons the lookahead read, and those a layer then needed
        "lookahead": {"read": rt.ahead_read / len(decode), "used": rt.ahead_used / len(decode)}
        if rt.ahead_read and decode else None,
        "ffn_layers": len(rt.loader.bundles),
    }
    if keep_steps:
        out["steps"] = {"io_ms": [1e3 * s.io_s for _, s in decode],
                        "mem_ms": [1e3 * s.mem_s for _, s in decode],
                        "total_ms": [1e3 * s.wall_s for _, s in decode],
                        "bytes_read": [s.bytes_read for _, s in decode]}
    return out


def process_baseline(pack) -> dict:
    """Memory a benchmark child needs besides the weights: interpreter, MLX, mlx-lm, tokenizer.
    Returns {"rss_bytes"}; the caller reads the cgroup peak (page cache included)."""
    import resource
    import sys
    from pathlib import Path

    # what a run imports, imported here so the measured RSS includes exactly these modules
    import mlx.core as mx  # noqa: F401
    import mlx_lm.generate  # noqa: F401

    from mlx_flash.models import load_tokenizer

    load_tokenizer(Path(pack))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"rss_bytes": rss if sys.platform == "darwin" else rss * 1024}
