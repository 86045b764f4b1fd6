"""The grammar mask planned ahead (kvmem_core.structured.Constraint.take with ``left``): the decode loop starts the
next step's mask on the planner thread while the model computes that step's logits, and the answers are the same,
token for token, as with every mask made in line: on random logits over a byte vocabulary (closing near the budget
included); the default model's answers are checked in tests/reference/test_structured_overlap_default.py."""

from __future__ import annotations

import json
import threading
from typing import Any

import jsonschema
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_structured import CITY, EOS, VOCAB, schema_grammar

from kvmem_core.contract import SamplingParams
from kvmem_core.sampling import decode
from kvmem_core.structured import Constraint, Repeats

pytest.importorskip("llguidance")


TAKE = Constraint.take


class InLine(Constraint):
    """A constraint that makes every mask in line, on the decode's critical path (the reference)."""

    def take(self, token: int, data: bytes, left: int | None = None) -> None:
        TAKE(self, token, data)


class AlwaysMasked(Constraint):
    """A constraint that masks every step's logits before any pick (the reference for greedy picks)."""

    def choose(self, logits: np.ndarray, left: int, sample: Any, greedy: bool) -> int:
        return sample(self.allow(logits, left))


def answer(constraint: Constraint, rows: np.ndarray, max_tokens: int, temperature: float) -> tuple[str, list[int], str]:
    feed = iter(np.tile(rows, (max_tokens // len(rows) + 2, 1)))
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=7)
    return decode(
        params,
        next(feed),
        VOCAB._token_bytes,
        VOCAB._is_eog,
        lambda t: lambda: next(feed),
        lambda piece: True,
        None,
        constraint,
    )


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), max_tokens=st.integers(60, 300), temperature=st.sampled_from([0.0, 1.0]))
def test_planning_ahead_gives_the_same_answers_as_masking_in_line(
    seed: int, max_tokens: int, temperature: float
) -> None:
    rows = np.random.default_rng(seed).standard_normal((5, 257)).astype(np.float32)
    text = schema_grammar(CITY)
    ahead = answer(Constraint(text, VOCAB), rows, max_tokens, temperature)
    assert ahead == answer(InLine(text, VOCAB), rows, max_tokens, temperature)
    jsonschema.validate(json.loads(ahead[0]), CITY)


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_sampled_picks_plan_on_the_planner_thread_and_greedy_ones_in_line(
    monkeypatch: pytest.MonkeyPatch, temperature: float
) -> None:
    """A sampled pick needs each step's mask: it is made on the planner thread. A greedy pick rarely does: its
    plan is made in line, after the step's launch, as a thread's hand-off would cost more than the plan."""
    threads: list[str] = []
    plan = Constraint._plan

    def watched(self: Constraint, left: int, mask: bool) -> Any:
        threads.append(threading.current_thread().name)
        return plan(self, left, mask)

    monkeypatch.setattr(Constraint, "_plan", watched)
    rows = np.zeros((1, 257), np.float32)
    text, ids, _ = answer(Constraint(schema_grammar(CITY), VOCAB), rows, 200, temperature)
    assert len(threads) == len(ids) + 1  # one plan per token sampled under the mask, the end token's included
    here = threading.current_thread().name
    assert threads[0] == here  # the first step's: nothing ran ahead of it
    assert all(name.startswith("kvmem-grammar") if temperature else name == here for name in threads[1:])


def test_the_next_mask_is_started_after_the_step_is_launched() -> None:
    """A device step is launched and returns before its logits exist: the mask made after the launch overlaps
    it, one made before the launch (on a thread holding the interpreter's lock) delays it."""
    events: list[str] = []

    class Logged(Constraint):
        def take(self, token: int, data: bytes, left: int | None = None) -> None:
            events.append("take")
            super().take(token, data, left)

    feed = iter(np.zeros((400, 257), np.float32))

    def launch(token: int) -> Any:
        events.append("launch")
        return lambda: next(feed)

    params = SamplingParams(temperature=0.0, max_tokens=200)
    decode(
        params,
        next(feed),
        VOCAB._token_bytes,
        VOCAB._is_eog,
        launch,
        lambda piece: True,
        None,
        Logged(schema_grammar(CITY), VOCAB),
    )
    steps = [events[i : i + 2] for i in range(0, len(events) - 1, 2)]
    assert steps and all(step == ["launch", "take"] for step in steps)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), max_tokens=st.integers(60, 300))
def test_a_greedy_pick_tried_unmasked_first_is_the_masked_pick(seed: int, max_tokens: int) -> None:
    rows = np.random.default_rng(seed).standard_normal((5, 257)).astype(np.float32)
    rows[:, ::7] = rows.max()  # ties: the first best token wins in both
    text = schema_grammar(CITY)
    assert answer(Constraint(text, VOCAB), rows, max_tokens, 0.0) == answer(
        AlwaysMasked(text, VOCAB), rows, max_tokens, 0.0
    )


def test_a_greedy_pick_the_grammar_allows_makes_no_mask() -> None:
    """Logits whose best token is the next byte of a valid answer each step: no step builds a mask."""
    data = json.dumps({"name": "Paris", "unit": "c", "tags": ["old", "big"], "size": 2100000}).encode()
    rows = np.zeros((len(data) + 1, 257), np.float32)
    rows[np.arange(len(data)), list(data)] = 1.0
    rows[-1, EOS] = 1.0
    feed, constraint = iter(rows), Constraint(schema_grammar(CITY), VOCAB)
    got = decode(
        SamplingParams(temperature=0.0, max_tokens=300),
        next(feed),
        VOCAB._token_bytes,
        VOCAB._is_eog,
        lambda t: lambda: next(feed),
        lambda piece: True,
        None,
        constraint,
    )
    assert got == (data.decode(), list(data), "stop")
    assert constraint.steps == len(data) + 1 and constraint.masked == 0


@pytest.mark.parametrize("temperature", [0.0, 1e-6])
def test_each_pick_is_checked_against_the_grammar_after_the_token_before_it(temperature: float) -> None:
    """In ``ab | ba`` the second token depends on the first: logits preferring ``a`` twice must give ``ab`` (a
    check of the second pick against the state before the first was taken would allow ``a`` again)."""
    rows = np.zeros((3, 257), np.float32)
    rows[:2, ord("a")], rows[:2, ord("b")], rows[2, EOS] = 2.0, 1.0, 1.0
    constraint = Constraint('start: "ab" | "ba"', VOCAB)
    assert answer(constraint, rows, 10, temperature) == ("ab", [ord("a"), ord("b")], "stop")
    assert constraint.steps == 3


def test_a_format_compiled_once_serves_each_answer_afresh() -> None:
    """The vocabulary keeps a grammar compiled: each constraint takes a copy, so one answer leaves nothing behind
    for the next, and an answer from the kept grammar equals one from a grammar compiled anew."""
    text, rows = schema_grammar(CITY), np.random.default_rng(3).standard_normal((5, 257)).astype(np.float32)
    first = answer(Constraint(text, VOCAB), rows, 150, 0.0)
    hits = VOCAB._compile.cache_info().hits
    assert answer(Constraint(text, VOCAB), rows, 150, 0.0) == first and VOCAB._compile.cache_info().hits == hits + 1
    VOCAB._compile.cache_clear()
    assert answer(Constraint(text, VOCAB), rows, 150, 0.0) == first


@pytest.mark.parametrize("schema", [CITY, {"enum": ["a" * 300]}], ids=["city", "longer-than-watch"])
def test_the_format_s_opening_dry_run_gives_each_limit_s_closing_cost(schema: dict) -> None:
    """An answer's first step takes its closing cost from the format's one dry run to ``WATCH``: the same as a dry
    run to its own limit, for every limit (one closing within it, one that does not)."""
    text = schema_grammar(schema)
    kept = [Constraint(text, VOCAB)._closing_cost(limit) for limit in range(Constraint.WATCH + 1)]
    assert kept == [Constraint(text, VOCAB).closing_cost(limit) for limit in range(Constraint.WATCH + 1)]
    assert VOCAB.format(text).opening_cost == min(kept[-1], Constraint.WATCH)


def test_an_answer_in_a_kept_format_starts_without_a_dry_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first answer in a format runs the dry run from the start; the next answers take it from the format,
    and answer the same."""
    text, rows = schema_grammar(CITY) + "\n" * 7, np.random.default_rng(5).standard_normal((5, 257)).astype(np.float32)
    runs: list[int] = []
    dry_run = Constraint.closing_cost

    def counted(self: Constraint, limit: int) -> int:
        runs.append(self._taken)
        return dry_run(self, limit)

    monkeypatch.setattr(Constraint, "closing_cost", counted)
    first = answer(Constraint(text, VOCAB), rows, 100, 0.0)
    assert runs.count(0) == 1
    assert answer(Constraint(text, VOCAB), rows, 100, 0.0) == first and runs.count(0) == 1


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=60),
    pattern=st.lists(st.integers(0, 3), min_size=1, max_size=6),
    span=st.integers(2, 12),
    period=st.integers(1, 6),
)
def test_repeats_tell_a_loop_as_comparing_the_last_tokens_does(
    tokens: list[int], pattern: list[int], span: int, period: int
) -> None:
    """``Repeats`` (a run per period, kept as tokens come) finds the last ``span`` tokens repeating with a period of
    at most ``period`` exactly where comparing them with the ``span`` tokens p before does."""
    taken, repeats = [], Repeats(period, span)
    for i, token in enumerate(tokens):
        token = pattern[i % len(pattern)] if token else token  # mostly the pattern: loops happen
        taken.append(token)
        repeats.add(token)
        recent = taken[-span - period :]
        expected = any(
            len(recent) >= span + p and recent[-span:] == recent[-span - p : -p] for p in range(1, period + 1)
        )
        assert repeats.looping() == expected
