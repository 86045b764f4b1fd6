"""Semantic groups: which messages form one, which group each block belongs to, the spans a step keeps."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmem.tools_format import render_plain
from kvmem_core.groups import block_groups, covered, message_groups, overlapping, token_groups

CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}
    ],
}
AGENT = [
    {"role": "system", "content": "You help."},
    {"role": "user", "content": "Why is the build slow?"},
    CALL,
    {"role": "tool", "tool_call_id": "call_1", "content": "x = 1"},
    {"role": "tool", "tool_call_id": "call_2", "content": "y = 2"},
    {"role": "assistant", "content": "Nothing there."},
    {"role": "user", "content": "And now?"},
]


def test_a_tool_call_keeps_its_results_and_every_turn_is_a_group() -> None:
    assert message_groups(AGENT) == [(0, 1), (1, 2), (2, 5), (5, 6), (6, 7)]


def test_the_plain_rendering_of_tools_groups_alike() -> None:
    plain = render_plain(AGENT, None)
    assert [m["role"] for m in plain[2:5]] == ["assistant", "user", "user"]  # the results became user turns
    assert message_groups(plain) == message_groups(AGENT)


def test_a_result_after_a_user_turn_stands_alone() -> None:
    assert message_groups([{"role": "user", "content": "?"}, {"role": "tool", "content": "r"}]) == [(0, 1), (1, 2)]


def test_token_groups_span_their_messages_and_skip_empty_ones() -> None:
    starts, ends = [0, 10, 30, 60, 80, 95, 95], [10, 30, 60, 80, 95, 95, 120]
    assert token_groups(AGENT, starts, ends) == ((0, 10), (10, 30), (30, 95), (95, 120))


def test_a_straddling_block_belongs_to_the_group_with_most_of_its_tokens() -> None:
    # blocks of 32: [0,32) all group 0's; [32,64) 8 of group 0, 24 of group 1; [64,96) 16 each: the earlier wins
    assert block_groups([(0, 40), (40, 80), (80, 200)], 4, 32).tolist() == [0, 1, 1, 2]
    assert block_groups([(5, 10)], 3, 32).tolist() == [0, -1, -1]
    assert block_groups([(40, 300)], 3, 32).tolist() == [-1, 0, 0]  # groups past the stored blocks are cut


def test_overlapping_marks_every_block_a_span_touches_and_covered_counts_the_union() -> None:
    assert overlapping([(0, 1), (63, 65), (200, 900)], 8, 32).tolist() == [1, 1, 1, 0, 0, 0, 1, 1]
    assert not overlapping([(10, 10)], 2, 32).any()
    assert covered([(0, 10), (5, 20), (30, 31), (30, 31)]) == 21
    assert covered([]) == 0


@st.composite
def partitions(draw):
    """Sorted, disjoint spans (gaps and empty spans allowed), a block size and a block count that may cut them."""
    cuts = sorted(draw(st.lists(st.integers(0, 500), max_size=24)))
    spans = list(zip(cuts[::2], cuts[1::2])) or [(0, 1)]
    bt = draw(st.sampled_from([8, 16, 64]))
    return spans, bt, draw(st.integers(0, -(-spans[-1][1] // bt) + 2))


@settings(max_examples=300, deadline=None)
@given(partitions())
def test_block_groups_give_each_block_its_largest_overlap_and_keep_groups_contiguous(case) -> None:
    spans, bt, n = case
    got = block_groups(spans, n, bt)
    for b in range(n):
        overlap = [max(0, min(e, (b + 1) * bt) - max(s, b * bt)) for s, e in spans]
        assert got[b] == (int(np.argmax(overlap)) if max(overlap) > 0 else -1)  # argmax: the first of equals
    for g in set(got.tolist()) - {-1}:
        members = np.flatnonzero(got == g)
        assert members.tolist() == list(range(members[0], members[-1] + 1))
