"""The ENDOR encoding of one row: a bitmap of its non-zero positions plus the packed non-zeros.

The one implementation of the encoding: the pack writer encodes with it, the pack reader and the
loader decode with it (through the C++ kernel kernels/endor_decode.cpp, or this module's numpy
reference, its twin bit for bit). It lives in `pack` because it is on-disk format and the loader
(io) sits below the endor library; mlx_flash.endor re-exports it.

A row of `n` elements is stored as one *block*:

    bitmap   ceil(n / 8) bytes; bit j (LSB first) of byte b says element 8 b + j is stored
    payload  the stored elements, in row order, as either
               float  : nnz elements of the row's float dtype (float16, bfloat16, float32)
               quant  : nnz affine codes of `bits` (8: one byte each; 4: two per byte, low nibble
                        first), then ceil(nnz / group_size) float16 scales, then as many float16
                        biases: group k covers stored elements k*g .. k*g+g-1
and every piece is zero-padded to a multiple of 4 bytes (typed views stay aligned).

Why quantize only the non-zeros (scheme for 4/8-bit): the bitmap restores every pruned zero as an
exact 0 whatever the codes say, the groups' ranges are spent on the weights that survived pruning
(about half as many per byte of scales), and the 8-bit size at 50% is 0.62 of the dense 8-bit
matrix (0.5 codes + 0.03 scales + 0.125 bitmap per weight, vs 1.06). A per-group affine code with
an exactly representable zero would keep the zeros in the code stream (no byte saved on them).
Decoded value of code q in group k: float16(float32(scale_k) * q + float32(bias_k)); the product
is exact in float32 (an 11-bit scale times an 8-bit code), so the kernel and this reference agree
bit for bit whether or not a compiler fuses the multiply and the add.
"""

import numpy as np

from ..errors import FlashError

PAD = 4
FLOAT_PAYLOADS = {"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32}
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}


def pad4(n: int) -> int:
    return (n + PAD - 1) // PAD * PAD


def bitmap_nbytes(n: int) -> int:
    """Bytes of the bitmap of an n-element row (unpadded)."""
    return (n + 7) // 8


def payload_nbytes(nnz: int, payload: dict) -> int:
    """Padded bytes of the payload of `nnz` stored elements (payload: {"dtype"} or {"bits", "group_size"})."""
    bits = payload.get("bits")
    if bits is None:
        return pad4(nnz * ITEMSIZE[payload["dtype"]])
    groups = -(-nnz // payload["group_size"])
    return pad4((nnz * bits + 7) // 8) + 2 * pad4(2 * groups)


def block_nbytes(n: int, nnz: int, payload: dict) -> int:
    """Bytes of one encoded row block: padded bitmap + padded payload."""
    return pad4(bitmap_nbytes(n)) + payload_nbytes(nnz, payload)


def quantize_values(values: np.ndarray, bits: int, group_size: int):
    """(codes uint8 [nnz], scales float16 [groups], biases float16 [groups]) of a packed value vector.

    Affine per group of `group_size` stored values: bias = min, scale = (max - min) / (2^bits - 1),
    both rounded to float16 first; codes = round((v - bias) / scale) clipped to the code range."""
    v = np.asarray(values, np.float32).reshape(-1)
    groups = -(-len(v) // group_size)
    padded = np.zeros(groups * group_size, np.float32)
    padded[: len(v)] = v
    if len(v) % group_size:  # the last group's pad repeats its last value: it does not widen the range
        padded[len(v):] = v[-1]
    g = padded.reshape(groups, group_size)
    lo, hi = g.min(axis=1), g.max(axis=1)
    levels = (1 << bits) - 1
    scales = ((hi - lo) / levels).astype(np.float16)
    biases = lo.astype(np.float16)
    s32 = scales.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(s32 > 0, np.rint((g - biases.astype(np.float32)[:, None]) / s32), 0)
    codes = np.clip(q, 0, levels).astype(np.uint8).reshape(-1)[: len(v)]
    return codes, scales, biases


def dequantize_values(codes: np.ndarray, scales: np.ndarray, biases: np.ndarray, group_size: int):
    """float16 [nnz] values of codes (the decode rule of the module docstring)."""
    k = np.arange(len(codes)) // group_size
    prod = scales.astype(np.float32)[k] * codes.astype(np.float32)
    return (prod + biases.astype(np.float32)[k]).astype(np.float16)


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    if bits == 8:
        return codes.astype(np.uint8)
    c = np.zeros(len(codes) + (len(codes) & 1), np.uint8)
    c[: len(codes)] = codes
    return (c[0::2] | (c[1::2] << 4)).astype(np.uint8)


def unpack_codes(raw: np.ndarray, nnz: int, bits: int) -> np.ndarray:
    if bits == 8:
        return raw[:nnz]
    out = np.empty(2 * len(raw), np.uint8)
    out[0::2], out[1::2] = raw & 15, raw >> 4
    return out[:nnz]


def _padded(b: np.ndarray) -> np.ndarray:
    b = np.ascontiguousarray(b).view(np.uint8).reshape(-1)
    return np.concatenate([b, np.zeros(pad4(len(b)) - len(b), np.uint8)]) if len(b) % PAD else b


def encode_row(row: np.ndarray, payload: dict) -> np.ndarray:
    """uint8 block of one row (numpy float16 / float32, or uint16 holding bfloat16 bits).

    Positions whose value is exactly zero (either sign) are not stored; a quantized payload
    quantizes the stored values (payload {"bits", "group_size"})."""
    row = np.ascontiguousarray(row).reshape(-1)
    as_float = row.view(np.float32) if row.dtype == np.float32 else row
    if row.dtype == np.uint16:  # bfloat16 bits: zero is 0x0000 or 0x8000
        mask = (row & 0x7FFF) != 0
    else:
        mask = as_float != 0
    bitmap = np.packbits(mask, bitorder="little")
    values = row[mask]
    bits = payload.get("bits")
    if bits is None:
        pieces = [bitmap, values]
    else:
        if row.dtype == np.uint16:
            values = (values.astype(np.uint32) << 16).view(np.float32)
        codes, scales, biases = quantize_values(values, bits, payload["group_size"])
        pieces = [bitmap, pack_codes(codes, bits), scales, biases]
    return np.concatenate([_padded(p) for p in pieces])


def decode_row(block: np.ndarray, n: int, payload: dict, where: str = "block"):
    """(row values [n], bytes consumed) of a block at the start of `block` (uint8).

    float payloads come back in their own dtype (bfloat16 as uint16 bits), quant ones as float16.
    FlashError naming `where` when the block is shorter than its bitmap says."""
    block = np.asarray(block, np.uint8).reshape(-1)
    nb = bitmap_nbytes(n)
    if len(block) < pad4(nb):
        raise FlashError(f"{where}: truncated ENDOR block (bitmap cut short)")
    mask = np.unpackbits(block[:nb], bitorder="little", count=n).astype(bool)
    nnz = int(mask.sum())
    length = block_nbytes(n, nnz, payload)
    if len(block) < length:
        raise FlashError(f"{where}: its bitmap's popcount ({nnz} non-zeros) needs {length} bytes, "
                         f"{len(block)} stored (corrupt or truncated)")
    pos = pad4(nb)
    bits = payload.get("bits")
    if bits is None:
        dt = np.dtype(FLOAT_PAYLOADS[payload["dtype"]])
        values = block[pos: pos + nnz * dt.itemsize].view(dt)
        out = np.zeros(n, dt)
    else:
        g = payload["group_size"]
        groups = -(-nnz // g)
        nc = pad4((nnz * bits + 7) // 8)
        codes = unpack_codes(block[pos: pos + (nnz * bits + 7) // 8], nnz, bits)
        s0 = pos + nc
        scales = block[s0: s0 + 2 * groups].view(np.float16)
        b0 = s0 + pad4(2 * groups)
        biases = block[b0: b0 + 2 * groups].view(np.float16)
        values = dequantize_values(codes, scales, biases, g)
        out = np.zeros(n, np.float16)
    out[mask] = values
    return out, length


def encode_rows(mat: np.ndarray, payload: dict) -> list:
    """[uint8 block] of every row of a 2-D array."""
    return [encode_row(r, payload) for r in mat]


def decode_rows(blocks, n: int, payload: dict) -> np.ndarray:
    """[rows, n] array from row blocks (inverse of `encode_rows`)."""
    return np.stack([decode_row(b, n, payload)[0] for b in blocks])


def decode_bundles(flat: np.ndarray, starts, lengths, slots, roles, where: str = "bundles", ids=None):
    """Reference of the kernel's batch decode: bundle b = concatenated blocks of `roles`, in order.

    flat: uint8 buffer holding the bundles; starts/lengths: each bundle's offset and bytes in it;
    slots: destination row of each bundle; roles: [(dest uint8 matrix [rows, row bytes], n, payload)]
    where payload None means a raw (not encoded) piece of `row bytes` padded to 4.
    FlashError naming `where` and the bundle (ids[b] when given) when its blocks do not add up to
    its length."""
    for k, (s, length, slot) in enumerate(zip(starts, lengths, slots)):
        b = k if ids is None else int(ids[k])
        pos = int(s)
        end = pos + int(length)
        for dest, n, payload in roles:
            if payload is None:
                k = dest.shape[1]
                if pos + k > end:
                    raise FlashError(f"{where}: bundle {b} truncated")
                dest[slot] = flat[pos: pos + k]
                pos += pad4(k)
                continue
            row, used = decode_row(flat[pos: end], n, payload, f"{where}: bundle {b}")
            dest[slot] = row.view(np.uint8)
            pos += used
        if pos != end:
            raise FlashError(f"{where}: bundle {b}: its bitmaps account for {pos - int(s)} bytes, "
                             f"the bundle holds {int(length)} (popcount disagrees with the stored "
                             f"non-zeros)")


def payload_kind(payload) -> int:
    """The kernel's kind code (kernels/endor_decode.h) of a payload (None: raw piece)."""
    if payload is None:
        return 0
    if payload.get("bits") is None:
        return 2 if payload["dtype"] == "float32" else 1
    return 3 if payload["bits"] == 8 else 4


def _extension():
    """mlx_flash._ext when it has the check + decode kernel (imported by name: the compiled
    extension sits outside the package layers), else None."""
    import importlib

    try:
        ext = importlib.import_module("mlx_flash._ext")
    except ImportError:
        return None
    return ext if hasattr(ext, "endor_check_decode") else None


def decode_into(flat: np.ndarray, starts, lengths, slots, roles, where: str = "bundles", isa=None,
                use_kernel=True, ids=None, offsets=None, crcs=None, parallel=True):
    """Check and decode bundles into their destination rows with the C++ kernel, one pass over the
    kernels' thread pool with the GIL released (numpy reference when the extension is missing or
    use_kernel=False); arguments as `decode_bundles`, plus crcs: the expected zlib crc32 of each
    bundle's bytes (checked before its decode) or None. FlashError naming `where` and the bundle
    (ids[b] at file offset offsets[b] when given) on a crc32 mismatch or a popcount / length
    disagreement. isa: the kernels' instruction set for this call ("scalar", "avx2", "avx512"; None:
    the active one, see MLX_FLASH_ISA)."""
    ext = _extension() if use_kernel else None
    starts = np.ascontiguousarray(starts, np.int64)
    lengths = np.ascontiguousarray(lengths, np.int64)

    def named(b):
        return _bundle_name(b, starts, ids, offsets)

    if ext is None:
        if crcs is not None:
            check_crc32s(flat, starts, lengths, crcs, where, offsets, use_kernel=False, ids=ids)
        return decode_bundles(flat, starts, lengths, slots, roles, where, ids)
    slots = np.ascontiguousarray(slots, np.int64)
    if crcs is not None:
        crcs = np.ascontiguousarray(crcs, np.uint32)
    spec = [(dest, int(n), payload_kind(p), int((p or {}).get("group_size", 0)))
            for dest, n, p in roles]
    bad, fault = ext.endor_check_decode(flat, starts, lengths, slots, spec, crcs, isa, parallel)
    if bad >= 0 and fault == 1:
        raise FlashError(f"{where}: checksum mismatch in {named(bad)}")
    if bad >= 0:
        raise FlashError(f"{where}: {named(bad)}: its bitmaps' popcount disagrees with the "
                         f"{int(lengths[bad])} bytes stored (corrupt or truncated)")


def _bundle_name(b: int, starts, ids=None, offsets=None) -> str:
    """How an error names bundle b of a batch: its id (ids[b], else b) and file offset (offsets[b],
    else its start in the buffer)."""
    name = b if ids is None else int(ids[b])
    return f"bundle {name} (offset {int((starts if offsets is None else offsets)[b])})"


def check_crc32s(flat: np.ndarray, starts, lengths, crcs, where: str = "bundles", offsets=None, isa=None,
                 use_kernel=True, ids=None):
    """Check the zlib crc32 of bundles flat[starts[b]: starts[b] + lengths[b]] against crcs[b]
    without decoding them: one C++ pass over the kernels' thread pool with the GIL released (zlib
    in a Python loop when the extension is missing or use_kernel=False). FlashError naming `where`
    and the first bad bundle (ids[b] at file offset offsets[b] when given); isa as in `decode_into`."""
    ext = _extension() if use_kernel else None
    starts = np.ascontiguousarray(starts, np.int64)
    lengths = np.ascontiguousarray(lengths, np.int64)
    crcs = np.ascontiguousarray(crcs, np.uint32)
    if ext is None:
        import zlib

        outside = (starts < 0) | (lengths < 0) | (starts + lengths > len(flat))
        bad = next((b for b, (s, n) in enumerate(zip(starts.tolist(), lengths.tolist()))
                    if outside[b] or zlib.crc32(flat[s: s + n]) != int(crcs[b])), -1)
        fault = 2 if bad >= 0 and outside[bad] else 1
    else:
        bad, fault = ext.endor_check_crc32(flat, starts, lengths, crcs, isa)
    if bad >= 0:
        name = _bundle_name(bad, starts, ids, offsets)
        if fault == 2:
            raise FlashError(f"{where}: {name} runs past the {len(flat)} bytes held (truncated)")
        raise FlashError(f"{where}: checksum mismatch in {name}")
