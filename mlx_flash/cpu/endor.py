"""The FFN of one token straight from ENDOR bundles on the CPU: decode-matvec, no decoded layer.

`endor_ffn_cpu` runs kernels/endor_ffn.cpp: each neuron bundle's gate / up rows and down column
(bitmap + packed float16 / bfloat16 non-zeros, or their 8 / 4-bit codes dequantized first; the
format: mlx_flash/pack/bitmap.py) are expanded in registers (AVX-512) or into a scratch row that
stays in the core's L1 cache, and used at once, so the layer's decoded rows are never written to
memory and read back (decode-then-matvec writes 1.78x the encoded bytes at 50%
sparsity, then reads them again). Its MLX-op twin is mlx_flash.metal.endor.endor_ffn_twin (the
GPU's decode-matvec kernels compute the same thing). FlashFFN runs it for layers hybrid holds
encoded, one token at a time; prompts decode the rows and run the matvecs.
"""

import mlx.core as mx
import numpy as np

from ..errors import FlashError
from ..pack.bitmap import _extension as bitmap_extension

ACTS = {"silu": 0, "relu_gated": 1, "relu": 1}
HALF_PAYLOADS = ("float16", "bfloat16")


def _extension():
    """mlx_flash._ext when it has the decode-matvec kernel, else None."""
    ext = bitmap_extension()
    return ext if ext is not None and hasattr(ext, "endor_ffn") else None


def _kind(payload) -> int:
    """The kernel's kind (kernels/endor_decode.h) of a payload it takes, else 0."""
    payload = payload or {}
    if payload.get("bits") in (4, 8) and payload.get("group_size", 0) > 0:
        return 3 if payload["bits"] == 8 else 4
    return 1 if payload.get("dtype") in HALF_PAYLOADS else 0


def takes(payload: dict, tokens: int) -> bool:
    """True when endor_ffn_cpu runs this: the kernel is built, one token, a float16 / bfloat16 or
    8 / 4-bit payload."""
    return tokens == 1 and _kind(payload) > 0 and _extension() is not None


def bundle_layout(entry):
    """{"gated", "up_bias", "payload"} when endor_ffn_cpu takes this layer's bundles (an ENDOR
    layer of gate/up/down or up/down blocks of one payload it takes, optionally the up
    row's bias stored raw after them, as OPT's), else None. entry: the layer's pack.Bundle."""
    if entry.encoding != "endor":
        return None
    names = [c.name for c in entry.components]
    payload = entry.components[0].endor or {}
    blocks = [c for c in entry.components if c.name.endswith(".weight")]
    if not _kind(payload) or any(c.endor != payload for c in blocks):
        return None
    if names == ["gate.weight", "up.weight", "down_t.weight"]:
        return {"gated": True, "up_bias": False, "payload": payload}
    if names == ["up.weight", "down_t.weight"]:
        return {"gated": False, "up_bias": False, "payload": payload}
    bias = entry.components[-1]
    # the raw bias is read as float16, or bfloat16 beside bfloat16 non-zeros
    if (names == ["up.weight", "down_t.weight", "up.bias"] and bias.endor is None
            and bias.dtype == payload.get("dtype", "float16") and not bias.shape):
        return {"gated": False, "up_bias": True, "payload": payload}
    return None


def endor_ffn_cpu(x, words, offsets, *, columns: int, down_columns: int, payload: dict, act="silu",
                  threshold=0.0, up_bias=False, where="bundles", isa=None, parallel=True):
    """y [..., down_columns] (x's dtype) for one token x [..., columns] over ENDOR bundles held as
    stored: words (uint32 mx.array or uint8 numpy) holding bundle b at bytes offsets[b] ..
    offsets[b + 1] (int64 [count + 1]); act "silu" / "relu_gated" (gate, up, down blocks) or
    "relu" (up, down, then the up row's raw 16-bit bias when up_bias); activations not above
    `threshold` are masked (their down block not read).
    FlashError naming `where` and the first bundle whose blocks do not add up to its length."""
    ext = _extension()
    if ext is None:
        raise FlashError("endor_ffn_cpu: the CPU kernels (mlx_flash._ext) are not built")
    if act not in ACTS:
        raise ValueError(f"endor_ffn_cpu: act {act!r} (choose from {', '.join(ACTS)})")
    kind = _kind(payload)
    if not kind:
        raise ValueError(f"endor_ffn_cpu: payload {payload} (float16 / bfloat16 or 8 / 4-bit non-zeros)")
    if x.size != columns:
        raise ValueError(f"endor_ffn_cpu: one token of {columns} values, got shape {tuple(x.shape)}")
    if isinstance(words, np.ndarray):
        flat = words.reshape(-1).view(np.uint8)
    else:
        mx.eval(words)
        flat = np.frombuffer(memoryview(words).cast("B"), np.uint8)  # no copy of the bundles
    offsets = np.ascontiguousarray(offsets, np.int64)
    xf = np.array(x.astype(mx.float32).reshape(-1), np.float32)
    y = np.empty(down_columns, np.float32)
    bad = ext.endor_ffn(xf, flat, offsets[:-1], np.ascontiguousarray(np.diff(offsets)),
                        2 if act == "relu" else 3, y, payload.get("dtype") == "bfloat16", bool(up_bias), ACTS[act],
                        float(threshold), isa, parallel, kind, int(payload.get("group_size", 0)))
    if bad >= 0:
        raise FlashError(f"{where}: bundle {bad} (offset {int(offsets[bad])}): its bitmaps' popcount "
                         f"disagrees with the {int(offsets[bad + 1] - offsets[bad])} bytes stored "
                         f"(corrupt or truncated)")
    return mx.array(y).astype(x.dtype).reshape(*x.shape[:-1], down_columns)
