"""The quality benchmark's plans: splits, views bounded from the first prefill, default knobs, the queues."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from kvmem_bench.heldout import HELDOUT_KINDS
from kvmem_bench.quality import RunOptions
from kvmem_bench.quality_cli import _queues, add_arguments
from kvmem_bench.quality_plan import (
    ALL_KINDS,
    DEFAULT_BUDGET,
    DEFAULT_GEN,
    ORACLE,
    PLANS,
    RECENT,
    RETRIEVAL,
    Cell,
    View,
    fit_kinds,
    make_any_session,
    only_sizes,
    parse_shards,
    plan_named,
    queues,
)
from kvmem_bench.sessions import KINDS

from kvmem_core.config import AUTO_CTX, KVMemConfig
from kvmem_core.errors import ConfigError

QWEN_CTX = 32768


def test_the_bench_assumes_kvmem_serves_defaults() -> None:
    cfg = KVMemConfig()
    assert (cfg.budget, cfg.ctx, cfg.gen_budget) == (DEFAULT_BUDGET, AUTO_CTX, DEFAULT_GEN)


def test_every_view_is_its_own_server_with_only_the_budget_changed() -> None:
    report = plan_named("report")
    views = {c.size: report.views(c, QWEN_CTX) for c in report.cells}
    assert views[8192] == [View("default", None), View("1/8", 1024), View("full", 32256)]
    assert views[30000] == [View("default", None), View("1/8", 3750), View("full", 32256)]
    assert views[131072] == [View("default", None), View("1/8", 16384)]  # past the trained context: no full
    assert views[262144] == [View("default", None), View("1/8", 32768)]
    assert View("default", None).flags() == []  # a default server: nothing but the model and backend
    assert View("1/8", 1024).flags() == ["--kvmem-budget", "1024"]
    opts = RunOptions(Path("."), model="m.gguf", backend="torch")
    assert opts.server_flags(View("full", 32256)) == [
        "--no-ui",
        "--kvmem-budget",
        "32256",
        "--model",
        "m.gguf",
        "--backend",
        "torch",
    ]
    assert views[8192][0].methods == (RETRIEVAL, RECENT, ORACLE) and views[8192][2].methods[0].label == "full"


def test_a_size_whose_eighth_is_the_default_view_runs_it_once() -> None:
    plan = plan_named("report")
    assert [v.label for v in plan.views(Cell(16384), QWEN_CTX)] == ["default", "full"]
    assert [v.label for v in plan.views(Cell(4096), QWEN_CTX)] == ["default", "full"]  # 512 < sink + recent + block


def test_methods_send_no_knob_but_their_own() -> None:
    assert RETRIEVAL.overrides() is None  # the server's default method, scorer and view
    assert RECENT.overrides() == {"method": "recent"}
    assert ORACLE.overrides((3, 7)) == {"blocks": [3, 7]}


def test_splits_are_fixed_and_disjoint() -> None:
    assert {p.split for p in PLANS.values()} == {"tuning", "report"}
    assert PLANS["report"].split == "report" and PLANS["quick"].split == "tuning" and PLANS["tuning"].split == "tuning"
    tuning = make_any_session("kv", 8192, 0.3, "tuning", 0)
    report = make_any_session("kv", 8192, 0.3, "report", 0)
    assert tuning.messages != report.messages and tuning.fact.answer != report.fact.answer
    assert make_any_session("kv", 8192, 0.3, "report", 0) == report  # fixed by (split, seed, size, kind, depth)
    assert make_any_session("kv", 8192, 0.3, "report", 1).messages != report.messages


def test_the_report_plan_has_every_kind_at_every_depth_and_size() -> None:
    plan = plan_named("report")
    assert plan.sizes == [8192, 30000, 131072, 262144]
    assert set(ALL_KINDS) == {*KINDS, *HELDOUT_KINDS} and len(HELDOUT_KINDS) >= 3
    pairs = plan.cells[0].pairs()
    assert len(pairs) == len(set(pairs)) == len(ALL_KINDS) * 5 >= 40
    first = pairs[: len(ALL_KINDS)]
    assert {k for k, _ in first} == set(ALL_KINDS) and len({d for _, d in first}) == 5  # any first N cover the kinds


def test_shards_split_a_cells_sessions_round_robin_and_large_cells_start_first() -> None:
    plan = only_sizes(plan_named("report"), "8192,262144")
    sessions = {8192: list("abcde"), 262144: list("vwxyz")}
    work = queues(plan, QWEN_CTX, sessions, parse_shards("262144=2"))
    assert [q.name for q in work] == [
        "262144/default/0",
        "262144/default/1",
        "262144/1/8/0",
        "262144/1/8/1",
        "8192/default/0",
        "8192/1/8/0",
        "8192/full/0",
    ]
    assert work[0].sessions == ("v", "x", "z") and work[1].sessions == ("w", "y")
    with pytest.raises(ConfigError, match="SIZE=N"):
        parse_shards("big")


def test_plans_and_sizes_are_checked() -> None:
    with pytest.raises(ConfigError, match="choose from quick, tuning, report"):
        plan_named("nightly")
    with pytest.raises(ConfigError, match="choose from 8192, 30000, 131072, 262144"):
        only_sizes(plan_named("report"), "5000")


def test_flags_pick_views_and_limit_sessions_per_size() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--plan", "quick", "--views", "default,full", "--limit", "3"])
    work = _queues(args, plan_named("quick"), QWEN_CTX, {})
    assert [q.view.label for q in work] == ["default", "full"] and all(len(q.sessions) == 3 for q in work)
    with pytest.raises(ConfigError, match="--views"):
        _queues(parser.parse_args(["--views", "half"]), plan_named("quick"), QWEN_CTX, {})
    url = _queues(parser.parse_args(["--quick", "--url", "http://x"]), plan_named("quick"), QWEN_CTX, {})
    assert [q.view for q in url] == [View("default", None)]


def fake_tokens(text: str) -> int:
    """A digit-splitting tokenizer of 3 characters per token elsewhere."""
    digits = sum(c.isdigit() for c in text)
    return digits + (len(text) - digits) // 3


def test_each_kind_is_sized_with_its_own_fit_of_the_tokenizer() -> None:
    from kvmem.tools_format import render_plain

    fits = fit_kinds(fake_tokens)
    assert set(fits) == set(ALL_KINDS) and all(abs(v - 3.0) < 0.01 for v in fits.values())
    for session in plan_named("report").sessions(Cell(8192, kinds=("record", "chat", "kv"), depths=(0.5,)), 0, fits):
        n = sum(fake_tokens(t["content"]) + 5 for t in render_plain(list(session.messages), None))
        assert abs(n / 8192 - 1) < 0.05, (session.fact.kind, n)


def test_a_given_fit_is_a_json_object_of_kinds() -> None:
    from kvmem_bench.quality_cli import _fits_flag

    assert _fits_flag('{"kv": 3.8, "chat": 4}') == {"kv": 3.8, "chat": 4.0} and _fits_flag(None) is None
    for bad in ("3.8", '{"kv": -1}', "{"):
        with pytest.raises(ConfigError, match="--chars-per-token"):
            _fits_flag(bad)
