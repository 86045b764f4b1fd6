"""Prompt-lookup drafting: a draft is always what followed an earlier occurrence of the history's last n-gram
(the largest n with one, its newest occurrence), and there is no draft without such an occurrence."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvmem_core.lookup import LookupDrafter
from kvmem_core.speculative import accepted_prefix

histories = st.lists(st.integers(0, 5), min_size=0, max_size=80)  # a small alphabet: many repeats
sizes = st.tuples(st.integers(1, 4), st.integers(0, 3), st.integers(1, 10))  # ngram_min, extra, k


def reference(ids: list[int], ngram_min: int, ngram_max: int, k: int) -> list[int]:
    """The definition, by brute force: largest n first, newest earlier match first."""
    for n in range(ngram_max, ngram_min - 1, -1):
        if n >= len(ids):
            continue
        tail = ids[-n:]
        for i in range(len(ids) - n - 1, -1, -1):
            if ids[i : i + n] == tail:
                return ids[i + n : i + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(histories, sizes)
def test_a_draft_is_the_newest_continuation_of_the_longest_matching_ngram(
    ids: list[int], size: tuple[int, int, int]
) -> None:
    ngram_min, extra, k = size
    drafter = LookupDrafter(ids, k=k, ngram_min=ngram_min, ngram_max=ngram_min + extra)
    draft = drafter.propose()
    assert draft == reference(ids, ngram_min, ngram_min + extra, k)
    assert len(draft) <= k
    if draft:  # a continuation found in the history, right after an occurrence of the history's last n-gram
        assert any(
            ids[i : i + len(draft)] == draft and ids[i - n : i] == ids[-n:]
            for n in range(ngram_min, ngram_min + extra + 1)
            for i in range(n, len(ids))
        )


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 1000), unique=True, max_size=60), st.integers(1, 4))
def test_no_draft_without_a_repeated_ngram(ids: list[int], ngram_min: int) -> None:
    assert LookupDrafter(ids, ngram_min=ngram_min).propose() == []


@settings(max_examples=200, deadline=None)
@given(histories, st.lists(st.integers(0, 5), max_size=40), st.integers(0, 12))
def test_extending_equals_starting_from_the_longer_history(ids: list[int], more: list[int], limit: int) -> None:
    grown = LookupDrafter(ids)
    for t in more:
        grown.extend([t])
    assert grown.tokens.tolist() == ids + more
    assert grown.propose(limit) == LookupDrafter(ids + more).propose(limit)


def test_only_the_leading_greedy_choices_are_accepted() -> None:
    import numpy as np

    logits = np.zeros((4, 6), dtype=np.float32)
    logits[[0, 1, 2, 3], [3, 1, 4, 0]] = 1.0  # greedy picks 3, then 1, then 4, then 0
    assert accepted_prefix(logits, [3, 1, 4]) == 3
    assert accepted_prefix(logits, [3, 2, 4]) == 1  # a wrong token ends the prefix, whatever follows it
    assert accepted_prefix(logits, [5, 1, 4]) == 0
