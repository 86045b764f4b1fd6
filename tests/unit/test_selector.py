"""Selector: exact choices for small workspaces of 16-token blocks."""

from __future__ import annotations

import numpy as np
import pytest

from kvmem_core.config import KVMemConfig
from kvmem_core.errors import BudgetError, ConfigError
from kvmem_core.layout import BlockMeta
from kvmem_core.retrieval import BlockScores, BlockSpans, Selector

T = 16


def spans(n: int, mandatory=(), groups=None) -> BlockSpans:
    s = BlockSpans.uniform(n, T)
    s.mandatory[list(mandatory)] = True
    if groups:
        for g, members in enumerate(groups):
            s.groups[list(members)] = g
    return s


def scores(values, peaks=None) -> BlockScores:
    values = np.asarray(values, dtype=np.float64)
    return BlockScores(values, np.full(len(values), -1, np.int32) if peaks is None else np.asarray(peaks, np.int32))


def test_mandatory_first_then_by_score():
    sel = Selector(budget=5 * T, sink_tokens=T, recent_tokens=T, edge_tokens=4)
    got = sel.select(spans(10), scores([0, 5, 1, 9, 2, 8, 3, 7, 4, 6]))
    assert got.blocks == (0, 3, 5, 7, 9)
    assert got.mandatory == (0, 9)
    assert got.tokens == 5 * T


def test_ties_prefer_the_later_block():
    sel = Selector(budget=4 * T, sink_tokens=T, recent_tokens=T)
    got = sel.select(spans(8), scores([1, 1, 1, 1, 1, 1, 1, 1]))
    assert got.blocks == (0, 5, 6, 7)


def test_tagged_blocks_and_live_tail_are_mandatory():
    sel = Selector(budget=5 * T, sink_tokens=0, recent_tokens=T)
    got = sel.select(spans(10, mandatory=(2,)), scores([9, 0, 0, 0, 0, 8, 0, 0, 0, 0]), tail_tokens=T)
    assert got.blocks == (0, 2, 5, 9)
    assert got.tokens + got.tail_tokens == 5 * T


def test_peak_at_an_edge_brings_the_neighbour():
    sel = Selector(budget=6 * T, sink_tokens=T, recent_tokens=T, edge_tokens=4)
    got = sel.select(
        spans(12), scores([0, 0, 0, 9, 0, 0, 0, 8, 0, 0, 0, 0], peaks=[-1, 0, 0, 2, 0, 0, 0, 13, 0, 0, 0, 0])
    )
    assert got.blocks == (0, 2, 3, 7, 8, 11)
    assert got.expanded == (2, 8)


def test_peak_inside_a_block_takes_it_alone():
    sel = Selector(budget=4 * T, sink_tokens=T, recent_tokens=T, edge_tokens=4)
    got = sel.select(spans(12), scores([0, 0, 0, 0, 0, 9, 0, 0, 0, 0, 0, 1], peaks=[8] * 12))
    assert got.blocks == (0, 5, 10, 11)
    assert got.expanded == ()


def test_atomic_group_whole_or_skipped():
    sel = Selector(budget=5 * T, sink_tokens=T, recent_tokens=T)
    # group {3,4,5} scores highest but needs 3 blocks when 3 are left: taken whole
    got = sel.select(spans(10, groups=[(3, 4, 5)]), scores([0, 1, 2, 0, 9, 0, 0, 0, 0, 0]))
    assert got.blocks == (0, 3, 4, 5, 9)
    # with 2 blocks left the group is skipped and the next blocks by score fill in
    sel = Selector(budget=4 * T, sink_tokens=T, recent_tokens=T, relevance=0.0)
    got = sel.select(spans(10, groups=[(3, 4, 5)]), scores([0, 1, 2, 0, 9, 0, 0, 0, 0, 0]))
    assert got.blocks == (0, 1, 2, 9)


def test_blocks_far_below_the_best_give_way_to_the_newest():
    sel = Selector(budget=6 * T, sink_tokens=T, recent_tokens=T, relevance=0.35)
    got = sel.select(spans(12), scores([0, 3, 2, 10, 3, 4, 3, 2, 1, 0, 0, 0]))
    assert got.blocks == (0, 3, 5, 9, 10, 11)  # 3 and 5 by score (4 >= 3.5), then the newest
    every = Selector(budget=6 * T, sink_tokens=T, recent_tokens=T, relevance=0.0)
    assert every.select(spans(12), scores([0, 3, 2, 10, 3, 4, 3, 2, 1, 0, 0, 0])).blocks == (0, 3, 4, 5, 6, 11)
    cfg = KVMemConfig(budget=6 * T, sink_tokens=T, recent_tokens=T, relevance=0.0)
    assert Selector.from_config(cfg) == every  # --kvmem-relevance reaches the selector
    with pytest.raises(ConfigError, match="--kvmem-relevance must be between 0 and 1"):
        KVMemConfig(relevance=1.5)


def test_mandatory_over_budget_raises():
    sel = Selector(budget=3 * T, sink_tokens=T, recent_tokens=T)
    with pytest.raises(BudgetError, match="mandatory spans need 64 tokens"):
        sel.select(spans(10, mandatory=(4,)), scores(np.zeros(10)), tail_tokens=T)
    with pytest.raises(BudgetError):
        sel.select(spans(10, groups=[(7, 8, 9)]), scores(np.zeros(10)))  # the recent window pulls the group in
    assert sel.select(spans(10, groups=[(8, 9)]), scores(np.zeros(10))).blocks == (0, 8, 9)


def test_budget_covering_everything_selects_everything():
    sel = Selector(budget=10 * T + 5, sink_tokens=T, recent_tokens=T)
    assert sel.select(spans(10), scores(np.zeros(10)), tail_tokens=5).blocks == tuple(range(10))


def test_baselines():
    sel = Selector(budget=4 * T, sink_tokens=T, recent_tokens=T)
    assert sel.select(spans(10), None, method="recent").blocks == (6, 7, 8, 9)
    assert sel.select(spans(10), None, method="sink-recent").blocks == (0, 7, 8, 9)
    assert sel.select(spans(4), None, method="full").blocks == (0, 1, 2, 3)
    with pytest.raises(BudgetError, match="method full needs 80 tokens"):
        sel.select(spans(5), None, method="full")
    with pytest.raises(ConfigError):
        sel.select(spans(5), None, method="retrieval")


def test_spans_from_metas_and_config():
    ids = np.zeros(T, np.int32)
    tags = [
        frozenset(),
        frozenset({"mandatory"}),
        frozenset({"atomic:img1"}),
        frozenset({"atomic:img1"}),
        frozenset({"atomic:t2"}),
    ]
    metas = [BlockMeta(f"{i:032x}", "0" * 32, ids[: T - (i == 4)], i * T, 0, tags=t) for i, t in enumerate(tags)]
    s = BlockSpans.from_metas(metas)
    assert s.n_tokens.tolist() == [T, T, T, T, T - 1]
    assert s.mandatory.tolist() == [False, True, False, False, False]
    assert s.groups.tolist() == [-1, -1, 0, 0, 1]
    sel = Selector.from_config(KVMemConfig())
    assert (sel.budget, sel.sink_tokens, sel.recent_tokens) == (2048, 128, 512)
    assert sel.select(s, scores(np.zeros(5)), tail_tokens=100).to_dict()["blocks"] == [0, 1, 2, 3, 4]
