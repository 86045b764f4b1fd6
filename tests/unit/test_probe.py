"""The query window's probe (``kvmem_core.archive``) selects what the prefill-and-replay path selects.

Here, with no model: the retrieval-heads scorer against a plain float64 numpy reference of the same scoring
(so a faster scorer cannot drift), and the merge of a held block's layers. On a real model (llama.cpp's probe
forward, two engines probing and replaying one agent session): tests/reference/test_probe_engines.py.
"""

from __future__ import annotations


import numpy as np
import pytest

from kvmem_core.archive import deep_layers, merge_layers
from kvmem_core.layout import BlockKV, BlockMeta
from kvmem_core.retrieval import BlockIndex, QueryFeatures
from kvmem_core.retrieval.token_mass import RetrievalHeadsScorer

HEADS = ((1, 0), (1, 3), (2, 5))  # (layer, query head); 8 query heads over 2 kv heads


def reference_scores(q: np.ndarray, keys: np.ndarray, heads: tuple[tuple[int, int], ...], group: int) -> np.ndarray:
    """Retrieval-heads scores in float64, written plainly: per head, the softmax of q·k/√d over every stored
    token, each block's share summed per query token, the largest share over query tokens; summed over heads.
    ``q`` [layers, query tokens, heads, dim], ``keys`` [blocks, layers, block tokens, kv heads, dim]."""
    n_blocks, _, bt, _, dim = keys.shape
    total = np.zeros(n_blocks)
    for layer, head in heads:
        k = keys[:, layer, :, head // group].reshape(n_blocks * bt, dim).astype(np.float64)
        logits = q[layer, :, head].astype(np.float64) @ k.T / np.sqrt(dim)
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        total += p.reshape(len(p), n_blocks, bt).sum(axis=2).max(axis=0)
    return total


def index_of(keys: np.ndarray, heads: tuple[tuple[int, int], ...], group: int) -> BlockIndex:
    """A block index over ``keys`` [blocks, layers, tokens, kv heads, dim] holding the heads' keys, as stored."""
    pairs = sorted({(layer, head // group) for layer, head in heads})
    metas = [
        BlockMeta(
            f"h{i}",
            "p",
            np.zeros(keys.shape[2], dtype=np.int32),
            i * keys.shape[2],
            0,
            {
                "head_keys": np.stack([k[layer, :, kv] for layer, kv in pairs]).astype(np.float16),
                "head_pairs": np.asarray(pairs, dtype=np.int16),
            },
        )
        for i, k in enumerate(keys)
    ]
    return BlockIndex.build(metas, keys.shape[2])


@pytest.mark.parametrize("seed", range(5))
def test_retrieval_heads_scores_rank_blocks_as_a_float64_reference(seed):
    rng = np.random.default_rng(seed)
    n_blocks, bt, dim, group = 23, 16, 32, 4
    keys = rng.normal(size=(n_blocks, 3, bt, 2, dim)).astype(np.float16).astype(np.float32)
    q = rng.normal(size=(3, 5, 8, dim)).astype(np.float32) * 2
    planted = rng.integers(n_blocks)
    keys[planted, 1, 3, 0] = q[1, 2, 0] / np.linalg.norm(q[1, 2, 0]) * 6  # one block a head should find
    got = RetrievalHeadsScorer(HEADS).score(QueryFeatures(q, 2), index_of(keys, HEADS, group)).scores
    want = reference_scores(q, keys, HEADS, group)
    assert np.argmax(got) == np.argmax(want) == planted
    # the index keeps keys in int8 (1/254 of each row's range): the scores agree to about that
    assert np.allclose(got, want, rtol=0.03, atol=1e-3)


def test_merge_layers_takes_shallow_layers_from_the_probe_and_deep_ones_from_the_full_forward():
    probed = BlockKV(np.zeros((4, 2, 1, 3), np.float16), np.zeros((4, 2, 1, 3), np.float16))
    full = BlockKV(np.ones((4, 2, 1, 3), np.float16), np.full((4, 2, 1, 3), 2, np.float16))
    deep = deep_layers(full, 1)
    assert deep.k.shape[0] == 2 and np.shares_memory(deep.k, full.k)  # the two layers past the probe's, no copy
    kv = merge_layers(probed, deep, 1)
    assert kv.k.shape == full.k.shape and kv.v.shape == full.v.shape
    assert kv.k[:2].sum() == 0 and (kv.k[2:] == 1).all() and kv.v[:2].sum() == 0 and (kv.v[2:] == 2).all()
    assert (full.k == 1).all() and (probed.k == 0).all(), "neither input is written to"


def test_retrieval_heads_on_several_threads_score_as_on_one():
    from kvmem_llamacpp.scoring import ThreadedHeadsScorer

    rng = np.random.default_rng(3)
    n_blocks, bt, dim, group = 300, 16, 32, 4  # 16-token blocks: 128 a chunk, 3 chunks
    keys = rng.normal(size=(n_blocks, 3, bt, 2, dim)).astype(np.float32)
    q = rng.normal(size=(3, 5, 8, dim)).astype(np.float32)
    index, query = index_of(keys, HEADS, group), QueryFeatures(q, 2)
    one = RetrievalHeadsScorer(HEADS).score(query, index)
    for scorer in (RetrievalHeadsScorer(HEADS, workers=3), ThreadedHeadsScorer(HEADS, 2)):
        got = scorer.score(query, index)
        np.testing.assert_array_equal(got.scores, one.scores)
        np.testing.assert_array_equal(got.peaks, one.peaks)
