"""Values and protocols shared by the scorers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvmem_core.retrieval.index import BlockIndex


@dataclass(frozen=True, eq=False)
class QueryFeatures:
    """Pre-RoPE queries of the query span, float32 [layers, query tokens, query heads, head dim].

    Layers count attention layers only, as in ``BlockLayout``; query head ``h`` reads kv head
    ``h // (n_heads // n_kv_heads)``.
    """

    q: np.ndarray
    n_kv_heads: int

    def __post_init__(self) -> None:
        assert self.q.ndim == 4, "q must be [layers, query tokens, query heads, head dim]"
        assert self.q.shape[2] % self.n_kv_heads == 0, "query heads must group evenly over kv heads"
        object.__setattr__(self, "q", np.ascontiguousarray(self.q, dtype=np.float32))

    @property
    def n_layers(self) -> int:
        return self.q.shape[0]

    @property
    def n_query_tokens(self) -> int:
        return self.q.shape[1]

    @property
    def n_heads(self) -> int:
        return self.q.shape[2]

    @property
    def head_dim(self) -> int:
        return self.q.shape[3]

    @property
    def group_size(self) -> int:
        return self.n_heads // self.n_kv_heads

    def grouped(self, layer: int) -> np.ndarray:
        """Queries of one layer grouped by kv head: [kv heads, group * query tokens, dim]."""
        q = self.q[layer].reshape(self.n_query_tokens, self.n_kv_heads, self.group_size, self.head_dim)
        return q.transpose(1, 2, 0, 3).reshape(self.n_kv_heads, -1, self.head_dim)


@dataclass(frozen=True, eq=False)
class BlockScores:
    """A score per indexed block (higher is more relevant) and where its winning token sits.

    ``peaks[b]`` is the token offset inside block ``b`` that carried the most attention, or
    -1 when the scorer cannot tell (block-level summaries).
    """

    scores: np.ndarray
    peaks: np.ndarray

    @classmethod
    def without_peaks(cls, scores: np.ndarray) -> BlockScores:
        return cls(np.asarray(scores, dtype=np.float64), np.full(len(scores), -1, dtype=np.int32))

    @classmethod
    def empty(cls) -> BlockScores:
        return cls.without_peaks(np.zeros(0))


class Scorer(Protocol):
    """Scores every block of a workspace from query features and its summary index."""

    @property
    def name(self) -> str:
        """The scorer's name, as ``make_scorer`` takes it."""
        ...

    def score(self, query: QueryFeatures, index: BlockIndex) -> BlockScores:
        """One score per block of ``index``; never loads KV (except ``per-token``, through its key source)."""
        ...


class KeySource(Protocol):
    """Full content-frame keys of stored blocks (what ``per-token`` scoring needs)."""

    def content_keys(self, chain_hash: str) -> np.ndarray:
        """Pre-RoPE K of the block, float32 [layers, tokens, kv heads, head dim]."""
        ...
