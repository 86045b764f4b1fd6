"""Float64 reference for one decode token's attention over scattered paged-cache rows."""

from __future__ import annotations

import torch


def rope_angles(positions: torch.Tensor, rotary_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """NeoX angles [N, rotary_dim] in float64."""
    inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    ang = positions.double()[:, None] * inv[None, :].to(positions.device)
    return torch.cat([ang, ang], -1)


def decode_attention_f64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """softmax(q·R(angle)k/√d) v in float64: q [heads, hd] (rotated), k/v [n, kv, hd] pre-RoPE, angles [n, rd]."""
    q, k, v = q.double(), k.double(), v.double()
    rd, hd = angles.shape[1], q.shape[1]
    kr, kp = k[..., :rd], k[..., rd:]
    rotated = torch.cat([-kr[..., rd // 2 :], kr[..., : rd // 2]], -1)
    k = torch.cat([kr * angles.cos()[:, None] + rotated * angles.sin()[:, None], kp], -1)
    group = q.shape[0] // k.shape[1]
    return torch.stack(
        [torch.softmax(k[:, h // group] @ q[h] / hd**0.5, 0) @ v[:, h // group] for h in range(q.shape[0])]
    )


def gated_heads_model(dtype: torch.dtype, device: str = "cpu"):
    """A small random qwen35 whose attention has the 27B head shape (256 wide, rotary 64: the decode kernels
    serve it), with norm weights away from 1 so that every norm matters."""
    from kvmem_bench.torch_device import qwen35_spec
    from kvmem_torch.model import Model
    from kvmem_bench.torch_weights import random_weights

    spec = qwen35_spec("tiny")
    weights = random_weights(spec, dtype, device, 0, std=0.1)
    for name, t in weights.items():
        if "norm" in name:
            noise = torch.randn(t.shape, generator=torch.Generator().manual_seed(len(name)))
            t.add_(0.5 * noise.to(t.device, t.dtype))
    return Model(spec, weights)
