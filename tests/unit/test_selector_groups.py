"""Selector with message groups: a group comes whole with a block retrieval takes, a group over half the free
budget comes as the blocks around it, and mandatory spans and the baselines ignore groups."""

from __future__ import annotations

import numpy as np

from kvmem_core.retrieval import BlockScores, BlockSpans, Selector

T = 16
N = 12
SEL = Selector(budget=8 * T, sink_tokens=T, recent_tokens=T)  # blocks 0 and 11 mandatory: 6 free, cap 3


def spans(*turns: tuple[int, ...], mandatory: tuple[int, ...] = ()) -> BlockSpans:
    groups = np.full(N, -1, np.int64)
    for g, members in enumerate(turns):
        groups[list(members)] = g
    s = BlockSpans.uniform(N, T)
    s.mandatory[list(mandatory)] = True
    return s.for_step(np.zeros(N, bool), groups)


def best(*blocks: int, peaks: dict[int, int] | None = None) -> BlockScores:
    values = np.zeros(N)
    values[list(blocks)] = 9.0
    at = np.full(N, -1, np.int32)
    for b, p in (peaks or {}).items():
        at[b] = p
    return BlockScores(values, at)


def test_a_group_within_the_cap_comes_whole_with_its_scored_block() -> None:
    got = SEL.select(spans((3, 4, 5)), best(4))
    assert got.blocks == (0, 3, 4, 5, 8, 9, 10, 11)
    assert {3, 5} <= set(got.expanded)
    plain = SEL.select(BlockSpans.uniform(N, T), best(4))
    assert plain.blocks == (0, 4, 6, 7, 8, 9, 10, 11)


def test_a_group_over_the_cap_brings_the_blocks_around_the_scored_one() -> None:
    got = SEL.select(spans(tuple(range(2, 10))), best(6))
    # by score: 6 with 5 (before first) and 7, up to the cap of 3 blocks; then the newest: 10, 9, 8
    assert got.blocks == (0, 5, 6, 7, 8, 9, 10, 11)


def test_an_edge_neighbour_brings_its_own_group() -> None:
    got = SEL.select(spans((2, 3), (4, 5)), best(4, peaks={4: 0}))  # the peak at 4's start takes 3, and 3's group
    assert {2, 3, 4, 5} <= set(got.blocks)


def test_mandatory_blocks_do_not_pull_their_groups() -> None:
    tight = Selector(budget=4 * T, sink_tokens=T, recent_tokens=T)  # 0, 3 and 11 mandatory: one block free
    got = tight.select(spans((3, 4, 5), mandatory=(3,)), best(8))
    assert got.blocks == (0, 3, 8, 11) and got.mandatory == (0, 3, 11)


def test_the_baselines_ignore_groups() -> None:
    for method in ("recent", "sink-recent"):
        grouped = SEL.select(spans((1, 2, 3, 4, 5)), None, method=method)
        assert grouped == SEL.select(BlockSpans.uniform(N, T), None, method=method)
