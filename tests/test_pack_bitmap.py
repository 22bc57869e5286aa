"""ENDOR row blocks: numpy reference round trips, and the C++ kernel == reference bit for bit."""

import numpy as np
import pytest

from mlx_flash.cpu.ops import KERNEL_ISAS
from mlx_flash.pack import bitmap as eb
from mlx_flash.errors import FlashError

PAYLOADS = [{"dtype": "float16"}, {"dtype": "bfloat16"}, {"dtype": "float32"},
            {"bits": 8, "group_size": 64}, {"bits": 4, "group_size": 64}, {"bits": 4, "group_size": 32},
            {"bits": 8, "group_size": 128}]
NEEDS_KERNEL = pytest.mark.skipif(eb._extension() is None, reason="mlx_flash._ext not built")
BEST_ISA = eb._extension().best_isa() if eb._extension() is not None else "scalar"
RUNNABLE_ISAS = KERNEL_ISAS[: KERNEL_ISAS.index(BEST_ISA) + 1]
# Every kernel path, each forced by name; those this CPU lacks are skipped saying so.
ISAS = [pytest.param(isa, marks=pytest.mark.skipif(isa not in RUNNABLE_ISAS,
                                                   reason=f"this CPU lacks {isa} (best: {BEST_ISA})"))
        for isa in KERNEL_ISAS]


def _row(rng, n, density, payload):
    """A row of n values with about `density` non-zeros, in the payload's source dtype."""
    v = rng.standard_normal(n).astype(np.float32) * (rng.random(n) < density)
    v[v == 0] = 0  # +0: either sign of zero is left out and decodes as +0
    if payload.get("dtype") == "float32":
        return v
    if payload.get("dtype") == "bfloat16":
        return (v.view(np.uint32) >> 16).astype(np.uint16)
    return v.astype(np.float16)


def _dense(row, payload):
    """What decoding must give back for float payloads (the row itself)."""
    return row


@pytest.mark.parametrize("payload", PAYLOADS[:3], ids=lambda p: p["dtype"])
@pytest.mark.parametrize("n,density", [(1, 1.0), (7, 0.5), (64, 0.0), (64, 1.0), (576, 0.5), (1001, 0.3)])
def test_float_round_trip_is_exact(payload, n, density):
    rng = np.random.default_rng(n)
    row = _row(rng, n, density, payload)
    block = eb.encode_row(row, payload)
    nnz = int(np.count_nonzero(row.view(np.uint16) & 0x7FFF if row.dtype == np.uint16 else row))
    assert len(block) == eb.block_nbytes(n, nnz, payload)
    out, used = eb.decode_row(block, n, payload)
    assert used == len(block)
    np.testing.assert_array_equal(out.view(np.uint8), _dense(row, payload).view(np.uint8))


@pytest.mark.parametrize("payload", PAYLOADS[3:], ids=str)
def test_quantized_keeps_zeros_exact_and_values_close(payload):
    rng = np.random.default_rng(1)
    row = _row(rng, 1000, 0.5, {"dtype": "float16"})
    out, _ = eb.decode_row(eb.encode_row(row, payload), 1000, payload)
    assert np.all(out[row == 0] == 0) and not np.any(np.signbit(out[row == 0]))
    err = np.abs(out.astype(np.float32) - row.astype(np.float32))[row != 0]
    step = (np.ptp(row[row != 0]) / ((1 << payload["bits"]) - 1))
    assert err.max() <= step  # within one code step of the group's range (the whole row's)


def test_size_at_half_sparsity_matches_the_paper():
    n, nnz = 9216, 4608
    assert eb.block_nbytes(n, nnz, {"dtype": "float16"}) / (2 * n) == pytest.approx(0.5625)
    dense8 = n + 4 * n / 64  # 8-bit codes + float16 scale and bias per group of 64
    assert eb.block_nbytes(n, nnz, {"bits": 8, "group_size": 64}) / dense8 < 0.64


def test_truncated_and_inconsistent_bundles_are_named():
    rng = np.random.default_rng(2)
    p = {"dtype": "float16"}
    row = _row(rng, 64, 0.5, p)
    block = eb.encode_row(row, p)
    dest = np.zeros((1, 128), np.uint8)
    with pytest.raises(FlashError, match="layer_000.bin: bundle 0"):
        eb.decode_bundles(block[:-4], [0], [len(block) - 4], [0], [(dest, 64, p)], "layer_000.bin")
    with pytest.raises(FlashError, match="bundle 0"):
        eb.decode_bundles(_two_more(block, 64), [0], [len(block)], [0], [(dest, 64, p)], "f")
    with pytest.raises(FlashError, match="popcount"):  # a spare padding word: lengths disagree
        padded = np.concatenate([block, np.zeros(4, np.uint8)])
        eb.decode_bundles(padded, [0], [len(padded)], [0], [(dest, 64, p)], "f")


def _two_more(block, n):
    """The block with two more bitmap bits set: its payload would need 4 more bytes."""
    out = block.copy()
    bits = np.unpackbits(out[: (n + 7) // 8], bitorder="little")
    zero = np.flatnonzero(bits[:n] == 0)[:2]
    assert len(zero) == 2
    bits[zero] = 1
    out[: (n + 7) // 8] = np.packbits(bits, bitorder="little")
    return out


def _bundles(rng, count, roles_spec, density):
    """(flat buffer, starts, lengths, rows per role): `count` bundles of encoded rows (+ raw piece)."""
    blocks, rows = [], [[] for _ in roles_spec]
    for _ in range(count):
        parts = []
        for k, (n, payload) in enumerate(roles_spec):
            if payload is None:
                raw = rng.integers(0, 256, n, dtype=np.uint8)
                rows[k].append(raw)
                parts.append(np.concatenate([raw, np.zeros(eb.pad4(n) - n, np.uint8)]))
                continue
            d = density if density is not None else rng.random()
            r = _row(rng, n, d, payload if "dtype" in payload else {"dtype": "float16"})
            rows[k].append(r)
            parts.append(eb.encode_row(r, payload))
        blocks.append(np.concatenate(parts))
    lengths = np.array([len(b) for b in blocks], np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    flat = np.concatenate(blocks + [np.zeros(3, np.uint8)])  # no slack the kernel could rely on
    return flat, starts, lengths, rows


def _decode_both(flat, starts, lengths, slots, roles_spec, rows_out, isa):
    outs = []
    for use_kernel in (False, True):
        dests = []
        for n, payload in roles_spec:
            width = n if payload is None else n * (4 if payload.get("dtype") == "float32" else 2)
            dests.append(np.full((rows_out, width), 0xAB, np.uint8))
        eb.decode_into(flat, starts, lengths, slots,
                       [(d, n, p) for d, (n, p) in zip(dests, roles_spec)], "t", isa=isa,
                       use_kernel=use_kernel)
        outs.append(dests)
    return outs


@NEEDS_KERNEL
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("payload", PAYLOADS, ids=str)
@pytest.mark.parametrize("density", [0.0, 1.0, 0.5, None], ids=["zeros", "ones", "half", "ragged"])
def test_kernel_matches_reference_bit_for_bit(isa, payload, density):
    rng = np.random.default_rng(hash((isa, str(payload), density)) % 2**32)
    spec = [(576, payload), (3, None), (1001, payload), (13, payload)]
    flat, starts, lengths, _ = _bundles(rng, 9, spec, density)
    slots = rng.permutation(12)[:9]
    ref, ker = _decode_both(flat, starts, lengths, slots, spec, 12, isa)
    for a, b in zip(ref, ker):
        np.testing.assert_array_equal(a, b)


@NEEDS_KERNEL
@pytest.mark.parametrize("isa", ISAS)
def test_kernel_rejects_popcount_disagreement(isa):
    rng = np.random.default_rng(5)
    spec = [(64, {"dtype": "float16"})]
    flat, starts, lengths, _ = _bundles(rng, 3, spec, 0.5)
    dest = np.zeros((3, 128), np.uint8)
    bad = flat.copy()
    bad[starts[1]: starts[1] + 8] = _two_more(flat[starts[1]: starts[1] + 8], 64)
    with pytest.raises(FlashError, match="bundle 1"):
        eb.decode_into(bad, starts, lengths, np.arange(3), [(dest, 64, spec[0][1])], "t", isa=isa)
    short = lengths.copy()
    short[2] -= 4
    with pytest.raises(FlashError, match="bundle 2"):
        eb.decode_into(flat, starts, short, np.arange(3), [(dest, 64, spec[0][1])], "t", isa=isa)


@NEEDS_KERNEL
@pytest.mark.parametrize("isa", ISAS)
def test_kernel_crc32_is_zlibs(isa):
    import zlib

    rng = np.random.default_rng(9)
    for n in [0, 1, 15, 63, 64, 65, 127, 128, 129, 1000, 4099, 100003]:
        data = rng.integers(0, 256, n + 3, dtype=np.uint8)[3:]  # unaligned start
        assert eb._extension().endor_crc32(data, isa=isa) == zlib.crc32(data), n
        assert eb._extension().endor_crc32(data[n // 3:], zlib.crc32(data[: n // 3]), isa=isa) == zlib.crc32(data)


@pytest.mark.parametrize("use_kernel,isa", [pytest.param(False, None, id="reference")] +
                         [pytest.param(True, *p.values, marks=p.marks, id=p.values[0]) for p in ISAS])
def test_check_decode_rejects_the_first_bad_crc(use_kernel, isa):
    """Hundreds of bundles split over the thread pool: the earliest corrupt bundle is the one
    named, as a checksum mismatch (not a popcount one), whichever thread found which."""
    import zlib

    if use_kernel and eb._extension() is None:
        pytest.skip("mlx_flash._ext not built")
    rng = np.random.default_rng(11)
    spec = [(64, {"dtype": "float16"}), (40, {"bits": 4, "group_size": 8})]
    flat, starts, lengths, _ = _bundles(rng, 700, spec, 0.5)
    crcs = np.array([zlib.crc32(flat[s: s + n]) for s, n in zip(starts, lengths)], np.uint32)
    dests = [np.zeros((700, 128), np.uint8), np.zeros((700, 80), np.uint8)]
    roles = [(d, n, p) for d, (n, p) in zip(dests, spec)]
    eb.decode_into(flat, starts, lengths, np.arange(700), roles, "t", isa=isa, use_kernel=use_kernel,
                   crcs=crcs)
    bad = flat.copy()
    bad[starts[650] + 20] ^= 1
    bad[starts[333] + lengths[333] - 1] ^= 0x80  # a payload byte: only the crc32 can tell
    with pytest.raises(FlashError, match=r"t: checksum mismatch in bundle 333 \(offset"):
        eb.decode_into(bad, starts, lengths, np.arange(700), roles, "t", isa=isa,
                       use_kernel=use_kernel, crcs=crcs)
    eb.decode_into(bad, starts, lengths, np.arange(700), roles, "t", isa=isa, use_kernel=use_kernel)


hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies


@NEEDS_KERNEL
@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(n=st.integers(1, 300), density=st.floats(0, 1), payload=st.sampled_from(PAYLOADS),
                  seed=st.integers(0, 2**31), isa=st.sampled_from(RUNNABLE_ISAS))
def test_kernel_fuzz(n, density, payload, seed, isa):
    rng = np.random.default_rng(seed)
    spec = [(n, payload), (n + 7, payload)]
    flat, starts, lengths, _ = _bundles(rng, 3, spec, density)
    ref, ker = _decode_both(flat, starts, lengths, np.array([2, 0, 1]), spec, 3, isa)
    for a, b in zip(ref, ker):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("use_kernel,isa", [pytest.param(False, None, id="reference")] +
                         [pytest.param(True, *p.values, marks=p.marks, id=p.values[0]) for p in ISAS])
def test_check_crc32s_names_the_first_bad_bundle_without_decoding(use_kernel, isa):
    """The check-only pass (read_encoded's): every crc32 over the thread pool, the earliest
    mismatch named with its file offset; bundles longer than 512 bytes take the wide crc32 loops."""
    import zlib

    if use_kernel and eb._extension() is None:
        pytest.skip("mlx_flash._ext not built")
    rng = np.random.default_rng(13)
    lengths = rng.integers(0, 3000, 500).astype(np.int64)
    lengths[-1] = 2000
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    flat = rng.integers(0, 256, int(lengths.sum()) + 5, dtype=np.uint8)
    crcs = np.array([zlib.crc32(flat[s: s + n]) for s, n in zip(starts, lengths)], np.uint32)
    eb.check_crc32s(flat, starts, lengths, crcs, "t", isa=isa, use_kernel=use_kernel)
    bad = flat.copy()
    k = int(np.flatnonzero(lengths > 600)[300])
    bad[starts[k] + lengths[k] - 1] ^= 4
    bad[starts[-1] + lengths[-1] // 2] ^= 1
    with pytest.raises(FlashError, match=rf"^t: checksum mismatch in bundle {k} \(offset {starts[k] + 100}\)$"):
        eb.check_crc32s(bad, starts, lengths, crcs, "t", offsets=starts + 100, isa=isa, use_kernel=use_kernel)
    with pytest.raises(FlashError, match=r"bundle 499 \(offset \d+\) runs past the \d+ bytes held"):
        eb.check_crc32s(flat[: -lengths[-1]], starts, lengths, crcs, "t", isa=isa, use_kernel=use_kernel)
