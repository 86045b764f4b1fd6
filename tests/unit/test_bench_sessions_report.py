"""Grouping quality outcomes into contract rows, the early-needle summary, and the table."""
from __future__ import annotations

from typing import Any

import pytest
from kvmem.bench import report
from kvmem.bench.quality import METHODS, ORACLE, Layout, Method, Plan, select_methods

from kvmem_core.errors import ConfigError


def outcome(method: str, scorer: str | None, correct: bool, *, size: int = 2300, depth: float = 0.2,
            prompt_tokens: int = 2300, gold: bool | None = True, error: str | None = None) -> dict[str, Any]:
    return {"session": "s", "kind": "kv", "size": size, "depth": depth, "prompt_tokens": prompt_tokens,
            "method": method, "scorer": scorer, "budget": 512, "expected": "1", "answer": "", "correct": correct,
            "gold_blocks": [3], "selected_blocks": [0, 3], "gold_selected": gold, "seconds": 0.1, "error": error}


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
    outs = [outcome("retrieval", "retrieval-heads", True), outcome("recent", None, False),
            outcome("retrieval", "retrieval-heads", False, depth=0.7), outcome("recent", None, True, depth=0.7),
            outcome("recent", None, True, prompt_tokens=1500)]
    s = report.summary(outs, budget=512)
    assert s["early_long_accuracy"] == {"recent": 0.0, "retrieval/retrieval-heads": 1.0}
    assert s["retrieval_minus_recent"] == 1.0 and s["early_long_sessions"] == 1
    assert s["early_long_accuracy_by_kind"] == {"kv": s["early_long_accuracy"]}


def test_table_has_a_row_per_method_and_a_column_per_size() -> None:
    outs = [outcome("retrieval", "per-token", True, size=400, prompt_tokens=380), outcome("full", None, False, gold=None)]
    lines = report.table(outs, 512).splitlines()
    assert [c.strip() for c in lines[0].split("|")[1:-1]] == ["method", "400 tok", "2300 tok", "early, >=4x", "gold recall"]
    assert lines[2].startswith("| retrieval/per-token | 100%") and lines[3].startswith("| full ")


def test_methods_are_chosen_by_label() -> None:
    assert select_methods(None) == METHODS
    assert [m.label for m in select_methods("recent, retrieval/mean-k")] == ["recent", "retrieval/mean-k"]
    with pytest.raises(ConfigError, match="unknown retrieval/bm25"):
        select_methods("retrieval/bm25")


def test_sizes_pick_cells_of_the_plan() -> None:
    from kvmem.bench.quality import FULL

    plan = FULL.only_sizes("4096, 7168")
    assert {size for size, _, _ in plan.grid} == {4096, 7168} and len(plan.sessions(0)) == 40
    with pytest.raises(ConfigError, match="choose from 400, 1024, 2048, 4096, 7168"):
        FULL.only_sizes("5000")
    with pytest.raises(ConfigError, match="not a list"):
        FULL.only_sizes("big")


def test_oracle_alone_is_refused_and_runs_last_in_the_table() -> None:
    with pytest.raises(ConfigError, match="oracle needs another method"):
        select_methods("oracle")
    outs = [outcome("oracle", None, True), outcome("recent", None, False), outcome("retrieval", "mean-k", False)]
    names = [line.split("|")[1].strip() for line in report.table(outs, 512).splitlines()[2:]]
    assert names == ["retrieval/mean-k", "recent", "oracle"]


def test_diagnosis_splits_retrieval_errors_from_model_errors() -> None:
    def item(session: str, method: str, scorer: str | None, correct: bool, gold: bool | None) -> dict[str, Any]:
        return {**outcome(method, scorer, correct, gold=gold), "session": session}

    outs = [item("a", "retrieval", "mean-k", False, False), item("a", "oracle", None, True, True),
            item("b", "retrieval", "mean-k", False, True), item("b", "oracle", None, False, True),
            item("c", "retrieval", "mean-k", False, False), item("c", "oracle", None, False, True),
            item("d", "retrieval", "mean-k", True, True), item("d", "recent", None, False, False)]
    assert report.diagnosis(outs) == {"retrieval/mean-k": {
        "selected_right": 1, "selected_wrong": 1, "missed_right": 0, "missed_wrong": 2, "missed_wrong_oracle_right": 1}}
    assert report.summary(outs, 512)["diagnosis"] == report.diagnosis(outs)


def test_the_oracle_forces_only_stored_gold_blocks_into_a_retrieval_view() -> None:
    plan = Plan(grid=())
    layout = Layout(prompt_tokens=700, block_tokens=64, gold=(3, 10))  # block 10 is the partial tail (640-700)
    assert layout.oracle == (3,)
    assert plan.overrides(ORACLE, 8064, layout.oracle) == {"method": "retrieval", "budget": 512, "sink_tokens": 64,
                                                          "recent_tokens": 64, "blocks": [3]}
    assert plan.overrides(Method("full"), 8064) == {"method": "full", "budget": 8064}
