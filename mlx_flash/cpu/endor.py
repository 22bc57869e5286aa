"""The FFN of one token straight from ENDOR bundles on the CPU: decode-matvec, no decoded layer.

`endor_ffn_cpu` runs kernels/endor_ffn.cpp: each neuron bundle's gate / up rows and down column
(bitmap + packed float16 or bfloat16 non-zeros, mlx_flash/pack/bitmap.py) are expanded into a
scratch row that stays in the core's L1 cache and used at once, so the layer's decoded rows are
never written to memory and read back (decode-then-matvec writes 1.78x the encoded bytes at 50%
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


def takes(payload: dict, tokens: int) -> bool:
    """True when endor_ffn_cpu runs this: the kernel is built, one token, 16-bit float payloads."""
    return tokens == 1 and (payload or {}).get("dtype") in HALF_PAYLOADS and _extension() is not None


def bundle_layout(entry):
    """{"gated", "up_bias", "payload"} when endor_ffn_cpu takes this layer's bundles (an ENDOR
    layer of gate/up/down or up/down blocks of one float16 / bfloat16 payload, optionally the up
    row's bias stored raw after them, as OPT's), else None. entry: the layer's pack.Bundle."""
    if entry.encoding != "endor":
        return None
    names = [c.name for c in entry.components]
    payload = entry.components[0].endor or {}
    blocks = [c for c in entry.components if c.name.endswith(".weight")]
    if payload.get("dtype") not in HALF_PAYLOADS or any(c.endor != payload for c in blocks):
        return None
    if names == ["gate.weight", "up.weight", "down_t.weight"]:
        return {"gated": True, "up_bias": False, "payload": payload}
    if names == ["up.weight", "down_t.weight"]:
        return {"gated": False, "up_bias": False, "payload": payload}
    bias = entry.components[-1]
    if (names == ["up.weight", "down_t.weight", "up.bias"] and bias.endor is None
            and bias.dtype == payload["dtype"] and not bias.shape):
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
    if payload.get("dtype") not in HALF_PAYLOADS:
        raise ValueError(f"endor_ffn_cpu: payload {payload} (float16 / bfloat16 non-zeros only)")
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
                        2 if act == "relu" else 3, y, payload["dtype"] == "bfloat16", bool(up_bias), ACTS[act],
                        float(threshold), isa, parallel)
    if bad >= 0:
        raise FlashError(f"{where}: bundle {bad} (offset {int(offsets[bad])}): its bitmaps' popcount "
                         f"disagrees with the {int(offsets[bad + 1] - offsets[bad])} bytes stored "
                         f"(corrupt or truncated)")
    return mx.array(y).astype(x.dtype).reshape(*x.shape[:-1], down_columns)
