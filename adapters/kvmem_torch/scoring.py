"""The ``retrieval-heads`` scorer on torch tensors, for CUDA: the index's keys stay on the device.

It scores exactly as ``kvmem_core.retrieval.RetrievalHeadsScorer``: per query row (a query
token of a retrieval head), the softmax of q·k/√d over every indexed token (int8 keys times
their per-token scale, content frame); a block's score is, per head, the largest share of
that mass one query token gives it, summed over heads; its peak the token offset of its
largest normalised logit. Two passes over chunks of keys: the rows' log-sum-exp, then block
mass and peaks.

``DeviceIndex`` mirrors a ``BlockIndex``'s head keys in device memory (or pinned host
memory, copied per chunk); it appends the blocks stored since the last score and rebuilds
when the workspace diverged.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from kvmem_core.retrieval.base import BlockScores, QueryFeatures
from kvmem_core.retrieval.index import BlockIndex
from kvmem_core.retrieval.token_mass import indexed_pairs

CHUNK_TOKENS = 1 << 16  # logits of one chunk: rows x 64K float32


class DeviceIndex:
    """Head keys int8 [pairs, blocks, block tokens, dim], scales and token counts of an index, on
    ``device`` or (``pinned``) in pinned host memory."""

    def __init__(self, device: torch.device | str, pinned: bool = False) -> None:
        self.device, self.pinned = torch.device(device), pinned
        self.hashes: list[str] = []
        self.keys = self.scales = self.n_tokens = None

    def sync(self, index: BlockIndex) -> None:
        """Hold exactly the blocks of ``index``: append new ones, rebuild after a divergence."""
        n = len(self.hashes)
        keys = index.get("head_keys")  # [pairs, blocks, block tokens, dim] int8
        if self.keys is None or index.hashes[:n] != self.hashes:
            self.hashes, n = [], 0
            self._resize(keys.shape, max(64, index.n_blocks))
        elif index.n_blocks > self.keys.shape[1]:
            self._resize(keys.shape, 2 * index.n_blocks)
        self.keys[:, n:index.n_blocks].copy_(torch.from_numpy(keys[:, n:]))
        self.scales[:, n:index.n_blocks].copy_(torch.from_numpy(index.get("head_scale")[:, n:]))
        self.n_tokens[n:index.n_blocks].copy_(torch.from_numpy(index.n_tokens[n:].astype(np.int64)))
        self.hashes = list(index.hashes)

    def _resize(self, shape: tuple[int, ...], capacity: int) -> None:
        """New buffers of ``capacity`` blocks holding the mirrored blocks."""
        n, (p, _, b, d) = len(self.hashes), shape
        old = (self.keys, self.scales, self.n_tokens)
        self.keys = self._empty((p, capacity, b, d), torch.int8)
        self.scales = self._empty((p, capacity, b), torch.float32)
        self.n_tokens = self._empty((capacity,), torch.int64)
        if n:
            self.keys[:, :n].copy_(old[0][:, :n])
            self.scales[:, :n].copy_(old[1][:, :n])
            self.n_tokens[:n].copy_(old[2][:n])

    def _empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.pinned:
            return torch.zeros(shape, dtype=dtype).pin_memory()
        return torch.zeros(shape, dtype=dtype, device=self.device)


@dataclass(frozen=True, eq=False)
class TorchRetrievalHeads:
    """``retrieval-heads`` scoring on ``device``; ``mirrors`` keeps one ``DeviceIndex`` per live index."""

    heads: tuple[tuple[int, int], ...]
    device: torch.device | str
    pinned: bool = False
    mirrors: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    name: str = "retrieval-heads"

    def score(self, query: QueryFeatures, index: BlockIndex) -> BlockScores:
        if index.n_blocks == 0:
            return BlockScores.empty()
        pairs = indexed_pairs(self.heads, query, index)
        mirror = self.mirrors.setdefault(index, DeviceIndex(self.device, self.pinned))
        mirror.sync(index)
        n, dev = index.n_blocks, torch.device(self.device)
        total = torch.zeros(n, dtype=torch.float64, device=dev)
        best = torch.full((n,), -torch.inf, dtype=torch.float64, device=dev)
        peaks = torch.full((n,), -1, dtype=torch.int64, device=dev)
        with torch.inference_mode():
            for layer, kv in pairs:
                rows = torch.from_numpy(self._rows(query, layer, kv)).to(dev)
                slot = index.head_pairs.index((layer, kv))
                lse = self._lse(rows, mirror, slot, n)
                for b0, b1, logits in self._chunks(rows, mirror, slot, n):
                    rel = logits.double() - lse[:, None, None]  # [rows, blocks, tokens]
                    mass = rel.exp().sum(dim=2).view(-1, query.n_query_tokens, b1 - b0)  # [heads, query tokens, blocks]
                    total[b0:b1] += mass.amax(dim=1).sum(dim=0)
                    token_max, token_arg = rel.max(dim=2)
                    row_max, row_arg = token_max.max(dim=0)
                    better = row_max > best[b0:b1]
                    best[b0:b1] = torch.where(better, row_max, best[b0:b1])
                    peaks[b0:b1] = torch.where(better, token_arg.gather(0, row_arg[None])[0], peaks[b0:b1])
        return BlockScores(total.cpu().numpy(), peaks.cpu().numpy().astype(np.int32))

    def _rows(self, query: QueryFeatures, layer: int, kv: int) -> np.ndarray:
        heads = [h for l, h in self.heads if l == layer and h // query.group_size == kv]
        rows = query.q[layer][:, heads].transpose(1, 0, 2).reshape(-1, query.head_dim)
        return np.ascontiguousarray(rows * np.float32(query.head_dim**-0.5))

    def _lse(self, rows: torch.Tensor, mirror: DeviceIndex, slot: int, n: int) -> torch.Tensor:
        """Log-sum-exp of every row's logits over all indexed tokens, float64 [rows]."""
        lse = torch.full((len(rows),), -torch.inf, dtype=torch.float64, device=rows.device)
        for _, _, logits in self._chunks(rows, mirror, slot, n):
            lse = torch.logaddexp(lse, logits.flatten(1).logsumexp(dim=1).double())
        return lse

    def _chunks(self, rows: torch.Tensor, mirror: DeviceIndex, slot: int, n: int):
        """(b0, b1, logits float32 [rows, b1 - b0, block tokens]) over the index, padding at -inf."""
        width = mirror.keys.shape[2]
        step = max(1, CHUNK_TOKENS // width)
        for b0 in range(0, n, step):
            b1 = min(n, b0 + step)
            keys = mirror.keys[slot, b0:b1].to(rows.device, non_blocking=True).float()  # [nb, B, D]
            scales = mirror.scales[slot, b0:b1].to(rows.device, non_blocking=True)
            count = mirror.n_tokens[b0:b1].to(rows.device, non_blocking=True)
            logits = torch.einsum("rd,btd->rbt", rows, keys) * scales
            pad = torch.arange(width, device=rows.device)[None, :] >= count[:, None]
            yield b0, b1, logits.masked_fill(pad, -torch.inf)
