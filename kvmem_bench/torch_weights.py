"""Random internal weights for a torch-engine model shape: benchmarks run a 27B shape without a checkpoint.

Only torch is needed; the weights are generated directly on the target device.
"""

from __future__ import annotations

import torch

from kvmem_torch import ATTENTION, ModelSpec


class _Maker:
    """Random matrices (normal, ``std``) and constant vectors in ``dtype`` on ``device``, from one seeded stream."""

    def __init__(self, dtype: torch.dtype, device: torch.device | str, seed: int, std: float) -> None:
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.dtype, self.device, self.std = dtype, device, std

    def mat(self, rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=self.gen, device=self.device, dtype=self.dtype) * self.std

    def ones(self, n: int, value: float = 1.0, dt: torch.dtype | None = None) -> torch.Tensor:
        return torch.full((n,), value, device=self.device, dtype=dt or self.dtype)


def random_weights(
    spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, seed: int = 0, std: float = 0.02
) -> dict[str, torch.Tensor]:
    """Random internal weights for ``spec`` generated on ``device`` (benchmarks; no checkpoint needed)."""
    make, s, h = _Maker(dtype, device, seed, std), spec, spec.hidden_size
    w = {"embed": make.mat(s.vocab_size, h), "norm": make.ones(h), "lm_head": make.mat(s.vocab_size, h)}
    for i, kind in enumerate(s.layer_kinds):
        w |= _layer(s, kind, f"layers.{i}.", make)
    return w


def random_mtp_weights(
    spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, seed: int = 1, std: float = 0.02
) -> dict[str, torch.Tensor]:
    """Random weights of a qwen35 MTP layer for ``spec`` (internal ``mtp.*`` names, ``kvmem_torch.mtp``): its
    drafts are as random as its weights, so only the cost of drafting can be measured with them."""
    make, h = _Maker(dtype, device, seed, std), spec.hidden_size
    w = {"mtp.fc": make.mat(h, 2 * h), "mtp.enorm": make.ones(h), "mtp.hnorm": make.ones(h), "mtp.norm": make.ones(h)}
    return w | _layer(spec, ATTENTION, "mtp.layers.0.", make)


def _layer(s: ModelSpec, kind: str, p: str, make: _Maker) -> dict[str, torch.Tensor]:
    """One decoder layer's random weights under prefix ``p``."""
    h, mat, ones = s.hidden_size, make.mat, make.ones
    w = {
        p + "attn_norm": ones(h),
        p + "mlp_norm": ones(h),
        p + "gate": mat(s.intermediate_size, h),
        p + "up": mat(s.intermediate_size, h),
        p + "down": mat(h, s.intermediate_size),
    }
    if kind == ATTENTION:
        q_rows = s.n_heads * s.head_dim * (2 if s.gated_attention else 1)
        w |= {
            p + "q": mat(q_rows, h),
            p + "k": mat(s.n_kv_heads * s.head_dim, h),
            p + "v": mat(s.n_kv_heads * s.head_dim, h),
            p + "o": mat(h, s.n_heads * s.head_dim),
        }
        if s.gated_attention:
            w |= {p + "q_norm": ones(s.head_dim), p + "k_norm": ones(s.head_dim)}
        return w
    vd = s.linear_v_heads * s.linear_v_dim
    return w | {
        p + "qkv": mat(s.conv_dim, h),
        p + "z": mat(vd, h),
        p + "b": mat(s.linear_v_heads, h),
        p + "a": mat(s.linear_v_heads, h),
        p + "out": mat(h, vd),
        p + "conv": mat(s.conv_dim, s.conv_kernel),
        p + "dt_bias": ones(s.linear_v_heads, 0.5, torch.float32),
        p + "ssm_a": ones(s.linear_v_heads, -1.0, torch.float32),
        p + "ssm_norm": ones(s.linear_v_dim),
    }
