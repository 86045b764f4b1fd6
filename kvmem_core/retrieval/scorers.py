"""Summary scorers (``mean-k``, ``sub-block-mean-k``, ``key-direction``) and the scorer factory.

Each works per attention layer and kv head on one contiguous summary matrix, with every
query head scored against its own GQA kv head; scores are averaged over layers and query
heads and summed over query tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kvmem_core.errors import ConfigError
from kvmem_core.retrieval.base import BlockScores, KeySource, QueryFeatures, Scorer
from kvmem_core.retrieval.index import BlockIndex
from kvmem_core.retrieval.token_mass import PerTokenScorer, RetrievalHeadsScorer


def _softmax_over_rows(logits: np.ndarray) -> np.ndarray:
    """Softmax along axis 1 of [kv heads, items, query rows], in place.

    Summaries are laid out items-major ([kv heads, items, rows] = summaries @ queries.T):
    the tall BLAS product is about twice as fast as the wide one.
    """
    np.subtract(logits, logits.max(axis=1, keepdims=True), out=logits)
    np.exp(logits, out=logits)
    logits *= 1.0 / logits.sum(axis=1, keepdims=True)
    return logits


@dataclass(frozen=True)
class MeanKScorer:
    """Softmax over blocks of q·k̄/√d per query head, mass summed over query tokens."""

    name: str = "mean-k"

    def score(self, query: QueryFeatures, index: BlockIndex) -> BlockScores:
        if index.n_blocks == 0:
            return BlockScores.empty()
        kbar = index.get("mean_k")  # [L, Hkv, N, D]
        total = np.zeros(index.n_blocks, dtype=np.float64)
        scale = np.float32(query.head_dim**-0.5)
        for layer in range(query.n_layers):
            logits = np.matmul(kbar[layer], (query.grouped(layer) * scale).transpose(0, 2, 1))
            total += _softmax_over_rows(logits).sum(axis=(0, 2))
        return BlockScores.without_peaks(total / (query.n_layers * query.n_heads))


@dataclass(frozen=True)
class SubBlockMeanKScorer:
    """Softmax over every block's sub-block means; a block takes the max or sum of its parts.

    ``peaks`` point at the centre of each block's strongest sub-block.
    """

    reduce: str = "max"
    name: str = "sub-block-mean-k"

    def __post_init__(self) -> None:
        assert self.reduce in ("max", "sum"), f"sub-block reduce must be max or sum, got {self.reduce}"

    def score(self, query: QueryFeatures, index: BlockIndex) -> BlockScores:
        if index.n_blocks == 0:
            return BlockScores.empty()
        sub = index.get("sub_mean_k")  # [L, Hkv, N, S, D]
        n_layers, n_kv, n_blocks, n_sub, dim = sub.shape
        total = np.zeros(n_blocks, dtype=np.float64)
        per_sub = np.zeros((n_blocks, n_sub), dtype=np.float64)
        scale = np.float32(dim**-0.5)
        for layer in range(n_layers):
            flat = sub[layer].reshape(n_kv, n_blocks * n_sub, dim)
            mass = _softmax_over_rows(np.matmul(flat, (query.grouped(layer) * scale).transpose(0, 2, 1)))
            mass = mass.reshape(n_kv, n_blocks, n_sub, -1)
            reduced = mass.max(axis=2) if self.reduce == "max" else mass.sum(axis=2)
            total += reduced.sum(axis=(0, 2))
            per_sub += mass.sum(axis=(0, 3))
        width = index.n_tokens / n_sub
        peaks = ((per_sub.argmax(axis=1) + 0.5) * width).astype(np.int32)
        return BlockScores(total / (n_layers * query.n_heads), peaks)


@dataclass(frozen=True)
class KeyDirectionScorer:
    """MaxSim: per query token and head, the best cosine over a block's key prototypes."""

    name: str = "key-direction"

    def score(self, query: QueryFeatures, index: BlockIndex) -> BlockScores:
        if index.n_blocks == 0:
            return BlockScores.empty()
        protos = index.get("protos")  # [L, Hkv, N, P, D], unit rows
        n_layers, n_kv, n_blocks, n_protos, dim = protos.shape
        total = np.zeros(n_blocks, dtype=np.float64)
        for layer in range(n_layers):
            q = query.grouped(layer)
            q = q / np.maximum(np.linalg.norm(q, axis=-1, keepdims=True), 1e-12)
            flat = protos[layer].reshape(n_kv, n_blocks * n_protos, dim)
            sims = np.matmul(flat, q.transpose(0, 2, 1)).reshape(n_kv, n_blocks, n_protos, -1)
            total += sims.max(axis=2).sum(axis=(0, 2))
        return BlockScores.without_peaks(total / (n_layers * query.n_heads))


def make_scorer(
    name: str, heads: Sequence[tuple[int, int]] = (), key_source: KeySource | None = None, sub_reduce: str = "max"
) -> Scorer:
    """The scorer called ``name`` (config.SCORERS); ``heads`` are the retrieval heads as
    (layer, query head), ``key_source`` gives ``per-token`` its full keys."""
    if name == "retrieval-heads":
        if not heads:
            raise ConfigError("retrieval-heads needs heads: calibrate the model or pass --kvmem-retrieval-heads")
        return RetrievalHeadsScorer(tuple(heads))
    if name == "per-token":
        if key_source is None:
            raise ConfigError("per-token scoring needs the blocks' full keys (a key source)")
        return PerTokenScorer(key_source)
    if name == "mean-k":
        return MeanKScorer()
    if name == "sub-block-mean-k":
        return SubBlockMeanKScorer(sub_reduce)
    if name == "key-direction":
        return KeyDirectionScorer()
    raise ConfigError(f"unknown scorer {name!r}")
