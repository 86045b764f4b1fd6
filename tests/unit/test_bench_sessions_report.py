"""Grouping quality outcomes into contract rows, the early-needle summary, the goals and the tables."""
from __future__ import annotations

from typing import Any

from kvmem.bench import report


def outcome(method: str, scorer: str | None, correct: bool, *, session: str = "s", size: int = 2300,
            depth: float = 0.2, prompt_tokens: int = 2300, budget: int = 512, gold: bool | None = True,
            error: str | None = None) -> dict[str, Any]:
    return {"session": session, "kind": "kv", "size": size, "depth": depth, "prompt_tokens": prompt_tokens,
            "method": method, "scorer": scorer, "budget": budget, "expected": "1", "answer": "", "correct": correct,
            "gold_blocks": [3], "selected_blocks": [0, 3], "gold_selected": gold, "seconds": 0.1, "error": error}


def heads(correct: bool, **kw: Any) -> dict[str, Any]:
    return outcome("retrieval", "retrieval-heads", correct, **kw)


def test_rows_group_by_method_size_and_depth_and_skip_errors() -> None:
    outs = [outcome("retrieval", "mean-k", True), outcome("retrieval", "mean-k", False, gold=False),
            outcome("retrieval", "mean-k", True, depth=0.8), outcome("recent", None, False, gold=None),
            outcome("recent", None, True, error="HTTP 413: budget")]
    rows = report.rows(outs)
    assert [(r["method"], r["scorer"], r["depth"], r["n"]) for r in rows] == [
        ("recent", None, 0.2, 1), ("retrieval", "mean-k", 0.2, 2), ("retrieval", "mean-k", 0.8, 1)]
    assert rows[1]["accuracy"] == 0.5 and rows[1]["gold_block_recall"] == 0.5
    assert rows[0]["gold_block_recall"] is None and rows[0]["accuracy"] == 0.0
    assert set(rows[0]) >= {"method", "scorer", "workspace_tokens", "budget", "depth", "n", "accuracy", "gold_block_recall"}


def test_summary_counts_only_early_needles_in_long_workspaces() -> None:
    outs = [heads(True, session="a"), outcome("recent", None, False, session="a"),
            heads(False, session="b", depth=0.7), outcome("recent", None, True, session="b", depth=0.7),
            outcome("recent", None, True, session="c", prompt_tokens=1500)]
    s = report.summary(outs)
    assert s["early_long_accuracy"] == {"recent": 0.0, "retrieval/retrieval-heads": 1.0}
    assert s["retrieval_minus_recent"] == 1.0 and s["early_long_sessions"] == 1
    assert s["early_long_accuracy_by_kind"] == {"kv": s["early_long_accuracy"]}


def test_long_is_measured_against_each_sessions_own_view_budget() -> None:
    outs = [heads(True, session="small", size=4096, prompt_tokens=4000, budget=512),
            outcome("full", None, True, session="small", size=4096, prompt_tokens=4000, budget=20480),
            heads(True, session="big", size=16384, prompt_tokens=7000, budget=2048)]  # 7000 < 4 x 2048
    assert report.view_budgets(outs) == {"small": 512, "big": 2048}
    assert report.size_budgets(outs) == {4096: 512, 16384: 2048}
    assert [(o["session"], o["method"]) for o in report.early_long(outs)] == [("small", "retrieval"), ("small", "full")]


def test_table_has_a_row_per_method_and_a_column_per_size_with_its_view() -> None:
    outs = [outcome("retrieval", "per-token", True, session="a", size=4096, prompt_tokens=4000),
            outcome("full", None, False, session="b", gold=None, budget=20480, size=8192, prompt_tokens=8000),
            outcome("recent", None, False, session="b", size=8192, prompt_tokens=8000, budget=1024)]
    lines = report.table(outs).splitlines()
    assert [c.strip() for c in lines[0].split("|")[1:-1]] == [
        "method", "4096 tok, view 512", "8192 tok, view 1024", "early, >=4x", "gold recall"]
    assert lines[2].startswith("| retrieval/per-token | 100%") and lines[3].startswith("| full ")


def test_oracle_runs_last_in_the_table() -> None:
    outs = [outcome("oracle", None, True), outcome("recent", None, False), outcome("retrieval", "mean-k", False)]
    names = [line.split("|")[1].strip() for line in report.table(outs).split("\n\n")[0].splitlines()[2:]]
    assert names == ["retrieval/mean-k", "recent", "oracle"]


def test_diagnosis_splits_retrieval_errors_from_model_errors() -> None:
    outs = [outcome("retrieval", "mean-k", False, session="a", gold=False), outcome("oracle", None, True, session="a"),
            outcome("retrieval", "mean-k", False, session="b"), outcome("oracle", None, False, session="b"),
            outcome("retrieval", "mean-k", False, session="c", gold=False), outcome("oracle", None, False, session="c"),
            outcome("retrieval", "mean-k", True, session="d"), outcome("recent", None, False, session="d", gold=False)]
    assert report.diagnosis(outs) == {"retrieval/mean-k": {
        "selected_right": 1, "selected_wrong": 1, "missed_right": 0, "missed_wrong": 2, "missed_wrong_oracle_right": 1}}
    assert report.summary(outs)["diagnosis"] == report.diagnosis(outs)


def _cell(size: int, budget: int, answers: list[tuple[bool, bool, bool | None, float]]) -> list[dict[str, Any]]:
    """Per session (heads right, recent right, full right or None: not run, depth) at ``size``."""
    out = []
    for i, (mine, recent, full, depth) in enumerate(answers):
        kw: dict[str, Any] = {"session": f"s{size}-{i}", "size": size, "depth": depth, "prompt_tokens": size}
        out += [heads(mine, budget=budget, gold=mine, **kw), outcome("recent", None, recent, budget=budget, **kw),
                outcome("retrieval", "mean-k", False, budget=budget, gold=False, **kw)]
        out += [] if full is None else [outcome("full", None, full, budget=20480, gold=None, **kw)]
    return out


def test_goals_per_size_against_full_and_recent_and_beyond_the_trained_context() -> None:
    outs = (_cell(4096, 512, [(True, False, True, 0.1), (True, False, True, 0.3), (False, False, True, 0.7),
                              (True, True, False, 0.9)])
            + _cell(16384, 2048, [(True, False, True, 0.1), (False, True, True, 0.3)])
            + _cell(49152, 6144, [(True, False, None, 0.1), (True, False, None, 0.5), (False, False, None, 0.9)]))
    g = report.summary(outs, trained_ctx=32768)["goals"]
    assert g["method"] == "retrieval/retrieval-heads" and list(g["sizes"]) == [4096, 16384, 49152]
    small, mid, big = g["sizes"].values()
    assert small["budget"] == 512 and big["budget"] == 6144
    assert small["vs_full"] == {"value": 1.0, "accuracy": 0.75, "full_accuracy": 0.75, "sessions": 4, "goal": 0.9,
                                "pass": True}
    assert small["early_vs_recent"] == {"value": 1.0, "accuracy": 1.0, "recent_accuracy": 0.0, "sessions": 2,
                                        "goal": 0.4, "pass": True}
    assert mid["vs_full"]["value"] == 0.5 and not mid["vs_full"]["pass"]
    assert mid["early_vs_recent"]["value"] == 0.0 and not mid["early_vs_recent"]["pass"]
    assert big["vs_full"] is None and big["early_vs_recent"]["sessions"] == 1
    assert small["gold_recall"] == {"retrieval/mean-k": 0.0, "retrieval/retrieval-heads": 0.75}
    assert g["beyond_trained_context"] == {"value": 2 / 3, "trained_ctx": 32768, "sizes": [49152], "sessions": 3,
                                           "goal": 0.7, "pass": False}


def test_goals_edge_cases_full_never_right_and_no_trained_context() -> None:
    outs = _cell(4096, 512, [(False, False, False, 0.1), (True, False, False, 0.2)])
    g = report.goals(outs, None)
    assert g["sizes"][4096]["vs_full"]["value"] is None and g["sizes"][4096]["vs_full"]["pass"]
    assert g["beyond_trained_context"] is None
    assert report.goals(outs, 32768)["beyond_trained_context"] is None  # nothing longer than the context


def test_the_goals_table_shows_each_check_per_size() -> None:
    outs = (_cell(4096, 512, [(True, False, True, 0.1), (True, False, True, 0.3)])
            + _cell(49152, 6144, [(True, False, None, 0.1), (False, False, None, 0.3)]))
    goals = report.table(outs, trained_ctx=32768).split("\n\n")[1].splitlines()
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in goals[:-1]]
    assert cells[0] == ["goals of retrieval/retrieval-heads", "4096 tok", "49152 tok"]
    assert cells[2] == ["accuracy / full's (>= 0.90)", "1.00 pass", "-"]
    assert cells[3] == ["early: minus recent (>= +40 pts)", "+100 pts pass", "+50 pts pass"]
    assert cells[4] == ["gold recall, retrieval/mean-k", "0%", "0%"]
    assert cells[5] == ["gold recall, retrieval/retrieval-heads", "100%", "50%"]
    assert goals[-1] == "beyond the trained context (32768 tokens): 50% of 2 sessions (goal >= 70%): FAIL"
