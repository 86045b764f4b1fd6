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

The index is append-only: ``sync`` extends it when the workspace grew and rebuilds it when
the workspace's block list no longer starts with the indexed blocks.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from kvmem_core.errors import KVMemError
from kvmem_core.layout import BlockMeta

_BLOCK_AXIS = {"mean_k": 2, "sub_mean_k": 2, "protos": 2, "head_keys": 1, "head_scale": 1}
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
        self._reset()

    def _reset(self) -> None:
        self.hashes: list[str] = []
        self.head_pairs: tuple[tuple[int, int], ...] = ()
        self._arrays: dict[str, np.ndarray] = {}
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
    def n_tokens(self) -> np.ndarray:
        """Tokens per indexed block, int32 [blocks]."""
        return self._n_tokens[: self.n_blocks]

    def has(self, name: str) -> bool:
        return name in self._arrays

    def get(self, name: str) -> np.ndarray:
        """The stacked summary ``name`` over the indexed blocks (a view; see module docstring)."""
        if name not in self._arrays:
            raise MissingSummaryError(f"stored blocks have no {name!r} summary; re-store them with it")
        arr = self._arrays[name]
        return arr[(slice(None),) * _BLOCK_AXIS[name] + (slice(0, self.n_blocks),)]

    def sync(self, metas: Sequence[BlockMeta]) -> None:
        """Make the index hold exactly ``metas``: append new ones, or rebuild after a divergence."""
        n = self.n_blocks
        if len(metas) < n or [m.chain_hash for m in metas[:n]] != self.hashes:
            self._reset()
            n = 0
        self.append(metas[n:])

    def truncate(self, n_blocks: int) -> None:
        """Forget the indexed blocks from ``n_blocks`` on; the next ``append`` writes over their slots."""
        del self.hashes[n_blocks:]

    def reserve(self, n_blocks: int) -> None:
        """Grow capacity to ``n_blocks`` now (avoids copies while appending a known count)."""
        if n_blocks > self._capacity:
            self._grow(n_blocks)

    def append(self, metas: Iterable[BlockMeta]) -> None:
        """Add blocks after the indexed ones; every block must carry the same summaries."""
        metas = list(metas)
        if not metas:
            return
        if not self.hashes and not self._arrays:
            self._init_arrays(metas[0])
        need = self.n_blocks + len(metas)
        if need > self._capacity:
            self._grow(max(need, 2 * self._capacity))
        for meta in metas:
            self._put(self.n_blocks, meta)
            self.hashes.append(meta.chain_hash)

    def _init_arrays(self, meta: BlockMeta) -> None:
        if "head_pairs" in meta.summary:
            self.head_pairs = tuple((int(a), int(b)) for a, b in meta.summary["head_pairs"])
        shapes = {name: list(value.shape) for name, value in meta.summary.items() if name in _BLOCK_AXIS}
        if "head_keys" in shapes:
            shapes["head_keys"][1] = self.block_tokens
            shapes["head_scale"] = shapes["head_keys"][:2]
        for name, shape in shapes.items():
            shape.insert(_BLOCK_AXIS[name], self._capacity)
            self._arrays[name] = np.zeros(shape, dtype=_DTYPE[name])

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

    def _put(self, i: int, meta: BlockMeta) -> None:
        names = {n for n in meta.summary if n in _BLOCK_AXIS}
        want = set(self._arrays) - {"head_scale"}
        assert names == want, f"block {meta.chain_hash} summaries {sorted(names)} != {sorted(want)}"
        if "head_pairs" in meta.summary:
            pairs = tuple((int(a), int(b)) for a, b in meta.summary["head_pairs"])
            assert pairs == self.head_pairs, f"block {meta.chain_hash} indexes heads {pairs} != {self.head_pairs}"
        for name in names:
            value = meta.summary[name]
            axis = _BLOCK_AXIS[name]
            lead = (slice(None),) * axis + (i,)
            if name == "head_keys":
                lead += (slice(0, value.shape[1]),)
                value, self._arrays["head_scale"][lead] = quantize_int8(value)
            self._arrays[name][lead] = value
        self._n_tokens[i] = meta.n_tokens
