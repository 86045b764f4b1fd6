"""Every scorer against a plain float64 implementation written out here.

Keys are drawn on a grid of eighths in [-2, 2], which float16 and the int8 head index hold
exactly, so the summaries and the index lose nothing and the tolerance can be tight.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvmem_core.layout import BlockMeta
from kvmem_core.retrieval import BlockIndex, QueryFeatures, SummaryOptions, make_scorer, summarize_block

L, HQ, HKV, D, B, TQ = 3, 6, 2, 16, 16, 5
G = HQ // HKV
SIZES = [B] * 9 + [11]  # the newest block is partial
HEADS = ((0, 1), (2, 5), (2, 3))


class Keys:
    def __init__(self, blocks: list[np.ndarray]) -> None:
        self.blocks = {f"{i:032x}": k for i, k in enumerate(blocks)}

    def content_keys(self, chain_hash: str) -> np.ndarray:
        return self.blocks[chain_hash]


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(7)
    blocks = [(rng.integers(-16, 17, (L, n, HKV, D)) / 8).astype(np.float32) for n in SIZES]
    q = rng.standard_normal((L, TQ, HQ, D)).astype(np.float32)
    opts = SummaryOptions(group_size=G, sub_blocks=4)
    metas, start = [], 0
    for i, k in enumerate(blocks):
        ids = np.arange(start, start + len(k[0]), dtype=np.int32)
        metas.append(BlockMeta(f"{i:032x}", "0" * 32, ids, start, 0, summarize_block(k, HEADS, opts)))
        start += k.shape[1]
    return blocks, q, BlockIndex.build(metas, B), metas


def softmax64(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def ref_token_mass(q, blocks, heads, rows="sum"):
    """Per block: softmax over every token of q·k/√d per (head, query token), reduced over query
    tokens by ``rows`` (sum, or max per head) and summed over heads; and the offset of the single
    strongest (head, query token, key) mass in each block."""
    owner = np.concatenate([np.full(k.shape[1], i) for i, k in enumerate(blocks)])
    offset = np.concatenate([np.arange(k.shape[1]) for k in blocks])
    score = np.zeros(len(blocks))
    best = np.full(len(blocks), -np.inf)
    peak = np.zeros(len(blocks), dtype=int)
    for layer, head in heads:
        keys = np.concatenate([k[layer, :, head // G].astype(np.float64) for k in blocks])
        per_token = np.zeros((q.shape[1], len(blocks)))
        for t in range(q.shape[1]):
            p = softmax64(keys @ q[layer, t, head].astype(np.float64) / np.sqrt(D))
            np.add.at(per_token[t], owner, p)
            for b in range(len(blocks)):
                mine = owner == b
                if p[mine].max() > best[b]:
                    best[b] = p[mine].max()
                    peak[b] = offset[mine][p[mine].argmax()]
        score += per_token.max(axis=0) if rows == "max" else per_token.sum(axis=0)
    return score, peak


def ref_mean_k(q, blocks):
    kbar = np.stack([k.astype(np.float64).mean(axis=1) for k in blocks])  # [N, L, Hkv, D]
    score = np.zeros(len(blocks))
    for layer in range(L):
        for head in range(HQ):
            for t in range(TQ):
                score += softmax64(kbar[:, layer, head // G] @ q[layer, t, head] / np.sqrt(D))
    return score / (L * HQ)


def ref_sub_block(q, blocks, reduce):
    subs = [
        np.stack([k[:, run].astype(np.float64).mean(axis=1) for run in np.array_split(np.arange(k.shape[1]), 4)])
        for k in blocks
    ]
    flat = np.concatenate(subs)  # [N*4, L, Hkv, D]
    score = np.zeros(len(blocks))
    for layer in range(L):
        for head in range(HQ):
            for t in range(TQ):
                p = softmax64(flat[:, layer, head // G] @ q[layer, t, head] / np.sqrt(D)).reshape(len(blocks), 4)
                score += p.max(axis=1) if reduce == "max" else p.sum(axis=1)
    return score / (L * HQ)


def ref_key_direction(q, metas):
    protos = np.stack([m.summary["protos"].astype(np.float64) for m in metas])  # [N, L, Hkv, 4, D]
    score = np.zeros(len(metas))
    for layer in range(L):
        for head in range(HQ):
            for t in range(TQ):
                u = q[layer, t, head] / np.linalg.norm(q[layer, t, head])
                score += (protos[:, layer, head // G] @ u).max(axis=1)
    return score / (L * HQ)


def test_retrieval_heads_matches_reference(data):
    blocks, q, index, _ = data
    got = make_scorer("retrieval-heads", HEADS).score(QueryFeatures(q, HKV), index)
    want, peak = ref_token_mass(q, blocks, HEADS, rows="max")
    np.testing.assert_allclose(got.scores, want, rtol=1e-4)
    np.testing.assert_array_equal(got.peaks, peak)
    summed, _ = ref_token_mass(q, blocks, HEADS)
    assert not np.allclose(got.scores, summed, rtol=1e-2)  # the per-head peak, not the sum over query tokens


def test_per_token_matches_reference(data):
    blocks, q, index, _ = data
    got = make_scorer("per-token", key_source=Keys(blocks)).score(QueryFeatures(q, HKV), index)
    every_head = [(layer, head) for layer in range(L) for head in range(HQ)]
    want, peak = ref_token_mass(q, blocks, every_head)
    np.testing.assert_allclose(got.scores, want / (L * HQ), rtol=1e-4)
    np.testing.assert_array_equal(got.peaks, peak)


def test_mean_k_matches_reference(data):
    blocks, q, index, _ = data
    got = make_scorer("mean-k").score(QueryFeatures(q, HKV), index)
    np.testing.assert_allclose(got.scores, ref_mean_k(q, blocks), rtol=1e-4)
    assert (got.peaks == -1).all()


@pytest.mark.parametrize("reduce", ["max", "sum"])
def test_sub_block_mean_k_matches_reference(data, reduce):
    blocks, q, index, _ = data
    got = make_scorer("sub-block-mean-k", sub_reduce=reduce).score(QueryFeatures(q, HKV), index)
    np.testing.assert_allclose(got.scores, ref_sub_block(q, blocks, reduce), rtol=1e-4)


def test_key_direction_matches_reference(data):
    _, q, index, metas = data
    got = make_scorer("key-direction").score(QueryFeatures(q, HKV), index)
    np.testing.assert_allclose(got.scores, ref_key_direction(q, metas), rtol=1e-5)
