"""The FFN module swapped into an mlx-lm model, one per layer, and its row projections.

The model's own MLP object is kept (so its activation, gating and any quirks stay mlx-lm's); only
its projections are replaced by row projections that compute with the current rows:
    up/gate:  x @ rows[role][:n].T (+ bias[:n])          ops.gather_matvec
    down:     h @ rows["down_t"][:n]  (+ resident bias)    ops.gather_matvec_t
This is exact for any MLP of the form down(act(up x)) or down(act(gate x) * up x) whose act is
elementwise: the FFN output is a sum over neurons, so any subset of rows, in any order, gives that
subset's contribution. `check_mlp_shape` verifies this on each MLP class before use.

How a layer gets its rows (`FlashFFN.kind`):
    resident  all neurons, loaded once in neuron order (dense mode, hybrid's resident layers)
    encoded   all neurons held ENDOR-encoded as stored (hybrid, when the budget holds more layers
              encoded than decoded), decoded into the shared streaming buffer at every call
    streamed  all neurons, read into the shared streaming buffer at every call (naive, hybrid);
              in flash mode (layers the plan streams whole) read ahead by a `StreamPrefetcher`
    sparse    predicted neurons through a NeuronCache (flash); those that do not fit in the cache
              are read into the streaming buffer for this call only
"""

import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..cpu import endor as cpu_endor
from ..io import host_bytes
from ..cpu.ops import (active_mask, decode_kernel_enabled, gather_matvec, gather_matvec_t, kernels_active,
                       mask_activation_ok, quantized_matvec, sparse_decode, sparse_decode_drain,
                       sparse_decode_lookahead, sparse_decode_state, sparse_ffn)
from ..errors import FlashError
from ..metal import endor as metal_endor
from ..metal import kernels as metal_kernels
from .neuron_cache import CacheUpdate, NeuronCache, plan_chunks


class CurrentRows:
    """The rows an FFN call computes with (a plain object, so no array joins the parameter tree).

    threshold (activation units, >= 0) with `act` and `masked_role` ("gate" for gated MLPs, else
    "up"): the thresholded model of sparse/predictor.py. The masked role's output g is replaced by
    0 where |act(g)| <= threshold; act(0) = 0 for every supported activation, so neuron i's
    h_i = act(g_i) * (up_i x) (or act(up_i x)) becomes exactly 0 and the rest is unchanged.

    resident_gate ({"weight", "scales", "biases"} of the whole layer's MLX-quantized gate, bits and
    group size in quant["gate"]; packs converted with --gate-bits): the rows carry no gate, and the
    gate projection is the resident gate times x taken at `ids`, the neuron id of each row (None:
    rows 0..n-1 are neurons 0..n-1).
    """

    def __init__(self, quant: dict, down_bias=None, resident_gate=None):
        self.quant = quant  # role -> {"group_size", "bits"} for quantized roles
        self.down_bias = down_bias  # resident per-output bias of the down projection, or None
        self.resident_gate = resident_gate
        self.rows, self.n, self.add_down_bias, self.ids = None, 0, True, None
        self.gate_values = None  # full_gate(x) of the current call, when already computed
        self.term_sizes = None  # a list while a first-call check records each down call's |h| @ |W|
        self.threshold, self.act, self.masked_role = 0.0, None, None

    def set_threshold(self, threshold: float, act, masked_role: str):
        """Apply |act(g)| > threshold to `masked_role`'s output from now on (0 turns it off)."""
        self.threshold, self.act, self.masked_role = float(threshold), act, masked_role

    def set(self, rows: dict, n: int, add_down_bias=True, ids=None):
        self.rows, self.n, self.add_down_bias, self.ids = rows, n, add_down_bias, ids

    def full_gate(self, x):
        """The resident gate times x, every neuron [..., n_neurons]."""
        g, q = self.resident_gate, self.quant["gate"]
        y = quantized_matvec(x, g["weight"], g["scales"], g["biases"], q["group_size"], q["bits"])
        return y + g["bias"] if "bias" in g else y

    def gate_from_resident(self, x):
        """The resident gate's output at the rows' neurons [..., n] (class docstring); reuses
        `gate_values` (full_gate(x) of this call, set by the sparse FFN) when given."""
        y = self.full_gate(x) if self.gate_values is None else self.gate_values
        return y[..., : self.n] if self.ids is None else mx.take(y, self.ids, axis=-1)


class RowProjection(nn.Module):
    """Stands in for an up or gate projection: y = x @ rows[role][:n].T (+ bias)."""

    def __init__(self, role: str, current: CurrentRows):
        super().__init__()
        self.role, self._current = role, current

    def __call__(self, x):
        c, role = self._current, self.role
        q = c.quant.get(role, {})
        if c.resident_gate is not None and role == "gate" and "gate.weight" not in c.rows:
            y = c.gate_from_resident(x)
            if c.threshold > 0 and role == c.masked_role:
                y = mx.where(mx.abs(c.act(y)) > c.threshold, y, mx.zeros_like(y))
            return y
        y = gather_matvec(x, c.rows[f"{role}.weight"], n=c.n, scales=c.rows.get(f"{role}.scales"),
                          biases=c.rows.get(f"{role}.biases"), group_size=q.get("group_size", 64),
                          bits=q.get("bits"))
        if f"{role}.bias" in c.rows:
            y = y + c.rows[f"{role}.bias"][: c.n]
        if c.threshold > 0 and role == c.masked_role:
            y = mx.where(mx.abs(c.act(y)) > c.threshold, y, mx.zeros_like(y))
        return y


class RowDown(nn.Module):
    """Stands in for the down projection: y = h @ rows["down_t"][:n] (+ resident bias)."""

    def __init__(self, current: CurrentRows):
        super().__init__()
        self._current = current

    def __call__(self, h):
        c = self._current
        q = c.quant.get("down_t", {})
        y = gather_matvec_t(h, c.rows["down_t.weight"], n=c.n, scales=c.rows.get("down_t.scales"),
                            biases=c.rows.get("down_t.biases"), group_size=q.get("group_size", 64),
                            bits=q.get("bits"))
        if c.term_sizes is not None:
            c.term_sizes.append(_term_sizes(h, c.rows, c.n, q))
        if c.add_down_bias and c.down_bias is not None:
            y = y + c.down_bias
        return y


def _term_sizes(h, rows: dict, n: int, q: dict):
    """|h| @ |W| of a down call on rows[:n] (float32 [..., K]): per output, the sum of its terms'
    sizes, the scale of that sum's rounding error."""
    w = rows["down_t.weight"][:n]
    if "down_t.scales" in rows:
        w = mx.dequantize(w, rows["down_t.scales"][:n], rows["down_t.biases"][:n],
                          group_size=q.get("group_size", 64), bits=q.get("bits"))
    return mx.abs(h.astype(mx.float32)) @ mx.abs(w.astype(mx.float32))


class UpDownMLP(nn.Module):
    """down(act(up x)) for models whose layer has no MLP object (OPT's fc1/fc2)."""

    def __init__(self, act):
        super().__init__()
        self._act = act

    def __call__(self, x):
        return self.down(self._act(self.up(x)))


def _kernel_weights(rows: dict, role: str, quant: dict):
    """metal_kernels.Weights of one role's rows (weight, scales, biases, bias; bits from `quant`)."""
    q = quant.get(role, {})
    return metal_kernels.Weights(rows[f"{role}.weight"], rows.get(f"{role}.scales"), rows.get(f"{role}.biases"),
                                 rows.get(f"{role}.bias"), q.get("bits"), q.get("group_size", 64))


def endor_kernel_bundles(entry) -> bool:
    """True when a layer's bundles are what the ENDOR decode-matvec kernels take: gate/up/down (or
    up/down) ENDOR blocks of one payload, nothing else in the bundle."""
    names = [c.name for c in entry.components]
    payloads = [c.endor for c in entry.components]
    return (entry.encoding == "endor" and names in (["gate.weight", "up.weight", "down_t.weight"],
                                                    ["up.weight", "down_t.weight"])
            and payloads[0] is not None and all(p == payloads[0] for p in payloads))


def _count_read(step, stats, waited_s: float, neurons: int):
    """Add one whole read to a step's counters: `waited_s` the forward pass waited for it (I/O
    time), its ReadStats (read and decode seconds, bytes) and the `neurons` it loaded."""
    step.io_s += waited_s
    step.io_read_s += stats.seconds
    step.decode_s += stats.decode_seconds
    step.bytes_read += stats.bytes_read
    step.neurons_loaded += neurons


def sparse_layers_to_eval(kinds: dict, prefetch: bool) -> set:
    """The sparse layers whose FFN output must be evaluated before the layer returns; `kinds`:
    {layer: FlashFFN.kind}, `prefetch`: streamed layers read ahead into their own ring.

    A sparse layer's output reads its cache rows and the shared streaming buffer lazily. When the
    next layer that is not resident is sparse (or prefetched), its mask read evaluates the
    residual stream, this output included, before it writes any rows (its decode primitive runs
    after it on MLX's stream), so a second host sync per layer saves nothing. One followed by a
    layer that refills the shared buffer before syncing (streamed without prefetch, encoded)
    evaluates its own. The next pass's first such layer follows the last one: when it is sparse,
    nothing in the pass waits for its output, and mlx-lm's generate builds the next token's graph
    while this one evaluates (FlashRuntime.order_after_last_pass orders a pass not built on it)."""
    order = sorted(kinds)
    out = set()
    for k, i in enumerate(order):
        if kinds[i] != "sparse":
            continue
        # the layers after it, then the next pass's up to itself (a sparse layer: the list is not empty)
        nxt = next(kinds[j] for j in order[k + 1:] + order[:k + 1] if kinds[j] != "resident")
        if not (nxt == "sparse" or (nxt == "streamed" and prefetch)):
            out.add(i)
    return out


def layout_key(entry) -> tuple:
    """Bundle layout of a layer: layers with equal keys can share streaming buffers."""
    return (entry.count,) + tuple((c.name, c.dtype, tuple(c.shape)) for c in entry.components)


class StreamPrefetcher:
    """Reads whole streamed layers ahead, in a background thread, into a ring of two buffers.

    The weights a streamed layer needs do not depend on the token, so while layer i computes (its
    attention and FFN) the next streamed layers are already being read: those of the same forward
    pass, and once the pass has taken its last streamed layer, the first ones of the next pass
    (into the slots it frees, while the pass's remaining layers compute). Reads are scheduled in
    layer order, at most `slots` ahead; a slot is reused only after the FFN that used it has been
    evaluated. Reads go through `runtime.loader` (whatever wraps it at the time) and are counted
    when the FFN consumes them, so per-step bytes stay exact; the step's I/O time is the time the
    forward pass waited for a read. `carried`: the next pass's reads scheduled so far.

    On the GPU, ENDOR layers the decode-matvec kernels take are read as stored (`encoded`: each
    slot is (uint32 words, bundle byte offsets) from FlashLoader.read_encoded, not decoded rows).
    """

    def __init__(self, runtime, layers, slots=2):
        self.rt, self.order = runtime, sorted(layers)
        loader = runtime.loader
        if len({layout_key(loader.entry(i)) for i in self.order}) != 1:
            raise FlashError("prefetch: the streamed layers have different bundle layouts")
        self.encoded = metal_kernels.metal_active() and all(endor_kernel_bundles(loader.entry(i))
                                                             for i in self.order)
        if self.encoded:
            self.buffers = [(None, None)] * slots
        else:
            self.buffers = [loader.alloc(self.order[0], loader.entry(self.order[0]).count)
                            for _ in range(slots)]
            for i in self.order:  # resolve destination views here, not in the reader thread
                for buf in self.buffers:
                    loader._targets(loader.entry(i), buf)
        self.free = list(range(slots))
        self.pending = {}  # layer -> (slot, future) for the current step
        self.carried = {}  # layer -> (slot, future): the next pass's first layers, read ahead
        self.step, self.cursor = None, 0  # step: the StepStats of the pass being scheduled
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="mlx-flash-prefetch")

    def pump(self, step):
        """Fill free slots with the next streamed layers of forward pass `step` (its StepStats),
        then, when all of them are scheduled, with the next pass's first ones (`carried`)."""
        if step is not self.step:
            for slot, fut in self.pending.values():  # an aborted pass: drain before reuse
                fut.result()
                self.free.append(slot)
            # the new pass starts with the reads the last one scheduled for it
            self.pending, self.carried, self.step = self.carried, {}, step
            self.cursor = len(self.pending)
        while self.free and self.cursor < len(self.order):
            layer = self.order[self.cursor]
            self.cursor += 1
            self.pending[layer] = self._submit(layer)
        while self.free and len(self.carried) < len(self.order):
            layer = self.order[len(self.carried)]
            self.carried[layer] = self._submit(layer)

    def _submit(self, layer):
        """(slot, future) of reading `layer` into a free slot in the background."""
        slot = self.free.pop(0)
        return slot, self._pool.submit(self._read, layer, slot)

    def _read(self, layer, slot):
        """ReadStats of reading all of `layer` into `slot` (decoded rows, or stored bundles)."""
        loader = self.rt.loader
        if not self.encoded:
            return loader.read(layer, np.arange(loader.entry(layer).count), self.buffers[slot])
        words, offsets, stats = loader.read_encoded(layer, self.buffers[slot][0])
        self.buffers[slot] = (words, offsets)
        return stats

    def ready(self, layer: int) -> bool:
        """True when `layer`'s read is done (or was never scheduled)."""
        fut = self.pending.get(layer, (None, None))[1]
        return fut is None or fut.done()

    def take(self, layer: int, step):
        """(rows or (words, offsets), slot, ReadStats, seconds waited) of `layer` for pass `step`."""
        self.pump(step)
        if layer not in self.pending:  # not scheduled (layer order unusual): read it now
            if not self.free:
                raise FlashError(f"layer {layer}: prefetch ring exhausted")
            self.pending[layer] = (self.free.pop(0), None)
        slot, fut = self.pending.pop(layer)
        t0 = time.perf_counter()
        stats = self._read(layer, slot) if fut is None else fut.result()
        return self.buffers[slot], slot, stats, time.perf_counter() - t0

    def release(self, slot: int, step):
        self.free.append(slot)
        self.pump(step)

    def close(self):
        self._pool.shutdown(wait=True)


class FlashRuntime:
    """What the FFN modules of one model share: loader, stats, window, predictors, caches,
    the streaming buffer (allocated on first use, one per bundle layout) and, in flash mode with
    whole-layer streamed layers, their prefetcher.
    overflow_rows / max_read_bytes: the streaming buffer holds at most that many rows (a plan
    whose only use of it is sparse overflow) and overflow reads stage at most that many bytes per
    loader call; larger overflows are read and computed in pieces. None: a whole layer, any size."""

    def __init__(self, loader, stats, *, window=5, predictors=None, overflow_rows=None, max_read_bytes=None):
        self.loader, self.stats, self.window = loader, stats, window
        self.overflow_rows, self.max_read_bytes = overflow_rows, max_read_bytes
        self.predictors = predictors or {}
        self.caches: dict[int, NeuronCache] = {}
        self._stream: dict[tuple, dict] = {}
        self.held: dict[int, tuple] = {}  # encoded layers: (uint32 words, int64 bundle offsets)
        self.encoded = None  # ENDOR layers streamed on the GPU: their bundles as stored (uint32 words)
        self.prefetcher: StreamPrefetcher | None = None
        self.eval_sparse: set | None = None  # sparse layers that evaluate their output (None: all)
        self.unevaluated = None  # (layer, output, stream) of the last sparse layer left lazy
        # lookahead (set_lookahead): {sparse layer i: (next sparse layer j, RMSNorm weight ratio)}
        self.lookahead: dict[int, tuple] = {}
        self.currents: dict[int, CurrentRows] = {}
        self.ahead_rows = 0
        self.ahead: dict[int, tuple] = {}  # layer j -> (start_read handle, neuron ids, buffer) in flight
        self._ahead_bufs: dict[int, dict] = {}
        # neurons the lookahead read / that a layer then needed / of those, copied into cache rows
        self.ahead_read = self.ahead_used = self.ahead_copied = 0
        # cache rows read into the streaming buffer with their layer's overflow, then copied in
        self.fill_copied = 0
        self.ffns: dict = {}  # layer -> its FlashFFN
        self.decode_states: dict = {}  # sparse layer -> its decode primitive's state, with the lookahead
        self._decode_ahead = None  # (the decode primitives' lookahead, its bundle layout): decode_lookahead

    def set_lookahead(self, pairs: dict, rows: int):
        """Read the next sparse layer's predicted neurons while this one computes.

        pairs: {layer i: (layer j, scale)}: layer j's FFN input is estimated from layer i's as
        x_i * scale (scale = j's post-attention RMSNorm weight / i's: the same residual stream,
        normalised; it misses what layer i's FFN and layer j's attention add), and j's resident
        gate on it gives a lookahead mask. Its neurons not in j's cache (at most `rows`) are
        submitted (FlashLoader.start_read: no thread, the device reads while layer i computes)
        into one of two lookahead buffers once layer i's own reads are in; layer j reaps them
        and takes the ones it needs from there, its other neurons read beside them."""
        self.lookahead, self.ahead_rows = dict(pairs), int(rows)

    def ahead_mask(self, layer: int, x):
        """Lazy bool [n_j]: the lookahead mask of the layer after `layer` from its input x, or None."""
        if layer not in self.lookahead or x.size // x.shape[-1] != 1:
            return None
        j, scale = self.lookahead[layer]
        return _gate_mask(self.predictors[j], self.currents[j].full_gate(x * scale))

    def start_ahead(self, layer: int, mask) -> None:
        """Start reading the lookahead neurons of the layer after `layer` (mask: evaluated
        ahead_mask) that its cache lacks, into the lookahead buffer of that layer's parity."""
        j = self.lookahead[layer][0]
        cache = self.caches[j]
        ids = np.nonzero(np.array(mask))[0]
        ids = ids[cache.slot_of[ids] < 0][: self.ahead_rows]
        if not len(ids):
            return
        k = j % 2  # consecutive layers alternate: layer j's rows stay until j + 1 has synced
        self.drain_ahead(k)
        if k not in self._ahead_bufs:
            self._ahead_bufs[k] = self.loader.alloc(j, self.ahead_rows)
        buf = self._ahead_bufs[k]
        start = getattr(self.loader, "start_read", None)  # submitted now, reaped by await_ahead
        started = (start(j, ids, buf, np.arange(len(ids)), key=k) if start is not None
                   else {"stats": self.loader.read(j, ids, buf, np.arange(len(ids)))})
        self.ahead[j] = (started, ids, buf)

    def decode_lookahead(self):
        """(the decode primitives' lookahead (ops.sparse_decode_lookahead) over the two lookahead
        buffers, their bundle layout), made once when lookahead is on (else None). From then on
        the buffers are the primitives': the per-layer path reads nothing ahead (next_ahead)."""
        if not self.lookahead:
            return None
        if self._decode_ahead is None:
            self.drain_ahead()
            j = min(j for j, _ in self.lookahead.values())
            for k in (0, 1):
                if k not in self._ahead_bufs:
                    self._ahead_bufs[k] = self.loader.alloc(j, self.ahead_rows)
            rows = [[host_bytes(a).reshape(a.shape[0], -1) for a in self._ahead_bufs[k].values()] for k in (0, 1)]
            # the plan's third share of the lookahead: a buffer's rows, as bytes
            ctx, staging = self.loader.decode_lookahead_io(sum(r.shape[1] for r in rows[0]) * self.ahead_rows)
            self._decode_ahead = (sparse_decode_lookahead(ctx, staging, *rows), layout_key(self.loader.entry(j)))
        return self._decode_ahead

    def next_ahead(self, layer: int, x):
        """The per-layer path's lookahead mask for the layer after `layer` (ahead_mask), None once
        the decode primitives read ahead (decode_lookahead has been made)."""
        return None if self._decode_ahead is not None else self.ahead_mask(layer, x)

    def drain_ahead(self, parity=None) -> None:
        """Wait for lookahead reads no layer took (an aborted pass), of one buffer or all: nothing
        may still land in a buffer, or be reaped from its context, once it is reused."""
        for j in [j for j in self.ahead if parity is None or j % 2 == parity]:
            started = self.ahead.pop(j)[0]
            if "job" in started:
                self.loader.finish_read(started)

    def await_ahead(self, pending, step):
        """(neuron ids, buffer) of a lookahead read `pending` ((start_read's handle, ids, buffer)
        popped from `ahead`) once it is in, counted in `step` (the wait as I/O time)."""
        started, ids, buf = pending
        t0 = time.perf_counter()
        stats = self.loader.finish_read(started) if "job" in started else started["stats"]
        _count_read(step, stats, time.perf_counter() - t0, len(ids))
        return ids, buf

    def close(self):
        """Stop the prefetcher and close the loader (threads, AIO contexts, open files), once
        whatever MLX still evaluates is done (a sparse layer's decode primitive reads the files):
        the last pass's lazy output first, on whichever stream it was built (mlx-lm's generate
        leaves the token after the last one it yields scheduled on a stream of its own)."""
        last, self.unevaluated = self.unevaluated, None
        try:
            if last is not None:  # its error (a corrupt pack) is raised once the files are closed
                mx.eval(last[1])
        finally:
            mx.synchronize()
            if self._decode_ahead is not None:
                sparse_decode_drain(self._decode_ahead[0])
            if self.prefetcher is not None:
                self.prefetcher.close()
                self.prefetcher = None
            self.drain_ahead()
            self.loader.close()

    def finish_sparse(self, layer: int, y) -> None:
        """Evaluate sparse layer `layer`'s output `y` when a later host write into its cache rows or
        the shared streaming buffer could overtake it (sparse_layers_to_eval), else keep it as the
        lazy output order_after_last_pass orders the next pass after."""
        if self.eval_sparse is None or layer in self.eval_sparse:
            mx.eval(y)
        else:
            self.unevaluated = (layer, y, mx.default_stream(mx.default_device()))

    def order_after_last_pass(self, layer: int) -> None:
        """At a pass's first FFN call (`layer` not after the last lazy one's): the last pass's
        lazy output is scheduled before anything this pass adds to its stream, and waited for when
        this pass runs on another stream (mlx-lm's generate runs on a stream of its own), so that
        this pass's host writes (cache rows, the shared buffer, staging) never overtake it, even
        when this pass's input does not depend on it. In mlx-lm's generate it is already scheduled."""
        last = self.unevaluated
        if last is None or layer > last[0]:
            return
        self.unevaluated = None
        mx.async_eval(last[1])
        if last[2] != mx.default_stream(mx.default_device()):
            mx.synchronize(last[2])

    def stream_rows(self, layer: int) -> dict:
        entry = self.loader.entry(layer)
        key = tuple((c.name, c.dtype, tuple(c.shape)) for c in entry.components)
        if key not in self._stream:
            rows = entry.count if self.overflow_rows is None else min(entry.count, self.overflow_rows)
            self._stream[key] = self.loader.alloc(layer, rows)
        return self._stream[key]


class FlashFFN(nn.Module):
    """The FFN of one layer, run as `kind` says (module docstring)."""

    def __init__(self, mlp, current: CurrentRows, layer: int, kind: str, runtime: FlashRuntime):
        super().__init__()
        self.mlp = mlp
        self.layer, self.kind = layer, kind
        self._current, self._rt = current, runtime
        self._n = runtime.loader.entry(layer).count
        self._all = np.arange(self._n)
        self._fused_act = None  # GPU: the kernels' act once the MLP was seen to compute it, False if not
        self._endor_gpu = None  # GPU, ENDOR layer streamed: True once the decode-matvec kernels matched
        self._endor_cpu = None  # CPU, ENDOR layer: True once the CPU decode-matvec matched
        self._cpu_layout = None  # the decode-matvec's view of this layer's bundles, False: not taken
        self._cpu_ffn = None  # CPU: True once ops.sparse_ffn matched the MLP, False: not taken
        self._ffn_act = None  # ops.sparse_ffn's (act, threshold) for this MLP, once looked at
        self._decoder = None  # ops.sparse_decode's (state, cache arrays, buffer arrays, roles), False: not taken
        runtime.ffns[layer] = self

    def _run(self, x, rows, n, add_down_bias=True, ids=None):
        """The MLP on rows[:n]; ids: their neuron ids (mx int32 [n]) for a resident gate."""
        return self._run_sets(x, [(rows, n, ids)], add_down_bias)

    def _run_sets(self, x, sets, add_down_bias=True, add=None):
        """[add +] the MLP on each row set (rows, n, ids), summed in order (`y = y + part`): one
        CPU kernel call (ops.sparse_ffn) when this layer takes it, else the MLP per set."""
        if self._cpu_ffn is not False:
            y = self._ffn_kernel(x, sets, add)
            if y is not None:
                return y
        return self._mlp_sets(x, sets, add_down_bias, add)

    def _mlp_sets(self, x, sets, add_down_bias=True, add=None):
        """[add +] the MLP itself on each row set, `y = y + part` (the down bias on the first part)."""
        y = add
        for rows, n, ids in sets:
            part = self._run_mlp(x, rows, n, add_down_bias and y is None, ids)
            y = part if y is None else y + part
        return y

    def _ffn_kernel_act(self, rows: dict):
        """(act, threshold) of ops.sparse_ffn for this layer's MLP on rows like `rows`, or None when
        the kernel does not compute it: half-precision rows without biases or quantization, no
        down bias, an MLP of silu / CATS / ReLU / FATReLU (gated) or ReLU (up/down only)."""
        c = self._current
        names = set(rows)
        gated = "gate.weight" in names or c.resident_gate is not None
        if (names - {"up.weight", "gate.weight", "down_t.weight"} or c.down_bias is not None
                or rows["up.weight"].dtype not in (mx.float16, mx.bfloat16)
                or getattr(self.mlp, "hidden_act", "silu") not in ("silu", "cats", "relu", "fatrelu", "product")
                or (not gated and not (isinstance(self.mlp, UpDownMLP) and self.mlp._act is nn.relu))):
            return None
        if c.resident_gate is not None and "bias" in c.resident_gate:
            return None
        act, threshold = self._kernel_act(gated, product=True)
        return (act, threshold) if act in ("silu", "relu_gated", "relu", "product") else None

    def _ffn_kernel(self, x, sets, add):
        """ops.sparse_ffn over the row sets, or None when this layer or call does not take it (CPU
        kernels off, dtypes that differ). Its first call is checked against the MLP (kept if not)."""
        if metal_kernels.metal_active() or not kernels_active():
            return None
        if self._ffn_act is None:
            self._ffn_act = self._ffn_kernel_act(sets[0][0])
            if self._ffn_act is None:
                self._cpu_ffn = False
                return None
        act, threshold = self._ffn_act
        dtype = sets[0][0]["up.weight"].dtype
        same, gate_values = self._kernel_gate(x, "gate.weight" in sets[0][0], dtype)
        if not same or (add is not None and add.dtype != dtype):
            return None
        y = sparse_ffn(x, [(r["up.weight"], r.get("gate.weight"), r["down_t.weight"], n, ids)
                           for r, n, ids in sets], gate_values, act, threshold, add)
        if self._cpu_ffn is None:  # first call: the MLP on the same rows must agree
            return self._first_call_checked(y, x, lambda pick: self._mlp_sets(
                pick(x), sets, add=None if add is None else pick(add)), "_cpu_ffn",
                                            f"CPU sparse FFN kernel ({act})")
        return y

    def _run_mlp(self, x, rows, n, add_down_bias=True, ids=None):
        """The MLP itself (its row projections) on rows[:n]."""
        gate_rows = self._current.resident_gate is None  # the fused kernels take the gate from rows
        if gate_rows and self._fused_act is not False and metal_kernels.metal_active():
            y = self._run_fused(x, rows, n, add_down_bias)
            if y is not None:
                return y
        self._current.set(rows, n, add_down_bias, ids)
        return self.mlp(x)

    def _run_fused(self, x, rows, n, add_down_bias):
        """The FFN on the Metal kernels: fused up/gate + activation (and mask) over the first n rows,
        then down over the same rows. Used when the MLP is down(silu(gate x) * up x), relu_llama's
        down(relu(gate x) * up x) / FATReLU (its threshold as the mask's) or down(relu(up x)):
        checked against the MLP itself on the first call; None if it is not that (and at once for
        relu_llama's product threshold)."""
        c = self._current
        if getattr(self.mlp, "hidden_act", "silu") == "product":  # the kernels mask act(gate), not h
            self._fused_act = False
            return None
        up, down = _kernel_weights(rows, "up", c.quant), _kernel_weights(rows, "down_t", c.quant)
        gate = _kernel_weights(rows, "gate", c.quant) if "gate.weight" in rows else None
        act, threshold = self._kernel_act(gate is not None)
        h = metal_kernels.sparse_up(x, up, gate, n=n, act=act, threshold=threshold)
        y = metal_kernels.sparse_down(h, down, n=n)
        if add_down_bias and c.down_bias is not None:
            y = y + c.down_bias
        if self._fused_act is None:
            c.set(rows, n, add_down_bias)
            want = self.mlp(x)
            same = mx.allclose(y, want, rtol=2e-2, atol=2e-2).item()
            self._fused_act = act if same else False
            if not same:
                diff = mx.abs(y.astype(mx.float32) - want.astype(mx.float32)).max().item()
                warnings.warn(f"layer {self.layer}: the Metal FFN kernels ({act}) differ from the MLP "
                              f"(max {diff:.3g}); this layer keeps the MLP path", RuntimeWarning, stacklevel=2)
                return None
        return y

    def _kernel_act(self, gated: bool, product=False):
        """(act, threshold) of the Metal kernels for this MLP (the first call checks the guess);
        product: the caller's kernels compute relu_llama's product rule (ops.sparse_ffn)."""
        c = self._current
        if not gated:
            return "relu", c.threshold
        own = float(getattr(self.mlp, "threshold", 0.0))  # relu_llama's FATReLU / CATS threshold
        if product and getattr(self.mlp, "hidden_act", "silu") == "product":
            return "product", own  # the model's own rule: no predictor threshold is added to it
        if getattr(self.mlp, "hidden_act", "silu") in ("relu", "fatrelu"):
            return "relu_gated", max(own, c.threshold)
        if getattr(self.mlp, "hidden_act", "silu") == "cats":
            return "silu", max(own, c.threshold)
        return "silu", c.threshold  # the predictor's thresholded model (CurrentRows)

    def __call__(self, x):
        self._rt.order_after_last_pass(self.layer)
        step = self._rt.stats.enter_layer(self.layer, x.size // x.shape[-1])
        before = step.counters()
        t0 = time.perf_counter()
        try:
            return self._call(x, step)
        finally:
            step.add_layer(self.layer, self.kind, before, time.perf_counter() - t0)

    def _call(self, x, step):
        if self._rt.prefetcher is not None:
            self._rt.prefetcher.pump(step)
        if self.kind == "resident":
            step.neurons_needed += self._n
            step.hits += self._n
            return self._run(x, self._rt.caches[self.layer].rows, self._n)
        if self.kind == "streamed":
            return self._streamed(x, step)
        if self.kind == "encoded":
            return self._encoded(x, step)
        return self._sparse(x, step)

    def _encoded(self, x, step):
        """A layer held ENDOR-encoded: decoded into the streaming buffer (counted as I/O: it is
        what stands in for the read), then run like a streamed layer; the decode-matvec kernels
        (GPU; CPU for one token) read the held bundles instead (no decode)."""
        step.neurons_needed += self._n
        step.hits += self._n
        return self._from_encoded(x, step, *self._rt.held[self.layer])

    def _read_stream(self, ids, step):
        buf = self._rt.stream_rows(self.layer)
        t0 = time.perf_counter()
        stats = self._rt.loader.read(self.layer, ids, buf, np.arange(len(ids)))
        _count_read(step, stats, time.perf_counter() - t0, len(ids))
        return buf

    def _streamed(self, x, step):
        if self._rt.prefetcher is not None:
            return self._prefetched(x, step)
        on_gpu = self._endor_on_gpu(x)
        if on_gpu or self._endor_on_cpu(x):  # read the bundles as stored, no decode
            t0 = time.perf_counter()
            self._rt.encoded, offsets, stats = self._rt.loader.read_encoded(self.layer, self._rt.encoded)
            _count_read(step, stats, time.perf_counter() - t0, self._n)
            step.neurons_needed += self._n
            if on_gpu:
                return self._endor_kernels(x, self._rt.encoded, offsets,
                                           lambda: self._read_stream(self._all, step))
            return self._from_encoded(x, step, self._rt.encoded, offsets)  # its first call decodes these bytes
        buf = self._read_stream(self._all, step)
        step.neurons_needed += self._n
        y = self._run(x, buf, self._n)
        mx.eval(y)  # the buffer is reused by the next streamed layer
        return y

    def _from_encoded(self, x, step, words, offsets):
        """This layer from its bundles as stored: the decode-matvec kernels on the GPU, or on the
        CPU for one token, else (prompts, or the kernels do not take it) decoded into the
        streaming buffer by the CPU kernel (counted as I/O and decode time) and the row path."""

        def decoded():
            buf = self._rt.stream_rows(self.layer)
            seconds = self._rt.loader.decode_encoded(self.layer, words, offsets, buf)
            step.io_s += seconds
            step.decode_s += seconds
            return buf

        if self._endor_on_gpu(x):
            return self._endor_kernels(x, words, offsets, decoded)
        if self._endor_on_cpu(x):
            return self._endor_cpu_kernel(x, words, offsets, decoded)
        y = self._run(x, decoded(), self._n)
        mx.eval(y)  # the streaming buffer is reused by the next layer
        return y

    def _endor_on_gpu(self, x) -> bool:
        """True when this call runs the ENDOR decode-matvec kernels (mlx_flash/metal/endor.py):
        on the GPU, at most 16 tokens (prefill keeps the decoded rows), bundles of gate/up/down
        (or up/down) ENDOR blocks of one payload, and the first call agreed with the row path."""
        if (self._endor_gpu is False or not metal_kernels.metal_active()
                or x.size // x.shape[-1] > metal_kernels.MAX_METAL_TOKENS):
            return False
        if not endor_kernel_bundles(self._rt.loader.entry(self.layer)):
            self._endor_gpu = False
        return self._endor_gpu is not False

    def _endor_on_cpu(self, x) -> bool:
        """True when this call runs the CPU decode-matvec (mlx_flash/cpu/endor.py): MLX on the CPU
        with the kernels on, one token, bundles it takes (cpu_endor.bundle_layout: gate/up/down or
        up/down float16 / bfloat16 blocks, OPT's up bias), and the first call agreed with the row path."""
        if self._endor_cpu is False or metal_kernels.metal_active() or not kernels_active():
            return False
        if self._cpu_layout is None:  # the layer's bundles never change: look at them once
            entry = self._rt.loader.entry(self.layer)
            layout = cpu_endor.bundle_layout(entry)
            shapes = {c.name: c.shape[-1] for c in entry.components if c.shape}
            self._cpu_layout = layout is not None and dict(
                layout, columns=shapes["up.weight"], down_columns=shapes["down_t.weight"],
                where=str(self._rt.loader.pack / entry.file))
        if not self._cpu_layout:
            self._endor_cpu = False
            return False
        return cpu_endor.takes(self._cpu_layout["payload"], x.size // x.shape[-1])

    def _endor_cpu_kernel(self, x, words, offsets, decoded_rows):
        """The FFN of this ENDOR layer by the CPU decode-matvec, from its bundles as stored:
        no decoded row is written (its time is compute, not decode). decoded_rows(): the rows
        decoded, for the first call's comparison with the row path (kept if they differ)."""
        layout = self._cpu_layout
        act, threshold = self._kernel_act(layout["gated"])
        y = cpu_endor.endor_ffn_cpu(x, words, offsets, columns=layout["columns"],
                                    down_columns=layout["down_columns"], payload=layout["payload"],
                                    act=act, threshold=threshold, up_bias=layout["up_bias"],
                                    where=layout["where"])
        if self._current.down_bias is not None:
            y = y + self._current.down_bias
        if self._endor_cpu is None:  # first call: the row path must agree
            return self._first_call_checked(y, x, lambda pick: self._run_mlp(pick(x), decoded_rows(), self._n),
                                           "_endor_cpu",
                                           f"CPU ENDOR decode-matvec ({act})")
        return y

    def _first_call_checked(self, y, x, reference, flag: str, kernels: str):
        """A kernel path's first output y (of input x [..., T, D]) against the MLP's: sets `flag`
        (whether they agree) and returns y, or the MLP's output (warned) if not.

        reference(pick) is the row path on pick(x) (pick(a): a's checked tokens, axis -2): at most
        CHECK_TOKENS of the call's tokens, spread from its first to its last (a prompt's first
        call would otherwise run the row path, and its float32 term sizes, on every token, ~0.1 s
        per layer on a CPU; the tokens checked came out of the same kernel call as the rest).
        They agree within 2e-2 of the largest output plus 2e-2 of the largest sum of the down
        projection's term sizes (|h| @ |W|, per output): the scale of a sum's rounding error, small
        where the outputs are small (an absolute floor would pass any error below it there), large
        in late layers whose outputs reach thousands. If they do not agree, the row path's output
        of every token is returned."""
        c = self._current
        pick = _token_picker(x)
        saved_gate = c.gate_values  # full_gate of every token of this call, when set
        c.term_sizes = []
        try:
            if saved_gate is not None:
                c.gate_values = pick(saved_gate)
            want = reference(pick)
            terms = c.term_sizes
        finally:
            c.term_sizes, c.gate_values = None, saved_gate
        scale = mx.stack([t.max() for t in terms]).max() if terms else mx.array(0.0)
        got = pick(y).astype(mx.float32)
        diff = mx.abs(got - want.astype(mx.float32)).max()
        same = (diff <= 2e-2 * mx.abs(want.astype(mx.float32)).max() + 2e-2 * scale).item()
        setattr(self, flag, same)
        if same:
            return y
        warnings.warn(f"layer {self.layer}: the {kernels} differ from the MLP; this layer keeps the "
                      f"row path", RuntimeWarning, stacklevel=3)
        want = reference(lambda a: a)
        mx.eval(want)
        return want

    def _endor_kernels(self, x, words, offsets, decoded_rows):
        """The FFN of this ENDOR layer on the decode-matvec kernels, from its bundles as stored
        (`words`, byte `offsets`): no decoded row is written. decoded_rows(): the layer's rows
        decoded on the CPU, for the first call's comparison with the row path (kept if they differ)."""
        entry = self._rt.loader.entry(self.layer)
        act, threshold = self._kernel_act(len(entry.components) == 3)
        y, ok = metal_endor.endor_ffn(x, words, metal_endor.word_bounds(offsets),
                                      columns=entry.components[-2].shape[-1],
                                      down_columns=entry.components[-1].shape[-1], payload=entry.components[0].endor,
                                      act=act, threshold=threshold)
        if self._current.down_bias is not None:
            y = y + self._current.down_bias
        mx.eval(y, ok)  # the words may be a buffer the next layer reuses
        if not ok.all().item():
            bad = int(mx.argmin(ok.astype(mx.int32)).item())
            raise FlashError(f"{self._rt.loader.pack / entry.file}: bundle {bad}: its bitmaps' popcount "
                             f"disagrees with the bytes stored (corrupt or truncated)")
        if self._endor_gpu is None:  # first call: the row path (decoded on the CPU) must agree
            return self._first_call_checked(y, x, lambda pick: self._run_mlp(pick(x), decoded_rows(), self._n),
                                           "_endor_gpu",
                                           f"ENDOR Metal kernels ({act})")
        return y

    def _prefetched(self, x, step):
        pf = self._rt.prefetcher
        if not pf.ready(self.layer):
            mx.async_eval(x)  # compute what leads up to this layer while its read finishes
        buf, slot, stats, waited = pf.take(self.layer, step)
        _count_read(step, stats, waited, self._n)
        step.neurons_needed += self._n
        try:
            if pf.encoded:
                y = self._from_encoded(x, step, *buf)
            else:
                y = self._run(x, buf, self._n)
            mx.eval(y)  # the slot is refilled as soon as it is released
        finally:
            pf.release(slot, step)
        return y

    def _read_fill_and_overflow(self, cache, upd, step):
        """Read the neurons the cache update gave rows (upd.fill) and plan its overflow, the fill
        and the overflow's first piece in one loader call when they fit: (overflow pieces, the
        streaming buffer when the first piece is already in it, else None).

        The call is one read plan of both when they fit the streaming buffer's rows and the
        staging limits, with merges undone down to the limits when the plan's merged reads stage
        more (plan_chunks, fit_merges) (their bundles interleave in the file: planned apart, each would read
        through the other's gaps): the overflow lands in buffer rows 0.. in (sorted) id order, as
        its own read would place it, the fill after it, copied into its cache rows
        (upd.fill_slots) before anything computes with them. Else it is two plans, the fill read
        straight into its rows beside the first overflow piece, when the fill is one piece and both
        stage no more than the streaming buffer's bytes; else each is a call of its own."""
        at_once = self._read_at_once(cache, upd, step)
        if at_once is not None:
            return at_once
        rt, over = self._rt, upd.overflow
        fill = upd.fill if upd.fill is not None else over[:0]
        buf = rt.stream_rows(self.layer) if len(over) else None
        joint = None
        if len(fill) and len(over) and len(over) + len(fill) <= next(iter(buf.values())).shape[0]:
            limit = _tightest(rt.max_read_bytes, cache.max_read_bytes)
            # one piece: the plan of both, its merges cut back to the staging limit when it is over
            both = plan_chunks(rt.loader, self.layer, np.concatenate([over, fill]), limit)
            if len(both) == 1 and (limit is None or both[0].read_bytes <= limit):
                joint = both[0]
        if joint is not None:
            pieces, batches = [over], [[(self.layer, joint, buf, joint.index)]]  # bundle i -> row of its position
        else:
            pieces = plan_chunks(rt.loader, self.layer, over, rt.max_read_bytes, rt.overflow_rows) if len(over) else []
            fills = [(self.layer, p, cache.rows, upd.fill_slots[p.index])
                     for p in (plan_chunks(rt.loader, self.layer, fill, cache.max_read_bytes) if len(fill) else [])]
            if pieces and len(fills) == 1 and (rt.max_read_bytes is None or
                                               fills[0][1].read_bytes + pieces[0].read_bytes <= rt.max_read_bytes):
                batches = [fills + [(self.layer, pieces[0], buf, np.arange(len(pieces[0])))]]
            else:
                batches, buf = [[r] for r in fills], None
        for batch in batches:
            t0 = time.perf_counter()
            stats = rt.loader.read_many(batch)
            if joint is not None:
                self._copy_fill(cache, upd, buf, len(over))
            # the fill's neurons are counted by the cache update (upd.loaded)
            _count_read(step, stats, time.perf_counter() - t0, len(pieces[0]) if buf is not None else 0)
        return pieces, buf

    def _read_at_once(self, cache, upd, step):
        """_read_fill_and_overflow's reads in one loader call taken by FlashLoader.read_at_once
        (a decode token's, mostly), or None, nothing read, when it does not take them: the fill
        straight into its cache rows, the overflow into streaming-buffer rows 0.., or both there
        (the fill after the overflow, then copied into its cache rows) when their rows fit."""
        rt, over = self._rt, upd.overflow
        fill = upd.fill if upd.fill is not None else over[:0]
        if not len(over):
            if not len(fill):
                return [], None
            stats = rt.loader.read_at_once(self.layer, fill, cache.rows, upd.fill_slots, cache.max_read_bytes)
            if stats is None:
                return None
            _count_read(step, stats, stats.seconds, 0)  # the fill's neurons are counted by the update
            return [], None
        buf = rt.stream_rows(self.layer)
        if len(over) + len(fill) > next(iter(buf.values())).shape[0]:
            return None
        stats = rt.loader.read_at_once(self.layer, np.concatenate([over, fill]) if len(fill) else over, buf, None,
                                       _tightest(rt.max_read_bytes, cache.max_read_bytes if len(fill) else None))
        if stats is None:
            return None
        if len(fill):
            self._copy_fill(cache, upd, buf, len(over))
        _count_read(step, stats, stats.seconds, len(over))
        return [over], buf

    def _copy_fill(self, cache, upd, buf, n_over: int):
        """Copy the cache fill, read into streaming-buffer rows n_over.. beside the overflow, into
        the cache rows the update gave it."""
        cache.copy_rows(upd.fill_slots, buf, np.arange(n_over, n_over + len(upd.fill)))
        self._rt.fill_copied += len(upd.fill)

    def _sparse(self, x, step):
        predictor, c = self._rt.predictors[self.layer], self._current
        if c.resident_gate is not None and getattr(predictor, "resident_gate", False):
            c.gate_values = c.full_gate(x)  # one gate matvec for the mask and the rows' gate
            mask = _gate_mask(predictor, c.gate_values, x)
        else:
            mask = predictor(x).reshape(-1, self._n).any(axis=0)
        if self.layer not in self._rt.ahead:  # (a read the per-layer path started for it: taken there)
            y = self._decode(x, step, mask)
            if y is not None:
                return y
        ahead = self._rt.next_ahead(self.layer, x)
        # the one host sync of this layer: x carries the earlier layers' lazy outputs (rows are
        # rewritten below; sparse_layers_to_eval), whatever the predictor reads of it
        mx.eval(mask, x) if ahead is None else mx.eval(mask, x, ahead)
        rt = self._rt
        pending = rt.ahead.pop(self.layer, None)  # this layer's lookahead read, maybe still in flight
        active = np.nonzero(np.array(mask))[0]
        cache = rt.caches[self.layer]
        upd = cache.update(active, len(rt.stats.steps), rt.window, read=False)
        step.io_s += upd.io_s
        step.io_read_s += upd.io_s
        step.decode_s += upd.decode_s
        step.mem_s += upd.mem_s
        step.bytes_read += upd.bytes_read
        step.neurons_loaded += upd.loaded
        step.neurons_needed += upd.needed
        step.hits += upd.hits
        step.window.append(upd.window)
        # what the lookahead is reading leaves the update: the rest is read now, beside it
        served = _split_ahead(upd, pending[1]) if pending is not None else None
        pieces, first = self._read_fill_and_overflow(cache, upd, step)
        ahead_n = 0
        if pending is not None:  # rows the lookahead read: copied into the cache, or computed there
            looked = rt.await_ahead(pending, step)
            ahead_n, copied = _use_ahead(cache, served, *looked)
            step.neurons_loaded -= copied  # counted once, as the lookahead read them
            rt.ahead_read += len(looked[0])
            rt.ahead_used += ahead_n + copied
            rt.ahead_copied += copied
        if ahead is not None:  # after this layer's own reads: they have the device first
            rt.start_ahead(self.layer, ahead)
        by_id = self._current.resident_gate is not None  # rows take the resident gate at their neuron ids
        sets = [(cache.rows, cache.num_used, cache.live_ids() if by_id else None)]
        if ahead_n:
            sets.append((looked[1], ahead_n, _row_ids(looked[0][:ahead_n]) if by_id else None))
        y = None
        for k, piece in enumerate(pieces):  # each a ReadPlan: the loader reads it as planned here
            if k:
                y = self._run_sets(x, sets, add=y)
                mx.eval(y)  # the streaming buffer is about to be refilled
                sets = []
            # row k holds bundle piece.ids[k] (a ReadPlan, or the sorted ids the joint read placed
            # so); the first piece may have come with the cache fill
            buf = first if k == 0 and first is not None else self._read_stream(piece, step)
            ids = piece.ids if hasattr(piece, "ids") else piece
            sets.append((buf, len(piece), _row_ids(ids) if by_id else None))
        y = self._run_sets(x, sets, add=y)
        rt.finish_sparse(self.layer, y)
        c.gate_values = None
        return y

    def _decode(self, x, step, mask):
        """One token's step of this layer as one primitive (ops.sparse_decode): the cache update,
        its reads and the FFN run when the graph is evaluated, with no host sync here, the same
        rows, reads and result as the rest of `_sparse`; its counters reach `step` when the stats
        settle. None when the call does not go that way: more than one token, a layer whose FFN
        does not take the CPU kernel (or not yet checked), reads the primitive does not make
        (read_at_once's), dtypes that differ."""
        if x.size != x.shape[-1] or not self.decoder_ready():
            return None
        state, cache_arrays, buf_arrays, roles = self._decoder
        rt = self._rt
        act, threshold = self._ffn_act
        same, gate_values = self._kernel_gate(x, roles[1] >= 0, cache_arrays[roles[0]].dtype)
        if not same:
            return None
        # the next sparse layer's predicted neurons, read while this one computes, when both layers
        # decode by primitive with the runtime's lookahead (a layer's first decode call makes its
        # state: the next one's exists from the next token on)
        j = rt.lookahead.get(self.layer, (None,))[0]
        nxt = rt.decode_states.get(j) if j is not None and rt.ffns[j].decoder_ready() else None
        ahead = rt.ahead_mask(self.layer, x) if nxt is not None else None
        y, counters = sparse_decode(x, gate_values, mask, state, cache_arrays, buf_arrays, roles, act, threshold,
                                    len(rt.stats.steps), ahead, nxt)
        rt.stats.defer(self.layer, counters, self._decode_settled)
        rt.finish_sparse(self.layer, y)
        self._current.gate_values = None
        return y

    def decoder_ready(self) -> bool:
        """Whether this layer's decode tokens run as one primitive (_decode): after its first call
        (the CPU kernel's check), its primitive's state made now if not yet (by its own first
        decode call, or by the layer before it, which reads ahead for it)."""
        if self._decoder is None and self._cpu_ffn is True:
            self._decoder = self._make_decoder() or False
        return bool(self._decoder)

    def _kernel_gate(self, x, gate_rows: bool, dtype):
        """(x and the gate values have the rows' `dtype`, the gate values) for the CPU FFN kernels:
        the resident gate's output on x (the one _sparse computed, else now) when the rows carry
        no gate and the act needs one, else None."""
        c = self._current
        gate_values = None
        if self._ffn_act[0] != "relu" and not gate_rows:
            gate_values = c.full_gate(x) if c.gate_values is None else c.gate_values
        return x.dtype == dtype and (gate_values is None or gate_values.dtype == dtype), gate_values

    def _decode_settled(self, step_index: int, v: dict) -> None:
        """What a settled decode call (its counters v, ops.DECODE_COUNTERS) did beyond its step's
        counters, counted where the per-layer path counts it: the cache rows it filled, the fills
        it copied from beside the overflow, and its reads for the loader (FlashLoader.kernel_reads)."""
        rt = self._rt
        # loaded: the fills and overflow it read itself, and the lookahead read it took
        fills = v["loaded"] - v["overflow"] + v["ahead_used"] - v["ahead_taken"]
        rt.caches[self.layer].rows_loaded += fills
        rt.fill_copied += v["fill_copied"]
        rt.ahead_read += v["ahead_read"]
        rt.ahead_used += v["ahead_used"]
        rt.ahead_copied += v["ahead_copied"]
        rt.loader.kernel_reads(step_index, self.layer, v["loaded"], fills - v["fill_copied"] - v["ahead_copied"],
                               v["bytes"], v["reads"], v["io_ns"] * 1e-9)

    def _make_decoder(self):
        """_decode's primitive arguments for this layer, or None when it cannot take it."""
        rt = self._rt
        if (not decode_kernel_enabled() or self._ffn_act is None or metal_kernels.metal_active()
                or not kernels_active()):
            return None
        cache = rt.caches[self.layer]
        buf = rt.stream_rows(self.layer)
        names = list(buf)
        if list(cache.rows) != names or set(names) - {"up.weight", "gate.weight", "down_t.weight"}:
            return None
        reads = rt.loader.decode_reads(self.layer, buf, _largest(rt.max_read_bytes, cache.max_read_bytes))
        if reads is None:
            return None
        roles = (names.index("up.weight"), names.index("gate.weight") if "gate.weight" in names else -1,
                 names.index("down_t.weight"))
        ahead = rt.decode_lookahead()
        if ahead is not None and ahead[1] != layout_key(rt.loader.entry(self.layer)):
            ahead = None  # a layer of another bundle layout reads nothing ahead, nor is read ahead for
        state = sparse_decode_state(
            layer=self.layer, window=rt.window, ids=cache.ids, slot_of=cache.slot_of,
            last_active=cache.last_active, used=cache.used_array, cache_rows=cache.host_rows,
            buf_rows=[host_bytes(a).reshape(a.shape[0], -1) for a in buf.values()], piece_bytes=rt.max_read_bytes,
            fill_bytes=cache.max_read_bytes, lookahead=None if ahead is None else ahead[0], **reads)
        if ahead is not None:
            rt.decode_states[self.layer] = state
        return state, list(cache.rows.values()), list(buf.values()), roles


CHECK_TOKENS = 8  # tokens of a kernel path's first call checked against the MLP (_first_call_checked)


def _token_picker(x):
    """pick(a): a [..., T, D] at CHECK_TOKENS of x's T tokens spread from the first to the last
    (the identity when T is at most that)."""
    t = x.shape[-2] if x.ndim >= 2 else 1
    if t <= CHECK_TOKENS:
        return lambda a: a
    idx = mx.array(np.unique(np.linspace(0, t - 1, CHECK_TOKENS).round().astype(np.int32)))
    return lambda a: mx.take(a, idx, axis=-2)


def _gate_mask(predictor, g, x=None):
    """bool [N]: the neurons `predictor` keeps, from its resident gate's output g [..., N]:
    gate-threshold by the active_mask kernel (one op), else the predictor's rule (quant-glu:
    |act(g) * quantized up x| > cut, x the FFN input)."""
    if predictor.kind == "gate-threshold" and mask_activation_ok(predictor.activation):
        return active_mask(g, predictor.activation, predictor.threshold)
    return predictor.mask_from_gate(g, x).reshape(-1, g.shape[-1]).any(axis=0)


def _split_ahead(upd, ids):
    """Take the neurons of `ids` (a lookahead read's, sorted) out of a cache update's fill and
    overflow: returns them as an update of their own (fill, fill_slots, overflow) for `_use_ahead`."""
    served = CacheUpdate()
    fill = upd.fill if upd.fill is not None else np.zeros(0, np.int64)
    got = _members(fill, ids)
    served.fill = fill[got]
    if upd.fill is not None:
        served.fill_slots = upd.fill_slots[got]
        upd.fill, upd.fill_slots = fill[~got], upd.fill_slots[~got]
    over = np.asarray(upd.overflow, np.int64)
    got = _members(over, ids)
    served.overflow, upd.overflow = over[got], over[~got]
    return served


def _members(values, ids):
    """Bool mask of `values` found in the sorted array `ids`."""
    if not len(ids) or not len(values):
        return np.zeros(len(values), bool)
    at = np.minimum(np.searchsorted(ids, values), len(ids) - 1)
    return ids[at] == values


def _use_ahead(cache, served, ids, buf):
    """Serve the neurons a lookahead read holds (`served` from _split_ahead; `ids` sorted, in rows
    0.. of `buf`, none of them cached when it started): its fills are copied into their cache
    rows, its overflow neurons move to buf's first rows in order (ids rewritten to match).
    Returns (rows of buf to compute, fills copied)."""
    if len(served.fill):
        cache.copy_rows(served.fill_slots, buf, np.searchsorted(ids, served.fill))
    over = served.overflow
    if len(over):
        src = np.searchsorted(ids, over)
        for a in buf.values():
            h = host_bytes(a).reshape(len(a), -1)
            h[: len(src)] = h[src]  # fancy indexing copies first: overlapping rows are safe
        ids[: len(over)] = over
    return len(over), len(served.fill)


def _tightest(*limits):
    """The smallest of staging limits in bytes (None: no limit), None when none is set."""
    given = [m for m in limits if m is not None]
    return min(given) if given else None


def _largest(*limits):
    """The largest of staging limits in bytes, None (no limit) when any is None."""
    return None if any(m is None for m in limits) else max(limits)


def _row_ids(ids):
    """Neuron ids (numpy) of rows as an MLX int32 array, None stays None."""
    return None if ids is None else mx.array(np.asarray(ids, np.int32))


def check_mlp_shape(mlp, current: CurrentRows, roles, hidden: int, path: str):
    """FlashError unless `mlp` (projections already replaced) computes a per-neuron sum:
    no weights of its own, each projection called once, gate/up on the MLP input itself, and
    two halves of a random row set adding up to the whole (float32 probe, 4 neurons)."""
    unsupported = (f"{path}: unsupported MLP shape ({type(mlp).__name__}): mlx-flash runs "
                   f"down(act(up x)) or down(act(gate x) * up x) with an elementwise act")
    own = [k for k, _ in tree_flatten(mlp.parameters())]
    if own:
        raise FlashError(f"{unsupported}; it has weights of its own ({', '.join(own[:3])})")
    keys = mx.random.split(mx.random.key(0), len(roles) + 1)
    rows = {f"{r}.weight": mx.random.normal((4, hidden), key=keys[i])
            for i, r in enumerate(roles)}
    x = mx.random.normal((1, 1, hidden), key=keys[-1])
    saved = (current.quant, current.down_bias)
    current.quant, current.down_bias = {}, None
    recorder = _Recorder()
    try:
        recorder.install(mlp)
        whole = _eval_with(mlp, current, rows, 4, x)
        recorder.uninstall(mlp)
        if sorted(r for r, _ in recorder.calls) != sorted(roles) or \
                any(arg is not x for r, arg in recorder.calls if r != "down_t"):
            raise FlashError(f"{unsupported}; projections called: {[r for r, _ in recorder.calls]}")
        halves = [_eval_with(mlp, current, {k: v[s] for k, v in rows.items()}, 2, x)
                  for s in (slice(0, 2), slice(2, 4))]
        if not mx.allclose(whole, halves[0] + halves[1], rtol=1e-4, atol=1e-4).item():
            raise FlashError(f"{unsupported}; its output is not a sum over neurons")
    finally:
        recorder.uninstall(mlp)
        current.quant, current.down_bias = saved


class _Recorder:
    """Temporarily wraps an MLP's row projections to record (role, input) of each call."""

    def __init__(self):
        self.calls, self.saved = [], {}

    def install(self, mlp):
        for name, child in mlp.children().items():
            if isinstance(child, (RowProjection, RowDown)):
                self.saved[name] = child
                mlp[name] = _Recording(child, getattr(child, "role", "down_t"), self.calls)

    def uninstall(self, mlp):
        for name, child in self.saved.items():
            mlp[name] = child
        self.saved = {}


class _Recording(nn.Module):
    def __init__(self, inner, role, calls):
        super().__init__()
        self._inner, self._role, self._calls = inner, role, calls

    def __call__(self, x):
        self._calls.append((self._role, x))
        return self._inner(x)


def _eval_with(mlp, current, rows, n, x):
    current.set(rows, n)
    y = mlp(x)
    mx.eval(y)
    return y
