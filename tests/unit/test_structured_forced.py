"""Where the grammar forces bytes, a greedy pick is checked without the grammar's whole mask
(kvmem_core.structured.Constraint): where the forced bytes are whole tokens, llguidance's mask allows the first of
them alone (``_forced``); where a longer token may extend them, it allows the tokens that are a prefix of them or go
on from them, which the one-token check (``_admits``) tells. On a vocabulary with multi-byte tokens, where both kinds
of state occur, the checks agree with the mask on every token of every state of random answers, greedy answers equal
always-masked ones, and an answer whose every greedy pick the grammar allows builds no mask."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_structured import CITY, EOS, VOCAB, schema_grammar
from test_structured_overlap import AlwaysMasked

from kvmem_core.contract import SamplingParams
from kvmem_core.sampling import decode
from kvmem_core.structured import Constraint
from kvmem_core.vocabulary import Vocabulary

pytest.importorskip("llguidance")

# tokens past the bytes: some are what the grammar forces whole, some extend forced bytes (`` "`` by `` "a``)
MERGES = ['{"', '":', ' "', '",', "name", "unit", "tags", "size", " [", ' ["', '"]', '"]}', ' "a', ' "ab', "ab"]
MERGES += [" 1", " 12", '"c', ' "c']
TOKENS = [bytes([b]) for b in range(256)] + [b""] + [m.encode() for m in MERGES]
N = len(TOKENS)


def tokenize(text: str) -> list[int]:
    """The longest token first, left to right."""
    data, ids = text.encode(), []
    while data:
        token = max((t for t, b in enumerate(TOKENS) if b and data.startswith(b)), key=lambda t: len(TOKENS[t]))
        ids.append(token)
        data = data[len(TOKENS[token]) :]
    return ids


MERGED = Vocabulary(N, TOKENS.__getitem__, lambda t: t == EOS, tokenize)


def greedy(constraint: Constraint, rows: np.ndarray, max_tokens: int) -> tuple[str, list[int], str]:
    feed = iter(np.tile(rows, (max_tokens // len(rows) + 2, 1)))
    return decode(
        SamplingParams(temperature=0.0, max_tokens=max_tokens),
        next(feed),
        TOKENS.__getitem__,
        lambda t: t == EOS,
        lambda t: lambda: next(feed),
        lambda piece: True,
        None,
        constraint,
    )


def random_rows(seed: int, rows: int = 7) -> np.ndarray:
    """Random logits that favour the multi-byte tokens (ties included), so their checks are exercised."""
    logits = np.random.default_rng(seed).standard_normal((rows, N)).astype(np.float32)
    logits[:, EOS + 1 :] += 1.5
    logits[:, ::9] = logits.max()
    return logits


def forced_kind(matcher: Any) -> str:
    """What ``matcher``'s grammar forces next: "none", "whole" tokens, or bytes a longer token may extend."""
    if not matcher.compute_ff_bytes():
        return "none"
    return "whole" if matcher.compute_ff_tokens() else "extensible"


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_the_one_token_checks_allow_what_the_mask_allows_in_every_state(seed: int) -> None:
    rows, constraint = random_rows(seed, 40), Constraint(schema_grammar(CITY), MERGED)
    for row in rows:
        matcher = constraint.matcher
        forced = Constraint._forced(matcher)
        allowed = constraint._allowed(matcher)[:N]
        if forced is not None:
            assert np.flatnonzero(allowed).tolist() == [forced]
        else:
            assert [constraint._admits(matcher, t) for t in range(N)] == allowed.tolist()
        pick = int(np.argmax(np.where(allowed, row, -np.inf)))
        if pick == EOS:
            break
        constraint.take(pick, TOKENS[pick])


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), max_tokens=st.integers(40, 300))
def test_greedy_answers_over_multi_byte_tokens_are_the_always_masked_ones(seed: int, max_tokens: int) -> None:
    rows, text = random_rows(seed), schema_grammar(CITY)
    ahead = greedy(Constraint(text, MERGED), rows, max_tokens)
    assert ahead == greedy(AlwaysMasked(text, MERGED), rows, max_tokens)
    assert set(json.loads(ahead[0])) == set(CITY["properties"])


def outcome(constraint: Constraint, rows: np.ndarray, max_tokens: int) -> Any:
    """The greedy answer, or the name of the error that ended it."""
    try:
        with np.errstate(invalid="ignore"):
            return greedy(constraint, rows, max_tokens)
    except Exception as exc:
        return type(exc).__name__


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    specials=st.lists(
        st.tuples(
            st.integers(0, 6),
            st.one_of(st.integers(0, N - 1), st.integers(EOS + 1, N - 1)),  # often a token the grammar forces
            st.sampled_from([-np.inf, np.nan]),
        ),
        max_size=8,
    ),
)
def test_greedy_answers_with_nan_or_minus_infinite_logits_are_the_always_masked_ones(
    seed: int, specials: list[tuple[int, int, float]]
) -> None:
    """Where the step allows one token, a greedy pick skips the mask only where masking could not change it: not
    where that token's logit is -inf, nor where the best logit is NaN. (+inf logits are left out: masking turns a
    forbidden +inf into NaN, which an always-masked argmax then picks.)"""
    rows, text = random_rows(seed), schema_grammar(CITY)
    for row, token, value in specials:
        rows[row, token] = value
    assert outcome(Constraint(text, MERGED), rows, 80) == outcome(AlwaysMasked(text, MERGED), rows, 80)


@pytest.mark.parametrize("vocabulary", [VOCAB, MERGED], ids=["bytes", "multi-byte"])
def test_greedy_picks_the_grammar_allows_build_no_mask(monkeypatch: pytest.MonkeyPatch, vocabulary: Any) -> None:
    """Logits whose best token is the next token of a valid answer: no step builds the grammar's mask, also in the
    states where the grammar forces bytes (the keys, and on multi-byte tokens the openings a token may extend)."""
    built, kinds = [], []
    fill, plan = Constraint._fill_bits, Constraint._plan

    def counted(self: Constraint, matcher: Any) -> None:
        built.append(1)
        fill(self, matcher)

    def watched(self: Constraint, left: int, mask: bool) -> Any:
        kinds.append(forced_kind(self.matcher))
        return plan(self, left, mask)

    data = json.dumps({"name": "ab", "unit": "c", "tags": ["ab", "x"], "size": 12})
    ids = vocabulary.tokenizer.tokenize_str(data) if vocabulary is MERGED else list(data.encode())
    rows = np.zeros((len(ids) + 1, vocabulary.n_vocab), np.float32)
    rows[np.arange(len(ids) + 1), [*ids, EOS]] = 1.0
    constraint = Constraint(schema_grammar(CITY), vocabulary)
    monkeypatch.setattr(Constraint, "_fill_bits", counted)
    monkeypatch.setattr(Constraint, "_plan", watched)
    feed = iter(rows)
    got = decode(
        SamplingParams(temperature=0.0, max_tokens=1000),
        next(feed),
        vocabulary.token_bytes,
        lambda t: t == EOS,
        lambda t: lambda: next(feed),
        lambda piece: True,
        None,
        constraint,
    )
    assert got == (data, ids, "stop") and constraint.masked == 0 and not built
    assert "whole" in kinds and ("extensible" in kinds) == (vocabulary is MERGED)
