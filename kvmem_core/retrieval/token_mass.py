"""Per-token attention-mass scorers: ``retrieval-heads`` (default) and ``per-token``.

Both compute, for a query row (one query token of one query head), the softmax of
q·k/√d over every stored token of the workspace in the content frame (pre-RoPE), and take
each block's share of that mass. Keys stream through in chunks of blocks with a running
log-sum-exp (``heads_score``), so memory stays at one chunk of logits whatever the workspace size.

``retrieval-heads`` keeps, per head, the largest share any one query token gives a block
(then sums over heads); ``per-token`` sums over query tokens. The difference matters on
agent transcripts: what tells the asked fact from its same-form look-alikes is usually
one token of the question (a name), while the question's other words match every
look-alike alike; summed over tokens they outvote it (docs/retrieval.md has the numbers).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvmem_core.retrieval.base import BlockScores, KeySource, QueryFeatures
from kvmem_core.retrieval.heads_score import (
    CHUNK_TOKENS,
    HeadKeys,
    NumpyOps,
    PeakMerge,
    StreamingMass,
    chunks,
    score_heads,
)
from kvmem_core.retrieval.index import BlockIndex, MissingSummaryError
from kvmem_core.retrieval.summaries import index_pairs


def indexed_pairs(
    heads: tuple[tuple[int, int], ...], query: QueryFeatures, index: BlockIndex
) -> tuple[tuple[int, int], ...]:
    """The (layer, kv head) pairs ``heads`` read; MissingSummaryError unless ``index`` holds their keys."""
    pairs = index_pairs(heads, query.group_size)
    missing = sorted(set(pairs) - set(index.head_pairs))
    if missing:
        raise MissingSummaryError(
            f"the index holds keys of (layer, kv head) {list(index.head_pairs)}, not {missing}; "
            "re-store the workspace with this profile"
        )
    return pairs


@dataclass(frozen=True)
class RetrievalHeadsScorer:
    """Per-token mass over a few calibrated (layer, query head) pairs, read from the index.

    Score = per head, the largest attention mass one query token puts on the block; summed
    over the chosen heads.
    """

    heads: tuple[tuple[int, int], ...]
    name: str = "retrieval-heads"
    workers: int = 1  # threads scoring a (layer, kv head)'s chunks at once (the adapter's, ``make_scorer``)

    def score(self, query: QueryFeatures, index: BlockIndex) -> BlockScores:
        if index.n_blocks == 0:
            return BlockScores.empty()
        keys, scales = index.get("head_keys"), index.get("head_scale")  # [P, N, B, D] int8, [P, N, B]

        def keys_of(layer: int, kv: int) -> HeadKeys:
            slot = index.head_pairs.index((layer, kv))
            return HeadKeys(keys[slot], index.n_tokens, scales[slot])

        pairs = indexed_pairs(self.heads, query, index)
        return score_heads(self.heads, query, pairs, keys_of, index.n_blocks, self.workers)


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
        spans = chunks(index.n_blocks, index.block_tokens, CHUNK_TOKENS["numpy"])
        n_rows = group * query.n_query_tokens
        accs = [
            [StreamingMass(NumpyOps, rows[0], n_rows, index.n_blocks, len(spans)) for _ in range(n_kv)]
            for _ in range(n_layers)
        ]
        for chunk, (b0, b1) in enumerate(spans):
            keys = self._load(index, b0, b1)  # [nb, L, B, Hkv, D]
            for layer in range(n_layers):
                for kv in range(n_kv):
                    part = np.ascontiguousarray(keys[:, layer, :, kv])
                    logits = NumpyOps.logits(rows[layer][kv], part, index.n_tokens[b0:b1], None)
                    accs[layer][kv].add(logits, b0, chunk)
        merge = PeakMerge(index.n_blocks)
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
