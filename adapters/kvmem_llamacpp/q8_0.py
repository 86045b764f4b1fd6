"""ggml's q8_0 rows in numpy: per 32 values a float16 scale ``d = amax / 127`` then 32 int8 codes (34 bytes).

The llama.cpp engine's 8-bit KV (``--kv-dtype q8_0``) keeps K and V rows in this format in its cache, its
state blobs and every KVMem tier, untouched. These helpers serve the few places that need values: the
scorers' content keys, and re-rotating K when a block moves to another position (compact mode).
"""

from __future__ import annotations

import numpy as np

from kvmem_core.layout import Q8_0_GROUP, Q8_0_GROUP_BYTES

_GROUP = np.dtype([("d", "<f2"), ("qs", "i1", (Q8_0_GROUP,))])
assert _GROUP.itemsize == Q8_0_GROUP_BYTES


def dequantize(raw: np.ndarray) -> np.ndarray:
    """uint8 [..., n / 32 * 34] -> float32 [..., n]."""
    groups = np.ascontiguousarray(raw).view(_GROUP)  # [..., n / 32]
    values = groups["qs"].astype(np.float32) * groups["d"].astype(np.float32)[..., None]
    return values.reshape(*raw.shape[:-1], -1)


def quantize(x: np.ndarray) -> np.ndarray:
    """float [..., n] (n a multiple of 32) -> uint8 [..., n / 32 * 34], as ggml's reference quantizer (rounding
    half away from zero)."""
    x = np.asarray(x, dtype=np.float32).reshape(*x.shape[:-1], -1, Q8_0_GROUP)
    d = np.abs(x).max(-1) / 127
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
    groups = np.empty(x.shape[:-1], dtype=_GROUP)
    groups["d"] = d
    scaled = x * inv[..., None]
    groups["qs"] = np.trunc(scaled + np.copysign(0.5, scaled))
    return groups.view(np.uint8).reshape(*x.shape[:-2], -1)
