"""8-bit KV rows: float8 e4m3 codes with a float32 scale per token and kv head, packed in one byte row.

A head's row of ``hd`` values is stored as ``hd`` e4m3 codes followed by the 4 bytes of its scale
(``amax / 448``, e4m3's largest finite value), so one token's head is ``hd + 4`` bytes where 16-bit KV
takes ``2 * hd``. Scale and codes travel together: a block is the same contiguous bytes in the paged
cache, the pinned staging buffers, host RAM and its NVMe file, and every reader dequantizes as it
reads (``dequantize`` here, the decode kernel in ``kernels``).
"""

from __future__ import annotations

import torch

from kvmem_core.layout import FP8_SCALE_BYTES

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
CODES = torch.float8_e4m3fn


def row_bytes(head_dim: int) -> int:
    """Bytes of one token's one kv head."""
    return head_dim + FP8_SCALE_BYTES


def quantize(x: torch.Tensor) -> torch.Tensor:
    """x [..., hd] (any float dtype) -> packed uint8 [..., hd + 4]: codes of x / scale, then the scale."""
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: any scale decodes it
    codes = (x / scale).to(CODES).view(torch.uint8)
    return torch.cat([codes, scale.view(torch.uint8)], dim=-1)


def dequantize(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Packed uint8 [..., hd + 4] -> values [..., hd] in ``dtype`` (codes times scale in float32, then rounded)."""
    hd = packed.shape[-1] - FP8_SCALE_BYTES
    packed = packed.contiguous()
    codes = packed[..., :hd].view(CODES).float()
    scale = packed[..., hd:].view(torch.float32)
    return (codes * scale).to(dtype)
