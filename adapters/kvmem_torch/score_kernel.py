"""Retrieval-heads scoring in one pass over the device index's keys: a Triton kernel per (layer, kv head).

``kvmem_core.retrieval.heads_score`` streams the keys through chunks of float32 logits
[rows, blocks, block tokens] on the device: widen the int8 keys, the product, the scales, the padding mask, the
block maxima, the exponentials and their sums each pass over a chunk's logits (tens of MB per 64K tokens). Here
one program takes a tile of query rows and a group of blocks; per block it reads the int8 keys and scales once,
multiplies on tensor cores (each row as its fp16 value plus the fp16 remainder, int8 keys exact in fp16, float32
accumulation: within ~2^-22 of float32 rows) and writes three numbers per (row, block): the largest logit, its
offset and the exp-sum relative to it (``heads_score.BlockStats``). The softmax over every token is then
``heads_score.block_mass`` on those [rows, blocks] arrays, the same arithmetic the streaming path ends with.

Used by ``scoring.TorchRetrievalHeads`` where the keys are on a CUDA device and Triton is importable
(``TRITON_INTERPRET=1`` runs it on the CPU, which is how the unit tests check it).
"""

from __future__ import annotations

import numpy as np
import torch

from kvmem_core.retrieval.heads_score import BlockStats, HeadKeys, HeadMass, backend, block_mass, head_block_mass
from kvmem_torch.kernels import eligible, triton

ROW_TILE = 64  # query rows a program scores (tensor-core tiles: at least 16)
GROUP = 8  # blocks a program scores in turn, its row tile loaded from cache each time
FUSED = True  # off: the streaming path scores everywhere (A/B runs)

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _block_stats(
        high_ptr,
        low_ptr,
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
        STEP: tl.constexpr,
        GROUP: tl.constexpr,
    ):
        tile, group = tl.program_id(0), tl.program_id(1)
        r = tile * TILE + tl.arange(0, TILE)
        live = r < n_rows
        t = tl.arange(0, WIDTH)
        for g in range(GROUP):
            block = group * GROUP + g
            if block < n_blocks:
                base = block.to(tl.int64) * WIDTH
                logits = tl.zeros((TILE, WIDTH), dtype=tl.float32)
                for d0 in range(0, DIM, STEP):
                    d = d0 + tl.arange(0, STEP)
                    rows = r[:, None] * DIM + d[None, :]
                    high = tl.load(high_ptr + rows, mask=live[:, None], other=0.0)
                    low = tl.load(low_ptr + rows, mask=live[:, None], other=0.0)
                    k = tl.trans(tl.load(keys_ptr + (base + t[:, None]) * DIM + d[None, :]).to(tl.float16))
                    logits = tl.dot(low, k, tl.dot(high, k, logits))
                logits = logits * tl.load(scales_ptr + base + t)[None, :]
                logits = tl.where(t[None, :] < tl.load(n_tokens_ptr + block), logits, float("-inf"))
                peak = tl.max(logits, axis=1)
                arg = tl.argmax(logits, axis=1)
                total = tl.sum(tl.exp(logits - peak[:, None]), axis=1)
                out = r.to(tl.int64) * n_blocks + block
                tl.store(max_ptr + out, peak, mask=live)
                tl.store(arg_ptr + out, arg.to(tl.int64), mask=live)
                tl.store(sum_ptr + out, total, mask=live)


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


def block_stats(rows: np.ndarray, keys: HeadKeys) -> BlockStats:
    """Per (row, block) of ``rows`` (float32 [R, dim], pre-scaled) against ``keys`` (``usable``): the largest
    logit, its offset and the exp-sum relative to it, each [R, blocks]. Each row goes in as its fp16 value and the
    fp16 remainder, whose two products (int8 keys are exact in fp16, float32 accumulation) sum to within ~2^-22 of
    the float32 row's."""
    k = keys.keys.contiguous()
    n_blocks, width, dim = k.shape
    n_rows = len(rows)
    halves = backend(k).halves(torch.from_numpy(rows).to(k.device))
    high, low = halves[:n_rows], halves[n_rows:]
    peak = torch.empty((n_rows, n_blocks), dtype=torch.float32, device=k.device)
    arg = torch.empty((n_rows, n_blocks), dtype=torch.int64, device=k.device)
    total = torch.empty((n_rows, n_blocks), dtype=torch.float32, device=k.device)
    if n_blocks and n_rows:
        grid = (triton.cdiv(n_rows, ROW_TILE), triton.cdiv(n_blocks, GROUP))
        _block_stats[grid](
            high,
            low,
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
            STEP=min(64, dim),
            GROUP=GROUP,
        )
    return BlockStats(peak, arg, total)


def fused_block_mass(rows: np.ndarray, keys: HeadKeys, n_query_tokens: int) -> HeadMass:
    """``heads_score.head_block_mass``, through the kernel where ``usable(keys)``."""
    if not usable(keys):
        return head_block_mass(rows, keys, n_query_tokens)
    ops = backend(keys.keys)
    return block_mass(ops, block_stats(rows, keys), n_query_tokens)
