"""`bench kernels --metal`: the sparse FFN on the Metal kernels vs MLX's gather + matmul, on a Mac.

One FFN call of a 7B-shaped layer (hidden 4096, 11008 neurons, one token): up/gate with SiLU and
the threshold mask, then down, over 10-50% of the neurons, selected two ways: the first n rows of a
neuron cache (`n`) and gathered row ids (`ids`, sorted random rows). Ours: mlx_flash.metal.kernels'
sparse_up_metal + sparse_down_metal (the selected rows are read in place). MLX's: the MLX-op twins,
i.e. w[rows] gathers + mx.quantized_matmul / matmul. Both run on the GPU, alternated, each timed as
the median of --metal-repeats evaluations after a warm-up; the outputs are compared first.
Target: ours at least 2x faster at 10-50% of rows. Elsewhere it prints that it needs a Mac.

ENDOR rows: one whole streamed ENDOR layer of the same shape (50% of each row's weights pruned,
float16 or 4-bit payloads): ours = mlx_flash.metal.endor's decode-matvec kernels on the bundles as
stored; against (a) the MLX-op twin (decode by bitmap unpack + cumsum + gathers, then gather +
matmul) and (b) today's CPU path's GPU half: the sparse kernels on rows already decoded (the CPU
decode's own time, kernels/endor_decode.cpp, printed beside it).

MoE row: the expert cache's call, mx.gather_qmm over 8 of 32 slots of a 4-bit OLMoE-shaped bank,
against mx.quantized_matmul over the same experts stacked beforehand (the bytes-read floor): a
ratio near 1 backs docs/metal.md's finding that gather_qmm needs no kernel of ours.
"""

import platform
import time

HIDDEN, NEURONS = 4096, 11008
FRACTIONS = (0.10, 0.25, 0.50)
KINDS = ("q4g64", "f16")
TARGET_SPEEDUP = 2.0


def _weights(kind, rows, cols, seed):
    import mlx.core as mx

    from ..metal.kernels import Weights

    w = (mx.random.normal((rows, cols), key=mx.random.key(seed)) * 0.02).astype(mx.float16)
    if kind == "f16":
        return Weights(w)
    q, s, b = mx.quantize(w, group_size=64, bits=4)
    return Weights(q, s, b, bits=4, group_size=64)


def _median_ms(fn, repeats):
    import mlx.core as mx

    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


def run_metal(args):
    """Prints the table (or that a Mac is needed); returns the exit code."""
    import mlx.core as mx
    import numpy as np

    from ..metal import kernels as K

    if not (platform.system() == "Darwin" and mx.metal.is_available()):
        print("bench kernels --metal: needs a Mac (Apple Silicon GPU); nothing measured on "
              f"{platform.system()} {platform.machine()}")
        return 0
    mx.set_default_device(mx.gpu)
    repeats = args.metal_repeats
    print(f"machine: {platform.platform()} ({platform.machine()}), mlx {mx.__version__}, Metal device "
          f"{mx.metal.device_info().get('device_name', '?')}")
    print(f"one FFN call, hidden {HIDDEN}, {NEURONS} neurons, 1 token; median of {repeats} runs each\n")
    print(f"{'kind':6} {'rows':>5} {'select':6} {'MLX ms':>8} {'ours ms':>8} {'speedup':>8} {'max diff':>9}")
    rows_out, met = [], 0
    for kind in KINDS:
        up, gate, down = (_weights(kind, NEURONS, HIDDEN, s) for s in (1, 2, 3))
        x = mx.random.normal((1, HIDDEN), key=mx.random.key(4)).astype(mx.float16)
        for frac in FRACTIONS:
            count = int(NEURONS * frac)
            ids = np.sort(np.random.default_rng(0).choice(NEURONS, count, replace=False)).astype(np.int32)
            for select, sel in (("n", dict(n=count)), ("ids", dict(rows=mx.array(ids)))):
                def ours():
                    h = K.sparse_up_metal(x, up, gate, threshold=0.0, **sel)
                    return K.sparse_down_metal(h, down, **sel)

                def theirs():
                    h = K.sparse_up_twin(x, up, gate, threshold=0.0, **sel)
                    return K.sparse_down_twin(h, down, **sel)

                diff = float(mx.abs(ours().astype(mx.float32) - theirs().astype(mx.float32)).max())
                for _ in range(3):  # warm-up: kernel builds, buffers
                    mx.eval(ours(), theirs())
                ours_ms, mlx_ms = [], []
                for _ in range(3):  # alternate, so both see the same conditions
                    ours_ms.append(_median_ms(ours, repeats))
                    mlx_ms.append(_median_ms(theirs, repeats))
                o, m = min(ours_ms), min(mlx_ms)
                met += m / o >= TARGET_SPEEDUP
                rows_out.append((kind, frac, select, m, o))
                print(f"{kind:6} {frac:>5.0%} {select:6} {m:>8.3f} {o:>8.3f} {m / o:>7.2f}x {diff:>9.2g}", flush=True)
    print(f"\n{met}/{len(rows_out)} cases at >= {TARGET_SPEEDUP:.0f}x MLX's gather + matmul")
    _run_endor(repeats)
    _run_moe(repeats)
    print(f"command: {args.command_line}")
    return 0


ENDOR_KINDS = {"f16": {"dtype": "float16"}, "q4g64": {"bits": 4, "group_size": 64}}


def endor_layer(payload, neurons, hidden, seed=0, sparsity=0.5):
    """(enc uint32 mx.array, byte offsets [neurons + 1], flat uint8 numpy, decoded mx rows (gate,
    up, down_t) float16) of a random pruned gated layer encoded by pack/bitmap.py."""
    import mlx.core as mx
    import numpy as np

    from ..pack import bitmap

    rng = np.random.default_rng(seed)
    mats = []
    for _ in range(3):
        w = (rng.normal(size=(neurons, hidden)) * 0.02).astype(np.float16)
        w[rng.random((neurons, hidden)) < sparsity] = 0
        mats.append(w)
    blocks = [np.concatenate([bitmap.encode_row(m[j], payload) for m in mats]) for j in range(neurons)]
    offsets = np.concatenate([[0], np.cumsum([len(b) for b in blocks])]).astype(np.int64)
    flat = np.concatenate(blocks)
    dests = [np.zeros((neurons, 2 * hidden), np.uint8) for _ in mats]
    bitmap.decode_into(flat, offsets[:-1], np.diff(offsets), np.arange(neurons),
                       [(d, hidden, payload) for d in dests])
    rows = [mx.array(d).view(mx.float16) for d in dests]
    return mx.array(flat.view(np.uint32)), offsets, flat, rows


def endor_calls(payload, neurons, hidden, metal_kernel=None, **run):
    """{name: callable} of one whole-layer ENDOR FFN call: "ours" (decode-matvec kernels), "twin"
    (MLX-op decode + gather/matmul), "decoded" (the sparse kernels over decoded rows), and
    "cpu decode" (kernels/endor_decode.cpp into the rows), plus the layer."""
    import mlx.core as mx
    import numpy as np

    from ..metal import endor as E
    from ..metal import kernels as K
    from ..pack import bitmap

    enc, offsets, flat, rows = endor_layer(payload, neurons, hidden)
    bounds = E.word_bounds(offsets)
    x = mx.random.normal((1, hidden), key=mx.random.key(4)).astype(mx.float16)
    kw = dict(columns=hidden, down_columns=hidden, payload=payload, threshold=0.0)
    dests = [np.zeros((neurons, 2 * hidden), np.uint8) for _ in range(3)]

    def decoded():
        h = K.sparse_up_metal(x, K.Weights(rows[1]), K.Weights(rows[0]), n=neurons, metal_kernel=metal_kernel,
                              **run)
        return K.sparse_down_metal(h, K.Weights(rows[2]), n=neurons, metal_kernel=metal_kernel, **run)

    def cpu_decode():  # returns an empty array: the work is done when it returns
        bitmap.decode_into(flat, offsets[:-1], np.diff(offsets), np.arange(neurons),
                           [(d, hidden, payload) for d in dests])
        return mx.zeros((0,))

    return {
        "ours": lambda: E.endor_ffn_metal(x, enc, bounds, metal_kernel=metal_kernel, **kw, **run)[0],
        "twin": lambda: E.endor_ffn_twin(x, enc, bounds, **kw)[0],
        "decoded": decoded,
        "cpu decode": cpu_decode,
    }


def _run_endor(repeats):
    import mlx.core as mx

    print(f"\nENDOR layer streamed whole (50% pruned), hidden {HIDDEN}, {NEURONS} neurons, 1 token; "
          f"median of {repeats} runs")
    print(f"{'kind':6} {'twin ms':>8} {'decoded':>8} {'cpu dec':>8} {'ours ms':>8} {'vs twin':>8} "
          f"{'vs cpu+dec':>10} {'max diff':>9}")
    for kind, payload in ENDOR_KINDS.items():
        calls = endor_calls(payload, NEURONS, HIDDEN)
        diff = float(mx.abs(calls["ours"]().astype(mx.float32) - calls["twin"]().astype(mx.float32)).max())
        for _ in range(3):
            mx.eval(calls["ours"](), calls["twin"](), calls["decoded"]())
        best = {name: float("inf") for name in calls}
        for _ in range(3):  # alternated, so all see the same conditions
            for name, fn in calls.items():
                best[name] = min(best[name], _median_ms(fn, repeats))
        o = best["ours"]
        print(f"{kind:6} {best['twin']:>8.3f} {best['decoded']:>8.3f} {best['cpu decode']:>8.3f} {o:>8.3f} "
              f"{best['twin'] / o:>7.2f}x {(best['cpu decode'] + best['decoded']) / o:>9.2f}x {diff:>9.2g}",
              flush=True)


MOE_SHAPE = dict(slots=32, top_k=8, hidden=2048, inter=1024)  # OLMoE-1B-7B's expert shape


def moe_calls(slots=32, top_k=8, hidden=2048, inter=1024, seed=0):
    """{"bank": gather_qmm over top_k slots of a [slots, inter, hidden] 4-bit bank (the expert
    cache's call), "stacked": quantized_matmul over the same experts stacked contiguously
    beforehand (the bytes-read floor)} for one token's up projection."""
    import mlx.core as mx
    import numpy as np

    w = (mx.random.normal((slots, inter, hidden), key=mx.random.key(seed)) * 0.02).astype(mx.float16)
    bank, scales, biases = mx.quantize(w, group_size=64, bits=4)
    picked = mx.array(np.sort(np.random.default_rng(seed).choice(slots, top_k, replace=False)).astype(np.uint32))
    stacked = [a[picked] for a in (bank, scales, biases)]
    mx.eval(bank, scales, biases, *stacked)
    x = mx.random.normal((top_k, 1, hidden), key=mx.random.key(seed + 1)).astype(mx.float16)
    q = dict(transpose=True, group_size=64, bits=4)
    return {
        "bank": lambda: mx.gather_qmm(x, bank, scales, biases, rhs_indices=picked, **q),
        "stacked": lambda: mx.quantized_matmul(x, *stacked, **q),
    }


def _run_moe(repeats):
    import mlx.core as mx

    shape = MOE_SHAPE
    print(f"\nMoE expert cache: one token's up projection over {shape['top_k']} of {shape['slots']} bank "
          f"slots ({shape['hidden']} -> {shape['inter']}, 4-bit g64); median of {repeats} runs")
    calls = moe_calls(**shape)
    diff = float(mx.abs(calls["bank"]() - calls["stacked"]()).max())
    for _ in range(3):
        mx.eval(calls["bank"](), calls["stacked"]())
    best = {name: float("inf") for name in calls}
    for _ in range(3):
        for name, fn in calls.items():
            best[name] = min(best[name], _median_ms(fn, repeats))
    print(f"gather_qmm on the bank {best['bank']:.3f} ms, quantized_matmul on pre-stacked experts "
          f"{best['stacked']:.3f} ms: ratio {best['bank'] / best['stacked']:.2f} (near 1: gather_qmm is "
          f"enough); max diff {diff:.2g}")
