"""Per-token attention-mass scorers: ``retrieval-heads`` (default) and ``per-token``.

Both compute, for a query row (one query token of one query head), the softmax of
q·k/√d over every stored token of the workspace in the content frame (pre-RoPE), and take
each block's share of that mass. Keys stream through in chunks of blocks with a running
log-sum-exp, so memory stays at one chunk of logits whatever the workspace size.

``retrieval-heads`` keeps, per head, the largest share any one query token gives a block
(then sums over heads); ``per-token`` sums over query tokens. The difference matters on
agent transcripts: what tells the asked fact from its same-form look-alikes is usually
one token of the question (a name), while the question's other words match every
look-alike alike; summed over tokens they outvote it (docs/retrieval.md has the numbers).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from kvmem_core.retrieval.base import BlockScores, KeySource, QueryFeatures
from kvmem_core.retrieval.index import BlockIndex, MissingSummaryError
from kvmem_core.retrieval.summaries import index_pairs

CHUNK_TOKENS = 2048


class _StreamingMass:
    """Softmax mass per (row, block) over chunks of logits [rows, blocks, block tokens].

    Block sums are kept relative to their chunk's row maxima and rescaled once in ``finish``.
    """

    def __init__(self, n_rows: int, n_blocks: int) -> None:
        self._block_sum = np.zeros((n_rows, n_blocks), dtype=np.float32)
        self._block_max = np.full((n_rows, n_blocks), -np.inf, dtype=np.float32)
        self._block_arg = np.zeros((n_rows, n_blocks), dtype=np.int32)
        self._block_chunk = np.zeros(n_blocks, dtype=np.int64)
        self._chunk_max: list[np.ndarray] = []
        self._chunk_sum: list[np.ndarray] = []

    def add(self, logits: np.ndarray, b0: int) -> None:
        """Take one chunk of logits [rows, blocks, block tokens] for blocks ``b0:``; overwrites it."""
        b1 = b0 + logits.shape[1]
        arg = logits.argmax(axis=2)
        bmax = np.take_along_axis(logits, arg[:, :, None], axis=2)[:, :, 0]
        m = bmax.max(axis=1)
        np.subtract(logits, m[:, None, None], out=logits)
        sums = np.exp(logits, out=logits).sum(axis=2)
        self._block_sum[:, b0:b1] = sums
        self._block_max[:, b0:b1] = bmax
        self._block_arg[:, b0:b1] = arg
        self._block_chunk[b0:b1] = len(self._chunk_max)
        self._chunk_max.append(m)
        self._chunk_sum.append(sums.sum(axis=1))

    def finish(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Mass per (row, block) [rows, N], and each block's peak (log mass [N], offset [N])."""
        cmax = np.stack(self._chunk_max, axis=1).astype(np.float64)
        top = cmax.max(axis=1, keepdims=True)
        weight = np.exp(cmax - top)
        z = (np.stack(self._chunk_sum, axis=1) * weight).sum(axis=1, keepdims=True)
        mass = self._block_sum * (weight / z)[:, self._block_chunk]
        rel = self._block_max - (top + np.log(z))
        best = rel.argmax(axis=0)
        cols = np.arange(rel.shape[1])
        return mass, rel[best, cols], self._block_arg[best, cols]


class _PeakMerge:
    """Totals and the strongest peak per block over several accumulators."""

    def __init__(self, n_blocks: int) -> None:
        self.total = np.zeros(n_blocks, dtype=np.float64)
        self.best = np.full(n_blocks, -np.inf)
        self.peaks = np.full(n_blocks, -1, dtype=np.int32)

    def add(self, mass: np.ndarray, rel: np.ndarray, arg: np.ndarray) -> None:
        """Add block scores ``mass`` [N]; keep the peaks (log mass ``rel``, offset ``arg``) that beat the best."""
        self.total += mass
        better = rel > self.best
        self.best[better] = rel[better]
        self.peaks[better] = arg[better]


def _chunks(n_blocks: int, block_tokens: int) -> Iterator[tuple[int, int]]:
    step = max(1, CHUNK_TOKENS // block_tokens)
    for b0 in range(0, n_blocks, step):
        yield b0, min(n_blocks, b0 + step)


def _logits(rows: np.ndarray, keys: np.ndarray, n_tokens: np.ndarray, scales: np.ndarray | None = None) -> np.ndarray:
    """rows [R, D] (pre-scaled) · keys [nb, B, D] (times per-token ``scales`` [nb, B]) ->
    [R, nb, B], padding tokens at -inf."""
    nb, width, dim = keys.shape
    # keys @ rows.T (tall-skinny) runs about twice as fast in BLAS as rows @ keys.T
    tall = keys.reshape(nb * width, dim) @ rows.T
    if scales is not None:
        tall *= scales.reshape(-1, 1)
    logits = np.ascontiguousarray(tall.T).reshape(len(rows), nb, width)
    if (n_tokens < width).any():
        logits[:, np.arange(width)[None, :] >= n_tokens[:, None]] = -np.inf
    return logits


def head_peak_mass(mass: np.ndarray, n_query_tokens: int) -> np.ndarray:
    """Block scores from per-row mass [heads * query tokens, N] (rows head-major): per head the
    largest mass one query token gives each block, summed over heads -> [N]."""
    return mass.reshape(-1, n_query_tokens, mass.shape[-1]).max(axis=1).sum(axis=0)


def indexed_pairs(heads: tuple[tuple[int, int], ...], query: QueryFeatures, index: BlockIndex) -> list[tuple[int, int]]:
    """The (layer, kv head) pairs ``heads`` read; MissingSummaryError unless ``index`` holds their keys."""
    pairs = index_pairs(heads, query.group_size)
    missing = sorted(set(pairs) - set(index.head_pairs))
    if missing:
        raise MissingSummaryError(f"the index holds keys of (layer, kv head) {list(index.head_pairs)}, not {missing}; "
                                  "re-store the workspace with this profile")
    return pairs


@dataclass(frozen=True)
class RetrievalHeadsScorer:
    """Per-token mass over a few calibrated (layer, query head) pairs, read from the index.

    Score = per head, the largest attention mass one query token puts on the block; summed
    over the chosen heads.
    """

    heads: tuple[tuple[int, int], ...]
    name: str = "retrieval-heads"

    def score(self, query: QueryFeatures, index: BlockIndex) -> BlockScores:
        if index.n_blocks == 0:
            return BlockScores.empty()
        pairs = indexed_pairs(self.heads, query, index)
        keys, scales = index.get("head_keys"), index.get("head_scale")  # [P, N, B, D] int8, [P, N, B]
        merge = _PeakMerge(index.n_blocks)
        for layer, kv in pairs:
            rows = self._rows(query, layer, kv)
            acc = _StreamingMass(len(rows), index.n_blocks)
            slot = index.head_pairs.index((layer, kv))
            for b0, b1 in _chunks(index.n_blocks, index.block_tokens):
                chunk = keys[slot, b0:b1].astype(np.float32)
                acc.add(_logits(rows, chunk, index.n_tokens[b0:b1], scales[slot, b0:b1]), b0)
            mass, rel, arg = acc.finish()
            merge.add(head_peak_mass(mass, query.n_query_tokens), rel, arg)
        return BlockScores(merge.total, merge.peaks)

    def _rows(self, query: QueryFeatures, layer: int, kv: int) -> np.ndarray:
        heads = [h for l, h in self.heads if l == layer and h // query.group_size == kv]
        rows = query.q[layer][:, heads].transpose(1, 0, 2).reshape(-1, query.head_dim)
        return rows * np.float32(query.head_dim**-0.5)


@dataclass(frozen=True)
class PerTokenScorer:
    """Exact per-token mass over every key of every layer and head (loads full keys).

    Score = mass summed over query tokens, averaged over layers and query heads.
    """

    key_source: KeySource
    name: str = "per-token"

    def score(self, query: QueryFeatures, index: BlockIndex) -> BlockScores:
        if index.n_blocks == 0:
            return BlockScores.empty()
        n_layers, n_kv, group = query.n_layers, query.n_kv_heads, query.group_size
        scale = np.float32(query.head_dim**-0.5)
        rows = [query.grouped(layer) * scale for layer in range(n_layers)]
        accs = [[_StreamingMass(group * query.n_query_tokens, index.n_blocks) for _ in range(n_kv)] for _ in range(n_layers)]
        for b0, b1 in _chunks(index.n_blocks, index.block_tokens):
            keys = self._load(index, b0, b1)  # [nb, L, B, Hkv, D]
            for layer in range(n_layers):
                for kv in range(n_kv):
                    chunk = np.ascontiguousarray(keys[:, layer, :, kv])
                    accs[layer][kv].add(_logits(rows[layer][kv], chunk, index.n_tokens[b0:b1]), b0)
        merge = _PeakMerge(index.n_blocks)
        for acc in (a for per_layer in accs for a in per_layer):
            mass, rel, arg = acc.finish()
            merge.add(mass.sum(axis=0), rel, arg)
        return BlockScores(merge.total / (n_layers * query.n_heads), merge.peaks)

    def _load(self, index: BlockIndex, b0: int, b1: int) -> np.ndarray:
        out = None
        for i in range(b0, b1):
            k = self.key_source.content_keys(index.hashes[i])
            if out is None:
                out = np.zeros((b1 - b0, k.shape[0], index.block_tokens, *k.shape[2:]), dtype=np.float32)
            out[i - b0, :, : k.shape[1]] = k
        assert out is not None
        return out
