"""``kvmem test`` spreads test files over the usable cores with pytest-xdist, unless told otherwise, and runs the
wall-clock tests alone after them."""

from __future__ import annotations

import pytest

from kvmem import cmd_test


@pytest.mark.parametrize("cores, expected", [(1, []), (2, ["-n", "2"]), (16, ["-n", "4"])])
def test_workers_follow_the_usable_cores_up_to_four(monkeypatch, cores, expected):
    monkeypatch.setattr(cmd_test.os, "sched_getaffinity", lambda pid: set(range(cores)))
    args = cmd_test.workers([])
    assert args[:2] == expected and (not args or args[2:] == ["--dist", "loadfile"])


@pytest.mark.parametrize("extra", [["-n", "0"], ["-n0"], ["--numprocesses=3"], ["-q", "-n", "auto"]])
def test_an_explicit_worker_count_wins(monkeypatch, extra):
    monkeypatch.setattr(cmd_test.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert cmd_test.workers(extra) == []


def test_without_xdist_the_suite_runs_in_one_process(monkeypatch):
    monkeypatch.setattr(cmd_test.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(cmd_test.importlib.util, "find_spec", lambda name: None)
    assert cmd_test.workers([]) == []


@pytest.mark.parametrize(
    "codes, expected", [([0, 0], 0), ([0, 5], 0), ([5, 0], 0), ([5, 5], 1), ([1, 0], 1), ([0, 2], 2), ([5, 1], 1)]
)
def test_the_passes_fail_together_and_an_empty_run_fails(codes, expected):
    assert cmd_test.combined(codes) == expected
