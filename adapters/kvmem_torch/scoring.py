"""The ``retrieval-heads`` scorer on torch tensors, for CUDA: the index's keys stay on the device.

It scores as ``kvmem_core.retrieval.RetrievalHeadsScorer`` does, through the same code
(``kvmem_core.retrieval.heads_score``) on tensors: per query row (a query token of a retrieval
head), the softmax of q·k/√d over every indexed token (int8 keys times their per-token scale,
content frame); a block's score is, per head, the largest share of that mass one query token
gives it, summed over heads; its peak the token offset of its largest normalised logit.

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
from kvmem_core.retrieval.heads_score import HeadKeys, score_heads
from kvmem_core.retrieval.index import BlockIndex
from kvmem_core.retrieval.token_mass import indexed_pairs
from kvmem_torch.score_kernel import fused_block_mass


class DeviceIndex:
    """Head keys int8 [pairs, blocks, block tokens, dim], scales and token counts of an index, on
    ``device`` or (``pinned``) in pinned host memory."""

    def __init__(self, device: torch.device | str, pinned: bool = False) -> None:
        self.device, self.pinned = torch.device(device), pinned
        self.n_blocks, self.last_hash = 0, None  # the blocks mirrored, the chain hash of the last
        self.keys = self.scales = self.n_tokens = None

    def sync(self, index: BlockIndex) -> None:
        """Hold exactly the blocks of ``index``: append new ones, rebuild after a divergence."""
        n = self.n_blocks
        keys = index.get("head_keys")  # [pairs, blocks, block tokens, dim] int8
        if self.keys is None or index.n_blocks < n or (n and index.hashes[n - 1] != self.last_hash):
            self.n_blocks = n = 0  # the chain's hash at the mirror's end names every block before it
            self._resize(keys.shape, max(64, index.n_blocks))
        elif index.n_blocks > self.keys.shape[1]:
            self._resize(keys.shape, 2 * index.n_blocks)
        self.keys[:, n : index.n_blocks].copy_(torch.from_numpy(keys[:, n:]))
        self.scales[:, n : index.n_blocks].copy_(torch.from_numpy(index.get("head_scale")[:, n:]))
        self.n_tokens[n : index.n_blocks].copy_(torch.from_numpy(index.n_tokens[n:].astype(np.int64)))
        self.n_blocks, self.last_hash = index.n_blocks, index.hashes[-1] if index.hashes else None

    def _resize(self, shape: tuple[int, ...], capacity: int) -> None:
        """New buffers of ``capacity`` blocks holding the mirrored blocks."""
        n, (p, _, b, d) = self.n_blocks, shape
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
        n = index.n_blocks

        def keys_of(layer: int, kv: int) -> HeadKeys:
            slot = index.head_pairs.index((layer, kv))
            return HeadKeys(mirror.keys[slot, :n], mirror.n_tokens[:n], mirror.scales[slot, :n], self.device)

        with torch.inference_mode():
            return score_heads(self.heads, query, pairs, keys_of, n, mass_of=fused_block_mass)
