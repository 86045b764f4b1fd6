"""The quality benchmark's plan: view budget per size, the quick and full grids, full's view, the servers."""
from __future__ import annotations

import argparse
from dataclasses import replace

import pytest
from kvmem.bench.quality import add_arguments, select_methods, server_flags
from kvmem.bench.quality_plan import (
    FULL,
    METHODS,
    ORACLE,
    QUICK,
    QUICK_METHODS,
    Method,
    Phase,
    Plan,
    full_budget,
    phases,
)
from kvmem.bench.sessions import KINDS

from kvmem_core.errors import ConfigError

QWEN_CTX, SMOLLM2_CTX = 32768, 8192


def test_each_size_has_a_view_of_one_eighth_and_at_least_512() -> None:
    assert [FULL.budget(s) for s in (1000, 4096, 8192, 16384, 49152)] == [512, 512, 1024, 2048, 6144]
    assert Plan(grid=(), view_fraction=1 / 4).budget(4096) == 1024


def test_requests_carry_their_cells_budget_and_the_oracle_only_stored_gold_blocks() -> None:
    from kvmem.bench.quality import Layout

    layout = Layout(prompt_tokens=700, block_tokens=64, gold=(3, 10))  # block 10 is the partial tail (640-700)
    assert layout.oracle == (3,)
    assert FULL.overrides(ORACLE, 4096, 20480, layout.oracle) == {
        "method": "retrieval", "budget": 512, "sink_tokens": 64, "recent_tokens": 64, "groups": True, "blocks": [3]}
    assert FULL.overrides(Method("retrieval", "mean-k"), 16384, 20480)["budget"] == 2048
    assert FULL.overrides(Method("recent"), 49152, 0) == {
        "method": "recent", "budget": 6144, "sink_tokens": 64, "recent_tokens": 64, "groups": True}
    assert FULL.overrides(Method("full"), 8192, 20480) == {"method": "full", "budget": 20480}


def test_no_groups_turns_whole_message_selection_off_in_every_selecting_request() -> None:
    from kvmem.bench.quality import plan_for

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert "--no-groups" in parser.format_help()
    off, on = plan_for(parser.parse_args(["--quick", "--no-groups"])), plan_for(parser.parse_args(["--quick"]))
    assert off == replace(QUICK, groups=False) and on == QUICK
    for m in (Method("retrieval", "retrieval-heads"), ORACLE, Method("recent")):
        assert off.overrides(m, 4096, 20480, (3,))["groups"] is False
        assert on.overrides(m, 4096, 20480, (3,))["groups"] is True
    assert "groups" not in off.overrides(Method("full"), 4096, 20480)
    strict = plan_for(parser.parse_args(["--quick", "--relevance", "0.6"]))
    assert strict.overrides(Method("retrieval", "retrieval-heads"), 4096, 20480)["relevance"] == 0.6
    assert "relevance" not in on.overrides(Method("retrieval", "retrieval-heads"), 4096, 20480)  # the server's


def test_the_full_plan_has_42_sessions_per_size_and_a_cell_beyond_qwens_context() -> None:
    sizes = FULL.session_sizes()
    assert {s: sizes.count(s) for s in FULL.sizes} == {4096: 42, 8192: 42, 16384: 42, 49152: 15}
    sessions = FULL.only_sizes("4096").sessions(0)
    assert len(sessions) == 42 and {s.fact.kind for s in sessions} == set(KINDS)
    assert sum(s.depth < 0.5 for s in sessions) == 24
    assert [s.target_tokens for s in Plan(grid=FULL.grid[:1]).sessions(0)] == sizes[:42]
    assert FULL.block_tokens is None and (FULL.sink_tokens, FULL.recent_tokens) == (64, 64)


def test_the_quick_plan_covers_every_kind_early_and_late_in_4k_sessions() -> None:
    sessions = QUICK.sessions(0)
    assert QUICK.sizes == [4096] and QUICK.budget(4096) == 512 and len(sessions) == 16
    assert {s.fact.kind for s in sessions} == set(KINDS)
    assert sum(s.depth < 0.5 for s in sessions) == 10
    assert len({s.id for s in sessions}) == 16
    assert 10 <= QUICK.minutes(len(QUICK_METHODS)) <= 20


def test_sizes_pick_cells_of_the_plan() -> None:
    plan = FULL.only_sizes("4096, 49152")
    assert plan.sizes == [4096, 49152] and len(plan.sessions(0)) == 57
    with pytest.raises(ConfigError, match="choose from 4096, 8192, 16384, 49152"):
        FULL.only_sizes("5000")
    with pytest.raises(ConfigError, match="not a list"):
        FULL.only_sizes("big")


def test_full_sees_the_largest_size_within_the_trained_context() -> None:
    assert full_budget(FULL.sizes, QWEN_CTX) == 20480  # 16384 + 25%
    assert full_budget(QUICK.sizes, QWEN_CTX) == 5120
    assert full_budget(FULL.sizes, SMOLLM2_CTX) == 5120  # 8192-token sessions do not fit 8192 with room
    assert full_budget([6500], SMOLLM2_CTX) == 8064  # capped at the context less the generation reserve
    assert full_budget([49152], QWEN_CTX) == 0


def test_sizes_beyond_the_trained_context_get_their_own_server() -> None:
    assert phases(FULL.sizes, QWEN_CTX) == [Phase(frozenset({4096, 8192, 16384}), QWEN_CTX),
                                            Phase(frozenset({49152}), 61440)]
    assert phases(QUICK.sizes, QWEN_CTX) == [Phase(frozenset({4096}), QWEN_CTX)]
    assert phases([49152], QWEN_CTX) == [Phase(frozenset({49152}), 61440)]
    assert phases(FULL.sizes, None) == [Phase(frozenset(FULL.sizes), None)]  # --url: the server given


def test_methods_are_chosen_by_label_with_the_quick_default() -> None:
    assert select_methods(None) == METHODS
    assert select_methods(None, QUICK_METHODS) == QUICK_METHODS
    assert [m.label for m in QUICK_METHODS] == ["retrieval/retrieval-heads", "recent", "full", "oracle"]
    assert [m.label for m in select_methods("recent, retrieval/mean-k", QUICK_METHODS)] == ["recent", "retrieval/mean-k"]
    with pytest.raises(ConfigError, match="unknown retrieval/bm25"):
        select_methods("retrieval/bm25")
    with pytest.raises(ConfigError, match="oracle needs another method"):
        select_methods("oracle")


def test_help_names_the_default_model_and_the_quick_runs_time() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    text = " ".join(parser.format_help().split())
    assert "qwen2.5-coder-0.5b, the default" in text
    assert "the small run: 16 sessions of 4096 tokens, view budget 512, methods" in text
    assert f"about {QUICK.minutes(4)} minutes on 2 idle CPU cores" in text


def test_the_servers_it_starts_get_the_model_and_backend_it_was_given() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    phase = phases([4096], 32768)[0]
    plain = server_flags(parser.parse_args([]), QUICK, phase, 5120)
    assert "--backend" not in plain and "--model" not in plain
    flags = server_flags(parser.parse_args(["--backend", "torch", "--model", "smollm2-135m"]), QUICK, phase, 5120)
    assert flags[-4:] == ["--model", "smollm2-135m", "--backend", "torch"]
    assert flags[flags.index("--kvmem-budget") + 1] == "5120" and flags[flags.index("--ctx") + 1] == str(phase.ctx)
