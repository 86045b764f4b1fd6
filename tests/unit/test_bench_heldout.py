"""The held-out session generator: deterministic, sized, fact at its depth, statements unique, look-alikes apart."""

from __future__ import annotations

import json
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvmem_bench.heldout import (
    CHAT_FACTS,
    HELDOUT_KINDS,
    SHIPMENT_FIELDS,
    TURN_OVERHEAD,
    make_heldout_session,
    make_heldout_sessions,
)
from kvmem_bench.sessions import Session, estimate_tokens, is_correct
from kvmem.tools_format import render_plain


def _turns(session: Session) -> list[str]:
    return [t["content"] for t in render_plain(list(session.messages), None)]


def _tokens(session: Session) -> int:
    return sum(estimate_tokens(t) + TURN_OVERHEAD for t in _turns(session))


def _statement_offset(session: Session, statement: str) -> int:
    """Estimated token position of ``statement`` in the rendered transcript."""
    total = 0
    for turn in _turns(session):
        if statement in turn:
            return total + estimate_tokens(turn[: turn.index(statement)])
        total += estimate_tokens(turn) + TURN_OVERHEAD
    raise AssertionError(f"{statement!r} not in the transcript")


def _lookalikes(session: Session) -> list[str]:
    """The same-form lines about other subjects, found with a pattern per kind."""
    fact, text = session.fact, "\n".join(_turns(session))
    if fact.kind == "chat":
        template = next(t for t, _, _ in CHAT_FACTS if re.fullmatch(_pattern(t), fact.statements[0]))
        return [m.group(0) for m in re.finditer(_pattern(template), text)]
    if fact.kind == "code":
        name = fact.statements[1].split(" = ")[0]
        return re.findall(rf"^{name} = .+$", text, re.M)
    if fact.kind == "record":
        return re.findall(r'^(?:SH-\d{5},.*|\{"id": "SH-\d{5}".*)$', text, re.M)
    return re.findall(r"For \S+ I'm settling on \w+ as the [\w ]+", text)


def _pattern(template: str) -> str:
    """A regex for any filling of a chat template; the value is the group ``v``."""
    slots = {"{p}": r"\w+", "{v}": r"(?P<v>[A-Z]?\d+)"}
    return "".join(
        slots.get(part, r"[\w&' ]+?" if re.fullmatch(r"\{\w\}", part) else re.escape(part))
        for part in re.split(r"(\{\w\})", template)
    )


def _answer_of(kind: str, line: str, session: Session) -> str:
    """The value a look-alike line gives for the question's slot."""
    if kind == "chat":
        template = next(t for t, _, _ in CHAT_FACTS if re.fullmatch(_pattern(t), line))
        return re.fullmatch(_pattern(template), line).group("v")
    if kind == "code":
        return line.split(" = ", 1)[1].strip('"')
    if kind == "record":
        field = next(f for f, (_, q) in SHIPMENT_FIELDS.items() if q.split("{")[0] in session.fact.question)
        if line.startswith("{"):
            return str(json.loads(line)[field])
        return line.split(",")[list(SHIPMENT_FIELDS).index(field) + 2]
    return re.search(r"settling on (\w+)", line).group(1)


@pytest.mark.parametrize("kind", HELDOUT_KINDS)
def test_same_rng_state_gives_the_same_session(kind: str) -> None:
    one = make_heldout_session("a", kind, 8192, 0.4, random.Random(7))
    two = make_heldout_session("a", kind, 8192, 0.4, random.Random(7))
    assert one == two
    assert one != make_heldout_session("a", kind, 8192, 0.4, random.Random(8))


@pytest.mark.parametrize("size", [8192, 32768, 262144])
@pytest.mark.parametrize("kind", HELDOUT_KINDS)
def test_size_is_within_five_percent_of_the_target(kind: str, size: int) -> None:
    assert abs(_tokens(make_heldout_session("s", kind, size, 0.5, random.Random(size))) - size) <= 0.05 * size


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("kind", HELDOUT_KINDS)
def test_first_statement_sits_at_the_depth(kind: str, depth: float) -> None:
    session = make_heldout_session("d", kind, 32768, depth, random.Random(3))
    at = _statement_offset(session, session.fact.statements[0]) / _tokens(session)
    assert abs(at - depth) < 0.03


@pytest.mark.parametrize("kind", HELDOUT_KINDS)
def test_every_statement_occurs_once_inside_one_message(kind: str) -> None:
    for seed in range(20):
        session = make_heldout_session("u", kind, 8192, seed / 20, random.Random(seed))
        text = "\n".join(_turns(session))
        for statement in session.fact.statements:
            assert text.count(statement) == 1, statement
            assert sum(statement in turn for turn in _turns(session)) == 1
        assert set(session.fact.evidence) <= set(range(len(session.fact.statements)))


@pytest.mark.parametrize("kind", HELDOUT_KINDS)
def test_lookalikes_fill_about_half_the_early_rounds_and_never_give_the_answer(kind: str) -> None:
    session = make_heldout_session("l", kind, 32768, 0.95, random.Random(11))
    others = [line for line in _lookalikes(session) if not any(s in line or line in s for s in session.fact.statements)]
    assert len(others) >= 20
    assert all(_answer_of(kind, line, session) != session.fact.answer for line in others)


@pytest.mark.parametrize("kind", HELDOUT_KINDS)
def test_lookalikes_stay_out_of_the_last_fifth(kind: str) -> None:
    session = make_heldout_session("t", kind, 32768, 0.0, random.Random(5))
    others = [line for line in _lookalikes(session) if not any(s in line or line in s for s in session.fact.statements)]
    assert max(_statement_offset(session, line) for line in others) < 0.82 * _tokens(session)


def test_chat_sessions_hold_no_tools() -> None:
    session = make_heldout_session("c", "chat", 8192, 0.5, random.Random(2))
    assert {m["role"] for m in session.messages} == {"system", "user", "assistant"}
    assert not any(m.get("tool_calls") or m.get("tool_call_id") for m in session.messages)


@pytest.mark.parametrize("kind", sorted(set(HELDOUT_KINDS) - {"chat"}))
def test_tool_calls_pair_with_tool_results(kind: str) -> None:
    session = make_heldout_session("p", kind, 8192, 0.5, random.Random(4))
    calls = [c["id"] for m in session.messages for c in m.get("tool_calls", ())]
    results = [m["tool_call_id"] for m in session.messages if m["role"] == "tool"]
    assert calls == results and len(set(calls)) == len(calls) > 5


@pytest.mark.parametrize("kind", HELDOUT_KINDS)
def test_question_is_last_and_the_answer_scores(kind: str) -> None:
    session = make_heldout_session("q", kind, 8192, 0.5, random.Random(9))
    last = session.messages[-1]
    assert last["role"] == "user" and session.fact.question in last["content"]
    assert "Based on the tool outputs above" not in last["content"]
    assert is_correct(f"{session.fact.answer}\nbecause it says so", session.fact)
    assert is_correct(f"It is {session.fact.answer}.", session.fact)
    assert not is_correct("I do not know", session.fact)


def test_code_evidence_is_the_path_comment_and_the_constant_line() -> None:
    fact = make_heldout_session("k", "code", 8192, 0.5, random.Random(1)).fact
    path = re.search(r"In (\S+),", fact.question).group(1)
    assert fact.statements[0] == f"# {path}" and fact.evidence == (0, 1)
    assert fact.statements[1].startswith(fact.question.split(" is ")[1].split(" set")[0] + " = ")


def test_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown held-out kind"):
        make_heldout_session("x", "passkey", 8192, 0.5, random.Random(0))


def test_sessions_cover_every_combination_once() -> None:
    sessions = make_heldout_sessions([4096, 8192], [0.25, 0.75], list(HELDOUT_KINDS), seed=3)
    assert len({s.id for s in sessions}) == len(sessions) == 2 * 2 * len(HELDOUT_KINDS)
    assert sessions == make_heldout_sessions([4096, 8192], [0.25, 0.75], list(HELDOUT_KINDS), seed=3)


# A round holds up to ~300 tokens, so 6% holds from the plans' smallest size (8K), not at 4K.
@settings(max_examples=40, deadline=None)
@given(st.sampled_from(HELDOUT_KINDS), st.integers(8192, 40000), st.floats(0, 1), st.integers(0, 10**6))
def test_any_session_keeps_its_contract(kind: str, size: int, depth: float, seed: int) -> None:
    session = make_heldout_session("h", kind, size, depth, random.Random(seed))
    text, total = "\n".join(_turns(session)), _tokens(session)
    assert abs(total - size) <= 0.06 * size
    assert all(text.count(s) == 1 for s in session.fact.statements)
    assert abs(_statement_offset(session, session.fact.statements[0]) / total - depth) < 0.06
    assert is_correct(session.fact.answer, session.fact)
