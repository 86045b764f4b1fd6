"""Which control tokens are clean cuts for incremental tokenization, and the chunked common-prefix length."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmem_core.tokens import clean_cuts, common_prefix

CHATML = {"<|im_start|>": 1, "<|im_end|>": 2, "<|endoftext|>": 0}


def test_chatml_control_tokens_are_all_clean_cuts() -> None:
    assert clean_cuts(CHATML, CHATML) == CHATML


@pytest.mark.parametrize(
    ("other", "why"),
    [
        ("<|im_start|>x", "a longer token starting with it: the occurrence may be that token"),
        ("im_start|>!", "a token starting inside it"),
        ("start|>", "a token starting inside it and ending with it"),
        ("x<|im", "a token reaching into it from before"),
        ("x<|im_start|>y", "a token containing it"),
        ("<|im_start|>", "a second token of the same text"),
    ],
)
def test_a_token_that_can_overlap_an_occurrence_spoils_the_cut(other: str, why: str) -> None:
    cuts = clean_cuts(CHATML, [*CHATML, other])
    assert "<|im_start|>" not in cuts, why
    assert "<|endoftext|>" in cuts


def test_a_shorter_token_it_starts_with_leaves_it_clean() -> None:
    """Both tokenizers take the longer match where both start (llama.cpp cuts at longer tokens first)."""
    assert clean_cuts({"<a>b": 7}, ["<a>b", "<a>"]) == {"<a>b": 7}


def test_a_token_that_overlaps_itself_is_no_cut() -> None:
    assert clean_cuts({"<<": 3, "ab": 4}, ["<<", "ab"]) == {"ab": 4}  # "<<<" holds two overlapping occurrences


texts = st.text(alphabet="ab<|>é🚢", max_size=40)


@settings(max_examples=300, deadline=None)
@given(head=texts, a=texts, b=texts, repeat=st.sampled_from([0, 1, 5000]))
def test_common_prefix_is_the_longest_shared_start(head: str, a: str, b: str, repeat: int) -> None:
    """Heads of every length around the chunk sizes, compared chunk by chunk, narrowing to the first difference."""
    head = head * repeat + head
    x, y = head + a, head + b
    assert common_prefix(x, y) == common_prefix(y, x) == len(os.path.commonprefix([x, y]))
