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
    inv = base ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)  # [n_rot/2]
    if factors is not None:
        inv = inv / factors
    theta = np.asarray(positions, dtype=np.float64)[:, None] * inv[None, :]  # [T, n_rot/2]
    return np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]  # [T, 1, n_rot/2]


def rotate(
    x: np.ndarray, positions: np.ndarray, *, n_rot: int, base: float, style: int, factors: np.ndarray | None = None
) -> np.ndarray:
    """Rotate ``x`` ``[..., T, heads, head_dim]`` by ``positions`` (negative values undo); float32 out.
    ``factors`` divide the frequencies (rope scaling), as llama.cpp's ``rope_freqs`` do."""
    cos, sin = _angles(positions, n_rot, base, factors)
    out = np.array(x, dtype=np.float32)
    rot = out[..., :n_rot]
    if style == NORM:
        a, b = rot[..., 0::2].copy(), rot[..., 1::2].copy()
        rot[..., 0::2] = a * cos - b * sin
        rot[..., 1::2] = a * sin + b * cos
    else:
        half = n_rot // 2
        a, b = rot[..., :half].copy(), rot[..., half:].copy()
        rot[..., :half] = a * cos - b * sin
        rot[..., half:] = a * sin + b * cos
    return out
