"""View planner: exact plans in both position modes."""

from __future__ import annotations

import pytest

from kvmem_core.planner import Move, ViewBlock, ViewEntry, plan_view

A, B, C, D, E = (ViewBlock(name, start, 16) for name, start in zip("abcde", (0, 16, 32, 48, 64)))


def test_first_view_compact():
    plan = plan_view([], [C, A, E], "compact")
    assert plan.load == ("a", "c", "e")
    assert plan.drop == () and plan.move == ()
    assert plan.slots == (ViewEntry("a", 0, 16), ViewEntry("c", 16, 16), ViewEntry("e", 32, 16))
    assert plan.next_pos == 48


def test_compact_reselect_moves_kept_blocks():
    current = [ViewEntry("a", 0, 16), ViewEntry("c", 16, 16), ViewEntry("e", 32, 16)]
    plan = plan_view(current, [A, B, E], "compact")
    assert plan.load == ("b",)
    assert plan.drop == ("c",)
    assert plan.move == ()  # e stays at 32: b takes c's place
    assert plan.slots == (ViewEntry("a", 0, 16), ViewEntry("b", 16, 16), ViewEntry("e", 32, 16))
    plan = plan_view(current, [A, E], "compact")
    assert plan.move == (Move("e", 32, 16),)
    assert plan.next_pos == 32


def test_original_keeps_positions_and_newest_last():
    current = [ViewEntry("a", 0, 16), ViewEntry("b", 16, 16), ViewEntry("e", 64, 16)]
    plan = plan_view(current, [E, A, D], "original", newest_start=64)
    assert plan.load == ("d",)
    assert plan.drop == ("b",)
    assert plan.move == ()
    assert plan.slots == (ViewEntry("a", 0, 16), ViewEntry("d", 48, 16), ViewEntry("e", 64, 16))
    assert plan.next_pos == 80
    with pytest.raises(ValueError, match="newest block"):
        plan_view(current, [A, D], "original", newest_start=64)


def test_mode_switch_and_noop():
    compacted = [ViewEntry("a", 0, 16), ViewEntry("e", 16, 16)]
    plan = plan_view(compacted, [A, E], "original")
    assert plan.move == (Move("e", 16, 64),)
    assert plan.load == () and plan.drop == ()
    same = plan_view(plan.slots, [A, E], "original")
    assert same.is_noop and same.slots == plan.slots
    with pytest.raises(ValueError, match="position mode"):
        plan_view([], [A], "auto")


def test_partial_newest_block():
    tail = ViewBlock("f", 80, 5)
    plan = plan_view([], [A, tail], "compact")
    assert plan.slots[-1] == ViewEntry("f", 16, 5)
    assert plan.next_pos == 21
    assert plan_view([], [A, tail], "original", newest_start=80).next_pos == 85
