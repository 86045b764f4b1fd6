"""RoPE in llama.cpp's conventions, in numpy: undo it (content-frame keys) or shift it (compact mode).

``norm`` (rope type 0, Llama GGUFs) rotates adjacent pairs (2i, 2i+1); the converter
permuted the Q/K weight rows so that this equals HF's rotate-half on the original rows.
``neox`` (rope type 2) rotates halves (i, i + n_rot/2). Queries captured before RoPE and
keys un-rotated here share the same (permuted) row order, so their dot products are the
model's content-frame scores.
"""

from __future__ import annotations

import numpy as np

NORM, NEOX = 0, 2


def _angles(
    positions: np.ndarray, n_rot: int, base: float, factors: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [T, 1, n_rot/2] in float32: angles are formed in float64 (positions reach millions), the
    rotation itself runs in float32 (float64 factors would promote every product of it)."""
    inv = base ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)  # [n_rot/2]
    if factors is not None:
        inv = inv / factors
    theta = np.asarray(positions, dtype=np.float64)[:, None] * inv[None, :]  # [T, n_rot/2]
    return np.cos(theta).astype(np.float32)[:, None, :], np.sin(theta).astype(np.float32)[:, None, :]


def rotate(
    x: np.ndarray, positions: np.ndarray, *, n_rot: int, base: float, style: int, factors: np.ndarray | None = None
) -> np.ndarray:
    """Rotate ``x`` ``[..., T, heads, head_dim]`` by ``positions`` (negative values undo); a new float32 array,
    ``x`` is not written to. ``factors`` divide the frequencies (rope scaling), as llama.cpp's ``rope_freqs`` do."""
    cos, sin = _angles(positions, n_rot, base, factors)
    src = np.asarray(x, dtype=np.float32)
    out = np.array(src, copy=True) if n_rot < src.shape[-1] else np.empty_like(src)
    first, second = (slice(0, n_rot, 2), slice(1, n_rot, 2)) if style == NORM else _halves(n_rot)
    a, b, out_a, out_b = src[..., first], src[..., second], out[..., first], out[..., second]
    np.multiply(a, cos, out=out_a)
    out_a -= b * sin
    np.multiply(a, sin, out=out_b)
    out_b += b * cos
    return out


def _halves(n_rot: int) -> tuple[slice, slice]:
    return slice(0, n_rot // 2), slice(n_rot // 2, n_rot)
