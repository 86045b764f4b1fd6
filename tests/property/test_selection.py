"""Selector properties over random workspaces, tags, atomic and message groups, scores and budgets."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmem_core.errors import BudgetError
from kvmem_core.retrieval import BlockScores, BlockSpans, Selector

METHODS = ("retrieval", "recent", "sink-recent")


@st.composite
def cases(draw):
    n = draw(st.integers(1, 40))
    block = draw(st.sampled_from([8, 16]))
    n_tokens = np.full(n, block, dtype=np.int64)
    n_tokens[-1] = draw(st.integers(1, block))  # newest block may be partial
    mandatory = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n))) & (draw(st.integers(0, 3)) == 0)
    groups = np.full(n, -1, dtype=np.int64)
    for g in range(draw(st.integers(0, 3))):
        start = draw(st.integers(0, n - 1))
        groups[start : start + draw(st.integers(1, 4))] = g
    turns = draw(message_groups(n)) if draw(st.booleans()) else None
    values = draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.5]), min_size=n, max_size=n))
    peaks = draw(st.lists(st.integers(-1, block - 1), min_size=n, max_size=n))
    selector = Selector(
        budget=draw(st.integers(1, block * n + 40)),
        sink_tokens=draw(st.integers(0, 2 * block)),
        recent_tokens=draw(st.integers(0, 3 * block)),
        edge_tokens=draw(st.integers(0, block // 2)),
    )
    case = dict(
        spans=BlockSpans(n_tokens, mandatory, groups, turns),
        scores=BlockScores(np.array(values), np.array(peaks, dtype=np.int32)),
        tail=draw(st.integers(0, 20)),
        method=draw(st.sampled_from(METHODS)),
    )
    return selector, case


@st.composite
def message_groups(draw, n: int) -> np.ndarray:
    """Contiguous runs of blocks, a few blocks in none."""
    cuts = sorted(set(draw(st.lists(st.integers(1, n), max_size=8))) | {n})
    turns = np.full(n, -1, dtype=np.int64)
    for g, (a, b) in enumerate(zip([0, *cuts], cuts)):
        turns[a:b] = g if draw(st.integers(0, 4)) else -1
    return turns


@st.composite
def grouped_cases(draw):
    """Retrieval over message groups with a budget of a quarter to three quarters of the workspace."""
    n = draw(st.integers(4, 40))
    block = 16
    n_tokens = np.full(n, block, dtype=np.int64)
    n_tokens[-1] = draw(st.integers(1, block))
    selector = Selector(
        budget=draw(st.integers(n * block // 4, 3 * n * block // 4)),
        sink_tokens=block,
        recent_tokens=block,
        edge_tokens=draw(st.integers(0, block // 2)),
        relevance=draw(st.sampled_from([0.0, 0.35])),
    )
    spans = BlockSpans(n_tokens, np.zeros(n, bool), np.full(n, -1, np.int64), draw(message_groups(n)))
    values = draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.5]), min_size=n, max_size=n))
    peaks = draw(st.lists(st.integers(-1, block - 1), min_size=n, max_size=n))
    return selector, spans, BlockScores(np.array(values), np.array(peaks, dtype=np.int32)), draw(st.integers(0, 15))


def mandatory_blocks(selector: Selector, spans: BlockSpans, method: str) -> set[int]:
    """Written out plainly: tagged, sink (unless plain recency), recent window, closed over groups."""
    ends = np.cumsum(spans.n_tokens)
    starts = ends - spans.n_tokens
    out = set()
    for b in range(len(spans)):
        sink = method != "recent" and starts[b] < selector.sink_tokens
        recent = ends[b] > ends[-1] - selector.recent_tokens
        if spans.mandatory[b] or sink or recent:
            out.add(b)
    for b in list(out):
        if spans.groups[b] >= 0:
            out.update(np.flatnonzero(spans.groups == spans.groups[b]).tolist())
    return out


@settings(max_examples=300, deadline=None)
@given(cases())
def test_selection_properties(case):
    selector, c = case
    spans, tail = c["spans"], c["tail"]
    must = mandatory_blocks(selector, spans, c["method"])
    need = int(spans.n_tokens[sorted(must)].sum()) + tail
    try:
        sel = selector.select(spans, c["scores"], tail, c["method"])
    except BudgetError:
        assert need > selector.budget
        return
    assert need <= selector.budget
    blocks = list(sel.blocks)
    assert sel.tokens == int(spans.n_tokens[blocks].sum())
    assert sel.tokens + tail <= selector.budget
    assert blocks == sorted(set(blocks))  # chronological, no duplicates
    assert must <= set(blocks)
    for g in set(spans.groups[spans.groups >= 0].tolist()):
        members = set(np.flatnonzero(spans.groups == g).tolist())
        assert members <= set(blocks) or not members & set(blocks)
    if c["method"] == "retrieval" and spans.turns is not None:
        check_whole_turns(spans, must, blocks, selector.budget - tail - sel.tokens, (selector.budget - need) // 2)
    again = selector.select(spans, BlockScores(c["scores"].scores.copy(), c["scores"].peaks.copy()), tail, c["method"])
    assert again == sel
    if int(spans.n_tokens.sum()) + tail <= selector.budget:
        assert blocks == list(range(len(spans)))


@settings(max_examples=300, deadline=None)
@given(grouped_cases())
def test_message_groups_come_whole_within_budget_and_in_order(case):
    selector, spans, scores, tail = case
    must = mandatory_blocks(selector, spans, "retrieval")
    need = int(spans.n_tokens[sorted(must)].sum()) + tail
    try:
        sel = selector.select(spans, scores, tail)
    except BudgetError:
        assert need > selector.budget
        return
    blocks = list(sel.blocks)
    assert blocks == sorted(set(blocks)) and must <= set(blocks)
    assert sel.tokens + tail <= selector.budget
    check_whole_turns(spans, must, blocks, selector.budget - tail - sel.tokens, (selector.budget - need) // 2)


def check_whole_turns(spans: BlockSpans, must: set[int], blocks: list[int], room: int, cap: int) -> None:
    """A message group of at most ``cap`` tokens (half the budget left after the mandatory spans) is in the
    selection whole or not at all, its mandatory blocks aside, unless the newest-first fill cut it: then
    what it lacks is older than what it has, and did not fit the ``room`` left. Groups sharing a block
    with an atomic group are not checked (that group's closure may take the block alone)."""
    atomic = set(np.flatnonzero(spans.groups >= 0).tolist())
    for g in set(spans.turns[spans.turns >= 0].tolist()):
        members = set(np.flatnonzero(spans.turns == g).tolist())
        if members & atomic or int(spans.n_tokens[sorted(members)].sum()) > cap:
            continue
        taken, missing = (members - must) & set(blocks), (members - must) - set(blocks)
        if taken and missing:
            assert max(missing) < min(taken), (g, sorted(members), blocks)
            assert room < int(spans.n_tokens[sorted(missing)].min()), (g, sorted(members), blocks, room)
