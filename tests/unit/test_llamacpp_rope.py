"""``kvmem_llamacpp.rope`` against float64 complex rotations (an independent formulation of RoPE)."""

from __future__ import annotations

import numpy as np
import pytest

from kvmem_llamacpp.rope import NEOX, NORM, rotate


def reference(x: np.ndarray, positions: np.ndarray, n_rot: int, base: float, style: int, factors=None) -> np.ndarray:
    """Each rotated pair as one complex number times e^(i * position * frequency), in float64."""
    x = x.astype(np.float64)
    freq = base ** (-np.arange(0, n_rot, 2) / n_rot) / (1.0 if factors is None else np.asarray(factors))
    turn = np.exp(1j * positions[:, None, None] * freq)  # [T, 1, n_rot/2]
    pairs = (
        x[..., 0:n_rot:2] + 1j * x[..., 1:n_rot:2]
        if style == NORM
        else x[..., : n_rot // 2] + 1j * x[..., n_rot // 2 : n_rot]
    )
    turned = pairs * turn
    out = x.copy()
    if style == NORM:
        out[..., 0:n_rot:2], out[..., 1:n_rot:2] = turned.real, turned.imag
    else:
        out[..., : n_rot // 2], out[..., n_rot // 2 : n_rot] = turned.real, turned.imag
    return out


@pytest.mark.parametrize("style", [NORM, NEOX])
@pytest.mark.parametrize("n_rot", [64, 32])
def test_rotation_matches_complex_float64(style: int, n_rot: int) -> None:
    rng = np.random.default_rng(n_rot + style)
    x = rng.normal(size=(3, 16, 2, 64)).astype(np.float16)  # [layers, tokens, kv heads, head dim]
    positions = rng.integers(-2_000_000, 2_000_000, size=16)
    factors = rng.uniform(1.0, 8.0, size=n_rot // 2)
    for f in (None, factors):
        got = rotate(x, positions, n_rot=n_rot, base=1e6, style=style, factors=f)
        assert got.dtype == np.float32 and got.shape == x.shape
        np.testing.assert_allclose(got, reference(x, positions, n_rot, 1e6, style, f), atol=2e-5)
    assert (got[..., n_rot:] == x[..., n_rot:]).all()  # rows past n_rot are carried, not rotated


def test_a_shift_then_its_inverse_returns_the_keys_and_the_input_is_not_written() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 8, 2, 64)).astype(np.float32)
    before = x.copy()
    shift = np.full(8, 123_457)
    there = rotate(x, shift, n_rot=64, base=1e4, style=NEOX)
    back = rotate(there, -shift, n_rot=64, base=1e4, style=NEOX)
    np.testing.assert_allclose(back, x, atol=1e-4)
    assert (x == before).all()
