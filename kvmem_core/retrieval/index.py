"""Stacked block summaries of one workspace: what the scorers read.

Per-block summaries (``BlockMeta.summary``) are appended into growable arrays with the
block axis placed so that each (layer, kv head) slice is one contiguous matrix:

- ``mean_k``     [layers, kv heads, blocks, dim]             float32
- ``sub_mean_k`` [layers, kv heads, blocks, sub blocks, dim] float32
- ``protos``     [layers, kv heads, blocks, 4, dim]          float32
- ``head_keys``  [pairs, blocks, block_tokens, dim]          int8 (partial blocks zero-padded)
- ``head_scale`` [pairs, blocks, block_tokens]               float32, so key = head_keys * head_scale

Head keys are quantized per token to int8 with a power-of-two scale: widening int8 to
float32 is about 4x cheaper than widening float16 and reads half the bytes, and it is the
widening, not the arithmetic, that bounds retrieval-heads scoring on a CPU. The error of a
key element is at most 1/128 of the token's largest element (values on a coarse binary grid,
like the tests', come through exactly).

A summary is stacked the first time a scorer reads it (``get``) and kept stacked from then on: a
workspace's blocks carry every summary, the default scorer reads only the head keys, and stacking the
others cost most of an append's time and memory.

The index is append-only: ``sync`` extends it when the workspace grew and rebuilds it when
the workspace's block list no longer starts with the indexed blocks (``kvmem_core.layout.starts_with``);
``follow`` appends one block as it is stored (the engine calls it while archiving, so a step's
selection finds its new blocks indexed).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from kvmem_core.errors import KVMemError
from kvmem_core.layout import BlockMeta, starts_with

_BLOCK_AXIS = {"mean_k": 2, "sub_mean_k": 2, "protos": 2, "head_keys": 1, "head_scale": 1}
_SOURCE = {"head_scale": "head_keys"}  # stacked with another summary, not stored with the blocks
_DTYPE = {
    "mean_k": np.float32,
    "sub_mean_k": np.float32,
    "protos": np.float32,
    "head_keys": np.int8,
    "head_scale": np.float32,
}


def quantize_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row int8 codes and power-of-two scales of ``x`` [..., dim]: x ≈ codes * scale[..., None]."""
    x = np.asarray(x, dtype=np.float32)
    peak = np.abs(x).max(axis=-1)
    scale = np.exp2(np.ceil(np.log2(np.maximum(peak, 1e-30) / 127))).astype(np.float32)
    codes = np.clip(np.rint(x / scale[..., None]), -127, 127).astype(np.int8)
    return codes, scale


class MissingSummaryError(KVMemError):
    """The stored blocks lack a summary a scorer needs (e.g. retrieval heads changed)."""

    http_status = 400
    code = "missing_summary"


class BlockIndex:
    """Summaries of a workspace's blocks in chronological order, stacked for scoring."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._reserved = 0  # the capacity ``reserve`` asked for, kept through rebuilds
        self._reset()

    def _reset(self) -> None:
        self.hashes: list[str] = []
        self.head_pairs: tuple[tuple[int, int], ...] = ()
        self._names: frozenset[str] = frozenset()  # the summaries every indexed block carries
        self._summaries: list[dict[str, np.ndarray]] = []  # per indexed block, the meta's own
        self._arrays: dict[str, np.ndarray] = {}  # the stacked ones (``get``)
        self._n_tokens = np.zeros(0, dtype=np.int32)
        self._capacity = 0

    @classmethod
    def build(cls, metas: Sequence[BlockMeta], block_tokens: int) -> BlockIndex:
        index = cls(block_tokens)
        index.append(metas)
        return index

    @property
    def n_blocks(self) -> int:
        return len(self.hashes)

    @property
    def capacity(self) -> int:
        """Blocks the stacked arrays hold before they are copied into larger ones."""
        return self._capacity

    @property
    def n_tokens(self) -> np.ndarray:
        """Tokens per indexed block, int32 [blocks]."""
        return self._n_tokens[: self.n_blocks]

    def has(self, name: str) -> bool:
        return _SOURCE.get(name, name) in self._names

    def get(self, name: str) -> np.ndarray:
        """The stacked summary ``name`` over the indexed blocks (a view; see module docstring)."""
        if name not in self._arrays:
            self._stack(_SOURCE.get(name, name))
        arr = self._arrays[name]
        return arr[(slice(None),) * _BLOCK_AXIS[name] + (slice(0, self.n_blocks),)]

    def sync(self, metas: Sequence[BlockMeta]) -> None:
        """Make the index hold exactly ``metas``: append new ones, or rebuild after a divergence."""
        if not starts_with(metas, self.hashes):
            self._reset()
        self.append(metas[self.n_blocks :])

    def follow(self, meta: BlockMeta) -> None:
        """Append ``meta`` if it continues the indexed blocks (its parent is the last of them); else leave the
        index as it is, for ``sync``. An empty index stays empty: it is built when a step first scores."""
        if self.hashes and meta.parent_hash == self.hashes[-1]:
            self.append([meta])

    def truncate(self, n_blocks: int) -> None:
        """Forget the indexed blocks from ``n_blocks`` on; the next ``append`` writes over their slots."""
        del self.hashes[n_blocks:]
        del self._summaries[n_blocks:]
        if not self.hashes:
            self._reset()

    def reserve(self, n_blocks: int) -> None:
        """Hold ``n_blocks`` without copying: capacity grows to it now and again after any rebuild. A reserved index
        never copies itself to grow (growing a 1M-token index of three heads' keys copied ~0.8 GB and took 1.3 s at
        8K blocks and 2.5 s at 16K on this project's VM, in the turn that crossed the capacity). The arrays are
        zero-filled on demand (``np.zeros``: pages the OS maps when first written), so what is never written costs
        address space, not memory; where the OS refuses that address space, the index grows by doubling instead."""
        self._reserved = max(self._reserved, n_blocks)
        if n_blocks > self._capacity:
            self._grow(n_blocks)

    def append(self, metas: Iterable[BlockMeta]) -> None:
        """Add blocks after the indexed ones; every block must carry the same summaries."""
        metas = list(metas)
        if not metas:
            return
        if not self.hashes:
            self._names = frozenset(n for n in metas[0].summary if n in _BLOCK_AXIS)
            if "head_pairs" in metas[0].summary:
                self.head_pairs = tuple((int(a), int(b)) for a, b in metas[0].summary["head_pairs"])
        need = self.n_blocks + len(metas)
        if need > self._capacity:
            self._grow(max(need, 2 * self._capacity, self._reserved))
        for meta in metas:
            self._check(meta)
            i = self.n_blocks
            for name in self._arrays.keys() & self._names:
                self._put(i, name, meta.summary[name])
            self._n_tokens[i] = meta.n_tokens
            self._summaries.append(meta.summary)
            self.hashes.append(meta.chain_hash)

    def _check(self, meta: BlockMeta) -> None:
        names = {n for n in meta.summary if n in _BLOCK_AXIS}
        assert names == self._names, f"block {meta.chain_hash} summaries {sorted(names)} != {sorted(self._names)}"
        if "head_pairs" in meta.summary:
            pairs = tuple((int(a), int(b)) for a, b in meta.summary["head_pairs"])
            assert pairs == self.head_pairs, f"block {meta.chain_hash} indexes heads {pairs} != {self.head_pairs}"

    def _stack(self, name: str) -> None:
        """Stack summary ``name`` (with ``head_scale`` for ``head_keys``) over the indexed blocks."""
        if name not in self._names:
            raise MissingSummaryError(f"stored blocks have no {name!r} summary; re-store them with it")
        shape = list(self._summaries[0][name].shape)
        if name == "head_keys":
            shape[1] = self.block_tokens
            self._arrays["head_scale"] = self._empty("head_scale", shape[:2])
        self._arrays[name] = self._empty(name, shape)
        for i, summary in enumerate(self._summaries):
            self._put(i, name, summary[name])

    def _empty(self, name: str, shape: list[int]) -> np.ndarray:
        """Zeros for ``name`` of one block's ``shape`` at the index's capacity; past what the OS will map, the
        capacity falls back to twice the blocks indexed (``reserve`` is a wish, not a need)."""
        full = list(shape)
        full.insert(_BLOCK_AXIS[name], self._capacity)
        try:
            return np.zeros(full, dtype=_DTYPE[name])
        except MemoryError:
            fallback = max(64, 2 * self.n_blocks)
            if self._capacity <= fallback:
                raise
            self._reserved = 0
            self._grow(fallback)
            return self._empty(name, shape)

    def _grow(self, capacity: int) -> None:
        for name, arr in self._arrays.items():
            axis = _BLOCK_AXIS[name]
            shape = list(arr.shape)
            shape[axis] = capacity
            new = np.zeros(shape, dtype=arr.dtype)
            new[(slice(None),) * axis + (slice(0, self.n_blocks),)] = self.get(name)
            self._arrays[name] = new
        n_tokens = np.zeros(capacity, dtype=np.int32)
        n_tokens[: self.n_blocks] = self.n_tokens
        self._n_tokens = n_tokens
        self._capacity = capacity

    def _put(self, i: int, name: str, value: np.ndarray) -> None:
        """Write block ``i``'s summary ``name`` (``head_keys`` as int8 codes and ``head_scale``)."""
        lead = (slice(None),) * _BLOCK_AXIS[name] + (i,)
        if name == "head_keys":
            lead += (slice(0, value.shape[1]),)
            value, self._arrays["head_scale"][lead] = quantize_int8(value)
        self._arrays[name][lead] = value
