"""Grouping quality outcomes into rows, the goals and the tables; errors count as wrong answers."""

from __future__ import annotations

import re
from typing import Any

from kvmem_bench import report


def outcome(
    method: str,
    correct: bool,
    *,
    view: str = "default",
    session: str = "s",
    size: int = 8192,
    kind: str = "kv",
    gold: bool | None = True,
    error: str | None = None,
) -> dict[str, Any]:
    return {
        "session": session,
        "kind": kind,
        "size": size,
        "depth": 0.3,
        "view": view,
        "budget": None if view == "default" else 1024,
        "method": method,
        "prompt_tokens": 0 if error else size,
        "expected": "1",
        "answer": "",
        "correct": correct and error is None,
        "gold_blocks": [3],
        "selected_blocks": None if gold is None else [0, 3],
        "gold_selected": gold,
        "cached_tokens": 0,
        "seconds": 0.1,
        "error": error,
        "queue": f"{size}/{view}/0",
    }


def test_errors_are_counted_as_wrong_answers_and_listed() -> None:
    outs = [
        outcome("retrieval", True),
        outcome("retrieval", True, session="t", error="HTTP 500: boom"),
        outcome("recent", False, gold=None),
    ]
    rows = report.rows(outs)
    heads = next(r for r in rows if r["method"] == "retrieval")
    assert heads["n"] == 2 and heads["accuracy"] == 0.5 and heads["errors"] == 1
    s = report.summary(outs)
    assert s["accuracy"]["retrieval @ default"] == {8192: 0.5} and s["n"]["retrieval @ default"] == {8192: 2}
    assert s["errors"] == [
        {"queue": "8192/default/0", "session": "t", "view": "default", "method": "retrieval", "error": "HTTP 500: boom"}
    ]
    assert s["diagnosis"]["8192 @ default"]["errors"] == 1
    assert "errors (counted wrong): 1" in report.table(outs)


def test_goals_compare_retrieval_with_full_and_the_oracle_on_the_same_sessions() -> None:
    outs = [
        outcome("retrieval", True, session="a"),
        outcome("full", True, view="full", session="a"),
        outcome("retrieval", False, session="b", gold=False),
        outcome("full", True, view="full", session="b"),
        outcome("retrieval", True, session="c"),  # full did not answer c: not paired
        outcome("oracle", True, session="a"),
        outcome("oracle", True, session="b"),
    ]
    g = report.goals(outs)["8192 @ default"]
    assert g["vs_full"]["value"] == 0.5 and g["vs_full"]["n"] == 2 and g["vs_full"]["pass"] is False
    assert g["gold_recall"] == {"value": 2 / 3, "goal": 0.9, "n": 3, "pass": False}
    assert g["vs_oracle"] is None  # only from 128K tokens
    big = (
        [outcome("retrieval", True, size=131072, session=s) for s in "abcdefg"]
        + [outcome("retrieval", False, size=131072, session="h", kind="update")]
        + [outcome("oracle", True, size=131072, session=s) for s in "abcdefgh"]
    )
    g = report.goals(big)["131072 @ default"]
    assert g["vs_oracle"]["value"] == 7 / 8 and g["vs_oracle"]["pass"] is True  # >= 0.85
    assert g["update_newest"] == {"value": 0.0, "goal": 1.0, "n": 1, "pass": False}


def test_views_are_reported_apart() -> None:
    outs = [outcome("retrieval", True), outcome("retrieval", False, view="1/8", gold=False)]
    assert report.by(outs, "size") == {"retrieval @ default": {8192: 1.0}, "retrieval @ 1/8": {8192: 0.0}}
    assert list(report.goals(outs)) == ["8192 @ default", "8192 @ 1/8"]
    diagnosis = report.diagnosis(outs)
    assert diagnosis["8192 @ 1/8"]["missed_wrong"] == 1 and diagnosis["8192 @ default"]["selected_right"] == 1


def test_table_shows_accuracy_with_n_and_the_goals() -> None:
    text = report.table([outcome("retrieval", True), outcome("oracle", True), outcome("full", False, view="full")])
    assert (
        re.search(r"\| retrieval @ default +\| 100% \(1\)", text)
        and "| full" in text
        and "gold recall, retrieval @ default" in text
    )
    assert "| 8192 @ default" in text and "n/a (n=1) pass" in text  # full answered wrong: no ratio, not a miss
    assert report.table([]) == "no outcomes"
