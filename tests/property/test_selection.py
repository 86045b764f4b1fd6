"""Selector properties over random workspaces, tags, groups, scores and budgets."""
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
    values = draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.5]), min_size=n, max_size=n))
    peaks = draw(st.lists(st.integers(-1, block - 1), min_size=n, max_size=n))
    selector = Selector(
        budget=draw(st.integers(1, block * n + 40)),
        sink_tokens=draw(st.integers(0, 2 * block)),
        recent_tokens=draw(st.integers(0, 3 * block)),
        edge_tokens=draw(st.integers(0, block // 2)),
    )
    case = dict(
        spans=BlockSpans(n_tokens, mandatory, groups),
        scores=BlockScores(np.array(values), np.array(peaks, dtype=np.int32)),
        tail=draw(st.integers(0, 20)),
        method=draw(st.sampled_from(METHODS)),
    )
    return selector, case


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
    again = selector.select(spans, BlockScores(c["scores"].scores.copy(), c["scores"].peaks.copy()), tail, c["method"])
    assert again == sel
    if int(spans.n_tokens.sum()) + tail <= selector.budget:
        assert blocks == list(range(len(spans)))
