"""The sparse FFN straight from ENDOR bundles on the GPU: decode-matvec Metal kernels and their twin.

An ENDOR neuron bundle (mlx_flash/pack/bitmap.py is the format) holds the neuron's gate row (gated
MLPs), up row and down column, each a bitmap of its non-zero positions plus the packed non-zeros
(float16 / bfloat16 / float32, or 4/8-bit codes with float16 scales and biases per group of stored
values). The kernels read the bundles as they were read from the file and never write decoded rows:

    endor_up(x, enc, bounds, ...)   h [M, count]: gate/up blocks decoded while multiplied by x,
                                    fused with the activation and threshold mask (as sparse_up);
                                    also down_at [count]: each bundle's down block (-1: bad bundle)
                                    and down_prefix [count, chunks + 1]: its values stored before
                                    each 1024-column chunk (so endor_down reads each bitmap once)
    endor_down(h, enc, down_at, down_prefix)  y [M, D] = sum_j h_j * down_j, down blocks decoded
                                    while added; rows with h_j == 0 are not read

Why decode-matvec and not a decode kernel: token generation on an Apple GPU is memory-bound (an M1
moves 68 GB/s and computes about 2.6 TFLOPS: ~75 flops per float16 weight read), and the few
integer operations per stored value (popcount, prefix sum, one shift) are far below that. Per
float16 weight at 50% sparsity a streamed row costs: decode kernel + matvec = read 0.5625 (bitmap
+ values) + write 1 (decoded row) + read 1 (matvec) = 2.56 units of dense bytes; decode-matvec =
read 0.5625. Rows are read once per token in naive / hybrid streaming, so the decode's write and
re-read would be pure overhead (4.6x the traffic). Rows the neuron cache keeps stay decoded there
(decoded once by the loader's CPU kernel, read every token as dense rows by sparse_up/sparse_down).

`enc` is a uint32 array of the bundles (each bundle starts on a 4-byte boundary, as in the file);
`bounds` int32 [count, 2] is each bundle's [start, end) in words. The twin (`endor_ffn_twin`)
decodes with MLX ops (bitmap unpack, cumsum prefix, gathers) and runs kernels.sparse_*_twin: it runs
everywhere and is what the kernels are tested against besides numpy.
"""

import mlx.core as mx

from . import kernels as K

FLOAT_FORMATS = {"float16": 0, "bfloat16": 1, "float32": 2}
DECODED_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
DOWN_SIMD_GROUPS = 4  # SIMD groups of endor_down's threadgroup (4 x 1024 float32 sums: 16 KiB)
DOWN_COLUMNS = 1024  # columns per endor_down threadgroup (32 lanes x one 32-bit bitmap word)


def payload_format(payload: dict) -> int:
    """The kernels' FMT of an ENDOR payload ({"dtype"} or {"bits", "group_size"})."""
    if payload.get("bits") is None:
        return FLOAT_FORMATS[payload["dtype"]]
    if payload["bits"] not in (4, 8):
        raise ValueError(f"ENDOR payload bits {payload['bits']}: the kernels take 4 or 8")
    return int(payload["bits"])


def decoded_dtype(payload: dict):
    """dtype of decoded rows: the float payload's own, float16 for quantized payloads."""
    return mx.float16 if payload.get("bits") else DECODED_DTYPES[payload["dtype"]]


def _group_size(payload: dict) -> int:
    return int(payload.get("group_size", 1)) if payload.get("bits") else 1


def word_bounds(byte_offsets) -> mx.array:
    """int32 [count, 2] word bounds from bundle byte offsets [count + 1] into `enc`
    (ValueError unless each is a multiple of 4)."""
    offsets = mx.array(byte_offsets).astype(mx.int64)
    if mx.any(offsets % 4 != 0).item():
        raise ValueError("ENDOR bundles must start on 4-byte boundaries of the encoded buffer")
    words = (offsets // 4).astype(mx.int32)
    return mx.stack([words[:-1], words[1:]], axis=1)


def _out_dtype(x_dtype, payload):
    return (mx.zeros((), x_dtype) + mx.zeros((), decoded_dtype(payload))).dtype


def endor_up_metal(x, enc, bounds, *, columns: int, down_columns: int, payload: dict, act="silu",
                   threshold=0.0, metal_kernel=None, **run):
    """(h [..., count], down_at int32 [count], down_prefix int32 [count, chunks + 1]) on the
    endor_up kernel (or through `metal_kernel`, e.g. the emulator, with `run` options).
    columns: K (x's width); down_columns: D; chunks = ceil(D / 1024)."""
    if act not in K.ACTS:
        raise ValueError(f"act {act!r}: expected one of {K.ACTS}")
    count = int(bounds.shape[0])
    out_dtype = _out_dtype(x.dtype, payload)
    lead = x.shape[:-1]
    chunks = -(-down_columns // DOWN_COLUMNS)
    if count == 0:
        return mx.zeros((*lead, 0), out_dtype), mx.zeros((0,), mx.int32), mx.zeros((0, chunks + 1), mx.int32)
    x2 = x.reshape(-1, columns)
    M = x2.shape[0]
    inputs = [x2, enc, bounds.astype(mx.int32).reshape(-1),
              K._params(count, columns, down_columns, _group_size(payload)),
              mx.full((K.SMALL,), threshold, mx.float32)]
    h, down_at, down_prefix = K.kernel("endor_up", metal_kernel)(
        inputs=inputs, template=[("T", out_dtype), ("FMT", payload_format(payload)), ("ACT", K.ACTS.index(act))],
        grid=(32 * count, M, 1), threadgroup=(32 * K.UP_ROWS_PER_THREADGROUP, 1, 1),
        output_shapes=[(M, count), (count,), (count, chunks + 1)], output_dtypes=[out_dtype, mx.int32, mx.int32],
        **run)
    return h.reshape(*lead, count), down_at, down_prefix


def endor_down_metal(h, enc, down_at, down_prefix, *, columns: int, payload: dict, metal_kernel=None, **run):
    """y [..., D] (D = columns) on the endor_down kernel (or through `metal_kernel`, with `run`);
    down_at, down_prefix: endor_up's."""
    count = int(down_at.shape[0])
    out_dtype = _out_dtype(h.dtype, payload)
    lead = h.shape[:-1]
    if count == 0:
        return mx.zeros((*lead, columns), out_dtype)
    M = h.size // count
    chunks = -(-columns // DOWN_COLUMNS)
    splits = max(1, min(-(-K.DOWN_TARGET_THREADGROUPS // chunks), count // (4 * DOWN_SIMD_GROUPS), 64))
    inputs = [h.reshape(M, count), enc, down_at, down_prefix.reshape(-1),
              K._params(count, columns, _group_size(payload), splits)]
    partial = K.kernel("endor_down", metal_kernel)(
        inputs=inputs, template=[("FMT", payload_format(payload)), ("NSG", DOWN_SIMD_GROUPS)],
        grid=(32 * chunks, DOWN_SIMD_GROUPS, M * splits), threadgroup=(32, DOWN_SIMD_GROUPS, 1),
        output_shapes=[(M, splits, columns)], output_dtypes=[mx.float32], **run)[0]
    return partial.sum(axis=1).astype(out_dtype).reshape(*lead, columns)


def endor_ffn_metal(x, enc, bounds, *, columns, down_columns, payload, act="silu", threshold=0.0,
                    metal_kernel=None, **run):
    """(y [..., D], ok bool [count]: bundles whose blocks add up to their length) on the kernels."""
    h, down_at, down_prefix = endor_up_metal(x, enc, bounds, columns=columns, down_columns=down_columns,
                                             payload=payload, act=act, threshold=threshold,
                                             metal_kernel=metal_kernel, **run)
    y = endor_down_metal(h, enc, down_at, down_prefix, columns=down_columns, payload=payload,
                         metal_kernel=metal_kernel, **run)
    return y, down_at >= 0


# ------------------------------------------------------------------------------------------------
# The twin: decode with MLX ops, then the sparse kernels' twins


def _words(nbytes):
    return (nbytes + 3) // 4


def _halves(enc, half_index):
    """uint16 [...] at half-word positions of enc (clamped into the buffer)."""
    last = enc.shape[0] - 1
    word = enc[mx.clip(half_index // 2, 0, last)]
    return ((word >> ((half_index % 2) * 16).astype(mx.uint32)) & 0xFFFF).astype(mx.uint16)


def decode_block_twin(enc, at, n: int, payload: dict):
    """(rows [count, n] decoded, next word [count]) of the blocks at words `at` (int64 [count])."""
    last = enc.shape[0] - 1
    index = mx.int32 if 2 * enc.shape[0] < 2**31 else mx.int64  # half-word positions must fit
    at = at.astype(index)
    nbw = -(-n // 32)
    words = enc[mx.clip(at[:, None] + mx.arange(nbw), 0, last)]
    bits = ((words[:, :, None] >> mx.arange(32, dtype=mx.uint32)) & 1).reshape(at.shape[0], nbw * 32)[:, :n]
    bits = bits.astype(index)
    nnz = bits.sum(axis=1)
    v = mx.cumsum(bits, axis=1) - bits  # index of each stored element among the stored values
    p = at + nbw
    fmt = payload_format(payload)
    if fmt in (0, 1):
        values = _halves(enc, p[:, None] * 2 + v).view(DECODED_DTYPES[payload["dtype"]])
        used = _words(nnz * 2)
    elif fmt == 2:
        values = enc[mx.clip(p[:, None] + v, 0, last)].view(mx.float32)
        used = nnz
    else:
        g = payload["group_size"]
        bit = v * fmt
        q = (enc[mx.clip(p[:, None] + bit // 32, 0, last)] >> (bit % 32).astype(mx.uint32)) & ((1 << fmt) - 1)
        groups = (nnz + g - 1) // g
        s = p + _words((nnz * fmt + 7) // 8)
        scales = _halves(enc, s[:, None] * 2 + v // g).view(mx.float16).astype(mx.float32)
        biases = _halves(enc, (s + _words(2 * groups))[:, None] * 2 + v // g).view(mx.float16).astype(mx.float32)
        values = (scales * q.astype(mx.float32) + biases).astype(mx.float16)
        used = _words((nnz * fmt + 7) // 8) + 2 * _words(2 * groups)
    rows = mx.where(bits.astype(mx.bool_), values, mx.zeros((), values.dtype))
    return rows, p + used


def decode_bundles_twin(enc, bounds, sizes, payload: dict):
    """([rows [count, n] per block], ok bool [count]) of bundles of blocks of `sizes` elements each
    (e.g. (K, K, D): gate, up, down); ok: the blocks end exactly at the bundle's end."""
    at = bounds[:, 0].astype(mx.int64)
    end = bounds[:, 1].astype(mx.int64)
    ok = mx.ones(at.shape, mx.bool_)
    out = []
    for n in sizes:
        rows, at = decode_block_twin(enc, at, n, payload)
        ok = ok & (at <= end)
        out.append(rows)
    return out, ok & (at == end)


def endor_ffn_twin(x, enc, bounds, *, columns, down_columns, payload, act="silu", threshold=0.0):
    """MLX-op twin of endor_ffn_metal: (y [..., D], ok bool [count]); bad bundles contribute 0."""
    count = int(bounds.shape[0])
    gated = act in K.GATED
    sizes = (columns, columns, down_columns) if gated else (columns, down_columns)
    if count == 0:
        return mx.zeros((*x.shape[:-1], down_columns), _out_dtype(x.dtype, payload)), mx.zeros((0,), mx.bool_)
    rows, ok = decode_bundles_twin(enc, bounds, sizes, payload)
    up = K.Weights(rows[-2])
    gate = K.Weights(rows[0]) if gated else None
    h = K.sparse_up_twin(x, up, gate, n=count, threshold=threshold, act=act)
    h = mx.where(ok, h, mx.zeros((), h.dtype))
    return K.sparse_down_twin(h, K.Weights(rows[-1]), n=count), ok


def endor_ffn(x, enc, bounds, *, columns, down_columns, payload, act="silu", threshold=0.0):
    """(y [..., D], ok bool [count]) for x [..., K] over ENDOR bundles: the Metal kernels when MLX
    runs on the GPU (MLX_FLASH_KERNELS != 0, up to 16 tokens), else the twin."""
    if K.metal_active() and x.dtype in K.HALF_DTYPES and x.size // max(1, x.shape[-1]) <= K.MAX_METAL_TOKENS:
        return endor_ffn_metal(x, enc, bounds, columns=columns, down_columns=down_columns, payload=payload,
                               act=act, threshold=threshold)
    return endor_ffn_twin(x, enc, bounds, columns=columns, down_columns=down_columns, payload=payload,
                          act=act, threshold=threshold)
