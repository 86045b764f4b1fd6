"""Retrieval-heads scoring in one pass over the device index's keys: a Triton kernel per (layer, kv head).

``kvmem_core.retrieval.heads_score`` streams the keys through chunks of float32 logits
[rows, blocks, block tokens] on the device: widen the int8 keys, the product, the scales, the padding mask, the
block maxima, the exponentials and their sums each pass over a chunk's logits (tens of MB per 64K tokens). Here
one program reads a block's int8 keys and scales once, computes its logits for a tile of query rows in registers
and writes three numbers per (row, block): the largest logit, its offset and the exp-sum relative to it
(``heads_score.BlockStats``). The softmax over every token is then ``heads_score.block_mass`` on those
[rows, blocks] arrays, the same arithmetic the streaming path ends with, so the scores agree to float32
rounding (the product runs in IEEE float32; the scale is applied to the keys, as the numpy path does).

Used by ``scoring.TorchRetrievalHeads`` where ``FUSED`` is on, the keys are on a CUDA device and Triton is
importable (``TRITON_INTERPRET=1`` runs it on the CPU, which is how the unit tests check it). ``FUSED`` is off
until a GPU measures it against the streaming path (``kvmem_bench.torch_scoring``, ``speed_ab --feature scoring``).
"""

from __future__ import annotations

import numpy as np
import torch

from kvmem_core.retrieval.heads_score import BlockStats, HeadKeys, HeadMass, backend, block_mass, head_block_mass
from kvmem_torch.kernels import eligible, triton

ROW_TILE = 32  # query rows a program scores against its block (registers: tile x block tokens logits)
FUSED = False  # on: the engine scores through the kernel (off until its speed is measured on a GPU; A/B runs)

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _block_stats(
        rows_ptr,
        keys_ptr,
        scales_ptr,
        n_tokens_ptr,
        max_ptr,
        arg_ptr,
        sum_ptr,
        n_rows,
        n_blocks,
        DIM: tl.constexpr,
        WIDTH: tl.constexpr,
        TILE: tl.constexpr,
    ):
        block, tile = tl.program_id(0), tl.program_id(1)
        r = tile * TILE + tl.arange(0, TILE)
        t = tl.arange(0, WIDTH)
        d = tl.arange(0, DIM)
        q = tl.load(rows_ptr + r[:, None] * DIM + d[None, :], mask=r[:, None] < n_rows, other=0.0)
        base = block.to(tl.int64) * WIDTH
        k = tl.load(keys_ptr + (base + t[:, None]) * DIM + d[None, :]).to(tl.float32)
        k = k * tl.load(scales_ptr + base + t)[:, None]
        logits = tl.dot(q, tl.trans(k), input_precision="ieee")
        logits = tl.where(t[None, :] < tl.load(n_tokens_ptr + block), logits, float("-inf"))
        peak = tl.max(logits, axis=1)
        arg = tl.argmax(logits, axis=1)
        total = tl.sum(tl.exp(logits - peak[:, None]), axis=1)
        out = r.to(tl.int64) * n_blocks + block
        tl.store(max_ptr + out, peak, mask=r < n_rows)
        tl.store(arg_ptr + out, arg.to(tl.int64), mask=r < n_rows)
        tl.store(sum_ptr + out, total, mask=r < n_rows)


def usable(keys: HeadKeys) -> bool:
    """Whether the kernel can score ``keys``: int8 with scales, resident on a CUDA device (or under Triton's
    interpreter), power-of-two block width and dim of at least 16."""
    k = keys.keys
    resident = keys.device is None or torch.device(keys.device).type == k.device.type  # not pinned host keys
    return (
        FUSED
        and isinstance(k, torch.Tensor)
        and k.dtype == torch.int8
        and keys.scales is not None
        and resident
        and eligible(k.device, k.shape[1], k.shape[2])
    )


def block_stats(rows: torch.Tensor, keys: HeadKeys) -> BlockStats:
    """Per (row, block) of ``rows`` (float32 [R, dim], pre-scaled) against ``keys`` (``usable``): the largest
    logit, its offset and the exp-sum relative to it, each [R, blocks]."""
    k = keys.keys.contiguous()
    n_blocks, width, dim = k.shape
    n_rows = rows.shape[0]
    peak = torch.empty((n_rows, n_blocks), dtype=torch.float32, device=k.device)
    arg = torch.empty((n_rows, n_blocks), dtype=torch.int64, device=k.device)
    total = torch.empty((n_rows, n_blocks), dtype=torch.float32, device=k.device)
    if n_blocks:
        grid = (n_blocks, triton.cdiv(n_rows, ROW_TILE))
        _block_stats[grid](
            rows.contiguous(),
            k,
            keys.scales.contiguous().float(),
            keys.n_tokens.contiguous(),
            peak,
            arg,
            total,
            n_rows,
            n_blocks,
            DIM=dim,
            WIDTH=width,
            TILE=ROW_TILE,
        )
    return BlockStats(peak, arg, total)


def fused_block_mass(rows: np.ndarray, keys: HeadKeys, n_query_tokens: int) -> HeadMass:
    """``heads_score.head_block_mass``, through the kernel where ``usable(keys)``."""
    if not usable(keys):
        return head_block_mass(rows, keys, n_query_tokens)
    ops = backend(keys.keys)
    return block_mass(ops, block_stats(ops.rows(rows, keys), keys), n_query_tokens)
