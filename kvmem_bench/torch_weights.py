"""Random internal weights for a torch-engine model shape: benchmarks run a 27B shape without a checkpoint.

Only torch is needed; the weights are generated directly on the target device.
"""

from __future__ import annotations

import torch

from kvmem_torch import ATTENTION, ModelSpec


def random_weights(
    spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, seed: int = 0, std: float = 0.02
) -> dict[str, torch.Tensor]:
    """Random internal weights for ``spec`` generated on ``device`` (benchmarks; no checkpoint needed)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def mat(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen, device=device, dtype=dtype) * std

    def ones(n: int, value: float = 1.0, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.full((n,), value, device=device, dtype=dt)

    s, h = spec, spec.hidden_size
    w = {"embed": mat(s.vocab_size, h), "norm": ones(h), "lm_head": mat(s.vocab_size, h)}
    for i, kind in enumerate(s.layer_kinds):
        p = f"layers.{i}."
        w |= {
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
        else:
            vd = s.linear_v_heads * s.linear_v_dim
            w |= {
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
    return w
