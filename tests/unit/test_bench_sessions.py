"""The quality benchmark's offline agent sessions: deterministic, fact at its depth, distinct distractors."""

from __future__ import annotations

import itertools
import random
import re

import pytest
from kvmem_bench.sessions import (
    KINDS,
    PEOPLE,
    Fact,
    Session,
    distractor,
    estimate_tokens,
    fit_chars_per_token,
    is_correct,
    make_fact,
    make_session,
    make_sessions,
)
from kvmem.tools_format import render_plain


def _text(session: Session) -> str:
    return "\n".join(m["content"] for m in session.messages)


def _token_offset(session: Session, line: str) -> tuple[int, int]:
    """Estimated token position of ``line`` and the transcript's estimated length."""
    before, total = None, 0
    for m in session.messages:
        content = m["content"]
        if before is None and line in content:
            before = total + estimate_tokens(content[: content.index(line)])
        total += estimate_tokens(content) + 5
    assert before is not None
    return before, total


def test_same_seed_same_sessions_other_seed_other_sessions() -> None:
    a = make_sessions([1200], [0.2, 0.8], KINDS, seed=7)
    b = make_sessions([1200], [0.2, 0.8], KINDS, seed=7)
    c = make_sessions([1200], [0.2, 0.8], KINDS, seed=8)
    assert [s.messages for s in a] == [s.messages for s in b]
    assert [s.fact for s in a] == [s.fact for s in b]
    assert [s.messages for s in a] != [s.messages for s in c]
    assert [s.id for s in a] == [f"s1200-d{d:.2f}-{k}" for d in (0.2, 0.8) for k in KINDS]
    assert KINDS == ("passkey", "kv", "chain", "update", "port", "owner")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("depth", [0.1, 0.5, 0.9])
def test_the_first_statement_sits_at_the_depth(kind: str, depth: float) -> None:
    session = make_session("x", kind, 3000, depth, random.Random(3))
    text = _text(session)
    for line in session.fact.statements:
        assert text.count(line) == 1
    at, total = _token_offset(session, session.fact.statements[0])
    assert abs(at / total - depth) < 0.12  # a round is about 9% of a 3000-token session


@pytest.mark.parametrize("kind", ["chain", "update"])
def test_the_second_statement_comes_later_and_the_evidence_is_right(kind: str) -> None:
    session = make_session("x", kind, 2000, 0.2, random.Random(5))
    fact = session.fact
    first, _ = _token_offset(session, fact.statements[0])
    second, _ = _token_offset(session, fact.statements[1])
    assert second > first
    assert fact.evidence == ((0, 1) if kind == "chain" else (1,))
    assert fact.answer in fact.statements[0 if kind == "chain" else 1]


@pytest.mark.parametrize("kind", KINDS)
def test_distractors_have_the_same_form_but_another_subject_and_value(kind: str) -> None:
    session = make_session("x", kind, 4000, 0.5, random.Random(11))
    fact = session.fact
    form = {
        "passkey": r"deployment passkey is (\d+)",
        "kv": r"export (\w+)_API_KEY=(\d+)",
        "chain": r"(\w+)_BUILD=(\d+)",
        "update": r"the (\w+) pager code",
        "port": r"(\w+)-svc listening on 0\.0\.0\.0 port (\d+)",
        "owner": r"ticket ([A-Z]+)-(\d+) assigned to \w",
    }[kind]
    lines = [line for line in _text(session).splitlines() if re.search(form, line)]
    others = [line for line in lines if line not in fact.statements]
    assert len(others) >= 3
    for line in others:
        assert fact.subject not in line.lower() and fact.answer not in line


def test_the_question_is_the_last_user_turn_and_tool_results_answer_their_calls() -> None:
    session = make_session("x", "kv", 1500, 0.3, random.Random(2))
    messages = session.messages
    assert messages[0]["role"] == "system" and messages[-1]["role"] == "user"
    assert session.fact.question in messages[-1]["content"]
    assert any(m["role"] == "tool" for m in messages)
    for prev, msg in itertools.pairwise(messages):
        if msg["role"] == "tool":
            assert prev["tool_calls"][0]["id"] == msg["tool_call_id"]


@pytest.mark.parametrize("size", [400, 1100, 2300, 4096])
def test_sizes_are_roughly_the_target(size: int) -> None:
    totals = [_token_offset(s, s.messages[-1]["content"])[1] for s in make_sessions([size], [0.1, 0.5, 0.9], KINDS, 4)]
    assert 0.75 * size <= sum(totals) / len(totals) <= 1.2 * size


def test_a_tokenizer_with_longer_tokens_gets_longer_transcripts_of_the_same_size() -> None:
    def count(text: str) -> int:  # digits one token each, 5 characters per token elsewhere
        digits = sum(c.isdigit() for c in text)
        return digits + round((len(text) - digits) / 5)

    chars_per_token = fit_chars_per_token(count)
    assert chars_per_token == pytest.approx(5, rel=0.01)
    short, long = (make_session("x", "kv", 3000, 0.5, random.Random(1), cpt) for cpt in (2.5, chars_per_token))
    assert len(_text(long)) > 1.5 * len(_text(short))
    rendered = sum(count(t["content"]) + 5 for t in render_plain(list(long.messages), None))  # ChatML wrappers
    assert 0.9 * 3000 <= rendered <= 1.1 * 3000


@pytest.mark.parametrize("kind", ["port", "owner"])
def test_the_held_out_kinds_ask_about_their_own_line(kind: str) -> None:
    fact = make_fact(kind, random.Random(9))
    (line,) = fact.statements
    assert fact.answer in line and fact.subject in line.lower() and fact.evidence == (0,)
    if kind == "port":
        assert re.fullmatch(rf"{fact.subject}-svc listening on 0\.0\.0\.0 port \d{{5}}", line)
        assert fact.question == f"Which port does the {fact.subject}-svc service listen on?"
        assert 10000 <= int(fact.answer) <= 65535
    else:
        ticket = re.fullmatch(r"ticket ([A-Z]+-\d+) assigned to (\w+)", line)
        assert ticket and ticket[2] == fact.answer and fact.answer in PEOPLE
        assert fact.question == f"Who is ticket {ticket[1]} assigned to?"


def test_a_distractor_never_repeats_the_answer() -> None:
    rng = random.Random(4)
    fact = make_fact("owner", rng)
    lines = [distractor(fact, rng) for _ in range(300)]
    assert all(fact.answer not in line and fact.subject.upper() not in line for line in lines)
    assert len({line.rsplit(" ", 1)[1] for line in lines}) == len(PEOPLE) - 1


def test_a_fact_is_never_about_the_avoided_name() -> None:
    rng = random.Random(0)
    assert all(make_fact("passkey", rng, avoid="orion").subject != "orion" for _ in range(200))


def test_is_correct_is_an_exact_whole_word_match_on_the_first_line() -> None:
    fact = Fact("passkey", "84606", "q?", ("NOTE: the lyra deployment passkey is 84606.",))
    assert is_correct("84606", fact)
    assert is_correct("The lyra deployment passkey is 84606.", fact)
    assert is_correct('  "84606", as noted', fact)
    assert not is_correct("846060", fact)
    assert not is_correct("8460", fact)
    assert not is_correct("The passkey is 84 606", fact)
    assert not is_correct("I do not know.\n84606", fact)
    assert not is_correct("", fact)
    assert is_correct("ORION_API_KEY=84606", fact) and is_correct("Port: 84606/tcp", fact)


def test_names_match_in_any_case_but_only_whole() -> None:
    fact = Fact("owner", "Elena", "Who is ticket VEGA-412 assigned to?", ("ticket VEGA-412 assigned to Elena",))
    assert is_correct("Elena", fact) and is_correct("ticket VEGA-412 is assigned to elena.", fact)
    assert is_correct("ELENA", fact) and is_correct("**Elena**", fact)
    assert not is_correct("Elenas", fact) and not is_correct("Helena", fact) and not is_correct("Greta", fact)
