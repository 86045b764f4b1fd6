"""Scorers on planted needles, summaries and the block index."""

from __future__ import annotations

import numpy as np
import pytest

from kvmem_core.layout import BlockMeta
from kvmem_core.retrieval import (
    BlockIndex,
    MissingSummaryError,
    QueryFeatures,
    SummaryOptions,
    make_scorer,
    summarize_block,
)
from kvmem_core.retrieval.index import quantize_int8
from kvmem_core.retrieval.summaries import key_prototypes

SUMMARY_SCORERS = ("mean-k", "sub-block-mean-k", "key-direction")


class Keys:
    def __init__(self, blocks: list[np.ndarray]) -> None:
        self.blocks = {f"{i:032x}": k for i, k in enumerate(blocks)}

    def content_keys(self, chain_hash: str) -> np.ndarray:
        return self.blocks[chain_hash]


def build(blocks: list[np.ndarray], heads, group: int) -> tuple[BlockIndex, list[BlockMeta]]:
    opts = SummaryOptions(group_size=group)
    metas = []
    for i, k in enumerate(blocks):
        ids = np.arange(k.shape[1], dtype=np.int32)
        metas.append(BlockMeta(f"{i:032x}", "0" * 32, ids, i * k.shape[1], 0, summarize_block(k, heads, opts)))
    return BlockIndex.build(metas, blocks[0].shape[1]), metas


def scorer(name: str, heads, blocks):
    return make_scorer(name, heads, Keys(blocks))


@pytest.mark.parametrize("name", ["retrieval-heads", "per-token", *SUMMARY_SCORERS])
def test_planted_needle_ranks_first(name):
    rng = np.random.default_rng(3)
    n_layers, n_heads, n_kv, dim, n_q = 2, 4, 2, 32, 4
    q = rng.standard_normal((n_layers, n_q, n_heads, dim)).astype(np.float32)
    blocks = [rng.standard_normal((n_layers, 16, n_kv, dim)).astype(np.float32) for _ in range(24)]
    for layer in range(n_layers):
        for kv in range(n_kv):
            direction = q[layer, :, 2 * kv : 2 * kv + 2].sum(axis=(0, 1))
            direction /= np.linalg.norm(direction)
            blocks[13][layer, :, kv] = 4 * direction + 0.1 * rng.standard_normal((16, dim))
    heads = ((0, 1), (1, 2))
    index, _ = build(blocks, heads, group=2)
    got = scorer(name, heads, blocks).score(QueryFeatures(q, n_kv), index)
    assert int(np.argmax(got.scores)) == 13


def few_heads_case():
    """A fact seen by one head (layer 2, query head 5) and a decoy block every other head likes.

    The fact: one key (block 21, offset 7) matches one query token (the entity name, token 3)
    of head (2, 5). The decoy: block 9 matches the shared query direction of every other head
    (the *format* of facts), which is what averaging over heads and query tokens rewards.
    """
    rng = np.random.default_rng(11)
    n_layers, n_heads, n_kv, dim, n_q = 4, 8, 4, 32, 8
    q = rng.standard_normal((n_layers, n_q, n_heads, dim)).astype(np.float32)
    blocks = [rng.standard_normal((n_layers, 16, n_kv, dim)).astype(np.float32) for _ in range(32)]
    for layer in range(n_layers):
        for kv in range(n_kv):
            if (layer, kv) == (2, 2):
                continue
            w = rng.standard_normal(dim).astype(np.float32)
            w /= np.linalg.norm(w)
            q[layer, :, 2 * kv : 2 * kv + 2] = 3 * w + 0.3 * rng.standard_normal((n_q, 2, dim))
            blocks[9][layer, :, kv] = 3 * w + 0.3 * rng.standard_normal((16, dim))
    entity = q[2, 3, 5] / np.linalg.norm(q[2, 3, 5])
    blocks[21][2, 7, 2] = 12 * entity
    return q, blocks, n_kv


def test_retrieval_heads_find_a_fact_that_averaging_misses():
    q, blocks, n_kv = few_heads_case()
    heads = ((2, 5),)
    index, _ = build(blocks, heads, group=2)
    query = QueryFeatures(q, n_kv)
    found = scorer("retrieval-heads", heads, blocks).score(query, index)
    assert int(np.argmax(found.scores)) == 21
    assert int(found.peaks[21]) == 7
    for name in ("per-token", *SUMMARY_SCORERS):
        averaged = scorer(name, heads, blocks).score(query, index).scores
        assert int(np.argmax(averaged)) == 9, name
        assert averaged[21] < averaged[9], name
    # Why: the fact draws one (head, query token) row's mass, and scoring only its head keeps
    # it visible; summed over all 4 layers x 8 heads x 8 query tokens = 256 rows it adds about
    # 1 to block 21 while the decoy, liked by most rows, gains over 20.
    rows = scorer("per-token", heads, blocks).score(query, index).scores * 4 * 8
    assert 0.5 < rows[21] - np.median(rows) < 1.5
    assert rows[9] - np.median(rows) > 20
    assert found.scores[21] - np.median(found.scores) > 0.9


def test_retrieval_heads_need_their_keys_in_the_index():
    rng = np.random.default_rng(0)
    blocks = [rng.standard_normal((2, 16, 2, 8)).astype(np.float32) for _ in range(3)]
    index, _ = build(blocks, ((0, 1),), group=2)
    query = QueryFeatures(rng.standard_normal((2, 2, 4, 8)).astype(np.float32), 2)
    assert index.head_pairs == ((0, 0),)
    make_scorer("retrieval-heads", ((0, 0), (0, 1))).score(query, index)  # same kv head: fine
    with pytest.raises(MissingSummaryError, match=r"\(1, 1\)"):
        make_scorer("retrieval-heads", ((1, 3),)).score(query, index)


def test_summaries_shapes_and_sizes():
    rng = np.random.default_rng(1)
    k = rng.standard_normal((30, 128, 3, 64)).astype(np.float32)
    s = summarize_block(k, ((10, 2), (17, 4), (24, 8), (24, 7)), SummaryOptions(group_size=3))
    assert s["mean_k"].shape == (30, 3, 64) and s["mean_k"].dtype == np.float16
    assert s["sub_mean_k"].shape == (30, 3, 4, 64)
    assert s["protos"].shape == (30, 3, 4, 64)
    assert s["head_pairs"].tolist() == [[10, 0], [17, 1], [24, 2]]
    np.testing.assert_array_equal(s["head_keys"][1], k[17, :, 1].astype(np.float16))
    np.testing.assert_allclose(s["sub_mean_k"][4, 2, 1], k[4, 32:64, 2].mean(axis=0), atol=1e-3)
    kv_bytes = 2 * k.size * 2
    assert s["head_keys"].nbytes / kv_bytes == pytest.approx(3 / 180)


def test_prototype_count_follows_residual_gain():
    rng = np.random.default_rng(2)
    dim = 32
    axes = np.eye(dim, dtype=np.float32)
    one = axes[0] + 0.01 * rng.standard_normal((64, dim))
    two = np.concatenate(
        [axes[0] + 0.01 * rng.standard_normal((32, dim)), axes[1] + 0.01 * rng.standard_normal((32, dim))]
    )
    four = np.concatenate([axes[i] + 0.01 * rng.standard_normal((16, dim)) for i in range(4)])
    k = np.stack([one, two, four])[None].transpose(0, 2, 1, 3).astype(np.float32)  # [1, 64, 3, dim]
    protos = key_prototypes(k, gain=0.25, iters=6)[0]  # [3 slices, 4, dim]
    distinct = [len({tuple(np.round(p, 3)) for p in slice_}) for slice_ in protos]
    assert distinct == [1, 2, 4]
    np.testing.assert_allclose(np.linalg.norm(protos, axis=-1), 1.0, rtol=1e-5)
    assert np.abs(protos[2] @ axes[:4].T).max(axis=0).min() > 0.99  # one prototype per axis


def test_index_sync_appends_and_rebuilds_on_divergence():
    rng = np.random.default_rng(4)
    blocks = [rng.standard_normal((1, 16, 1, 8)).astype(np.float32) for _ in range(6)]
    _, metas = build(blocks, ((0, 0),), group=1)
    index = BlockIndex(16)
    index.sync(metas[:2])
    index.sync(metas[:5])
    assert index.hashes == [m.chain_hash for m in metas[:5]]
    np.testing.assert_array_equal(index.get("mean_k")[0, 0, 4], metas[4].summary["mean_k"][0, 0])
    forked = metas[:3] + [metas[5]]
    index.sync(forked)
    assert index.hashes == [m.chain_hash for m in forked]
    np.testing.assert_array_equal(index.get("mean_k")[0, 0, 3], metas[5].summary["mean_k"][0, 0])
    assert index.get("head_keys").shape == (1, 4, 16, 8)


def test_index_follows_its_chain_and_stacks_a_summary_once_read():
    rng = np.random.default_rng(5)
    opts, metas, parent = SummaryOptions(group_size=1), [], "0" * 32
    for i in range(5):
        k = rng.standard_normal((2, 16, 1, 8)).astype(np.float32)
        metas.append(
            BlockMeta(
                f"{i + 1:032x}", parent, np.arange(16, dtype=np.int32), 16 * i, 0, summarize_block(k, ((1, 0),), opts)
            )
        )
        parent = metas[-1].chain_hash
    index = BlockIndex(16)
    index.follow(metas[0])
    assert index.n_blocks == 0  # an empty index is built by ``sync`` when a step first scores
    index.sync(metas[:2])
    index.follow(metas[3])  # does not continue the indexed blocks
    assert index.hashes == [m.chain_hash for m in metas[:2]]
    index.follow(metas[2])
    assert index.get("head_keys").shape == (1, 3, 16, 8)  # stacked now, over the three
    index.follow(metas[3])
    index.follow(metas[4])
    assert index.hashes == [m.chain_hash for m in metas] and index.has("head_scale") and not index.has("x")
    keys = index.get("head_keys") * index.get("head_scale")[..., None]
    for i, meta in enumerate(metas):
        codes, scale = quantize_int8(meta.summary["head_keys"])
        np.testing.assert_array_equal(keys[:, i], codes * scale[..., None])
        np.testing.assert_array_equal(index.get("mean_k")[:, :, i], meta.summary["mean_k"])
        np.testing.assert_array_equal(index.get("protos")[:, :, i], meta.summary["protos"])
    index.truncate(0)
    with pytest.raises(MissingSummaryError):
        index.get("mean_k")


def test_int8_keys_error_bound_and_exact_grid():
    rng = np.random.default_rng(9)
    x = rng.standard_normal((3, 50, 64)).astype(np.float32) * rng.uniform(0.01, 100, (3, 50, 1)).astype(np.float32)
    codes, scale = quantize_int8(x)
    assert codes.dtype == np.int8 and scale.shape == (3, 50)
    assert (np.log2(scale) == np.round(np.log2(scale))).all()  # powers of two
    err = np.abs(codes * scale[..., None] - x).max(axis=-1)
    assert (err <= np.abs(x).max(axis=-1) / 128 + 1e-6).all()
    grid = rng.integers(-16, 17, (4, 64)) / 8
    codes, scale = quantize_int8(grid)
    np.testing.assert_array_equal(codes * scale[:, None], grid)
    codes, scale = quantize_int8(np.zeros((1, 8)))
    assert (codes == 0).all() and np.isfinite(scale).all()


@pytest.mark.parametrize("name", ["retrieval-heads", "per-token", *SUMMARY_SCORERS])
def test_empty_workspace_scores_nothing(name):
    query = QueryFeatures(np.ones((2, 1, 4, 8), np.float32), 2)
    got = scorer(name, ((0, 0),), []).score(query, BlockIndex(16))
    assert got.scores.shape == (0,) and got.peaks.shape == (0,)


def test_a_reserved_index_never_copies_itself_and_falls_back_to_doubling_where_memory_is_refused(monkeypatch):
    rng = np.random.default_rng(6)
    blocks = [rng.standard_normal((1, 16 - 5 * (i == 9), 1, 8)).astype(np.float32) for i in range(10)]
    _, metas = build(blocks, ((0, 0),), group=1)
    plain, reserved = BlockIndex(16), BlockIndex(16)
    reserved.reserve(1 << 20)  # 1M blocks: 128 MiB of keys, never written
    for index in (plain, reserved):
        index.sync(metas[:1])
        index.get("head_keys")
    arrays = reserved.get("head_keys").base
    for n in range(2, 11):
        plain.sync(metas[:n])
        reserved.sync(metas[:n])
    assert reserved.capacity == 1 << 20 and plain.capacity < 64 and reserved.get("head_keys").base is arrays
    for name in ("head_keys", "head_scale", "mean_k"):
        np.testing.assert_array_equal(reserved.get(name), plain.get(name))
    np.testing.assert_array_equal(reserved.n_tokens, plain.n_tokens)
    reserved.sync(metas[1:4])  # a divergence rebuilds the index: the reservation holds
    assert reserved.capacity == 1 << 20 and reserved.n_blocks == 3

    zeros = np.zeros

    def refusing(shape, dtype=float):  # as an OS without that much address space to give: large arrays refused
        if np.prod(shape) * np.dtype(dtype).itemsize > 1 << 23:
            raise MemoryError
        return zeros(shape, dtype=dtype)

    monkeypatch.setattr(np, "zeros", refusing)
    refused = BlockIndex(16)
    refused.reserve(1 << 20)
    refused.sync(metas)
    np.testing.assert_array_equal(refused.get("head_keys"), plain.get("head_keys"))
    assert refused.capacity == 64  # as an index without a reservation starts
