"""Which prefill graphs a default-knob session's forwards would replay on a GPU (``kvmem_torch.graph_steps``).

A prefill forward replays a CUDA graph only when its key (padded rows, view bucket, snapshots, whether it captures the
queries) was met before and a graph slot was free (``PREFILL_GRAPHS``, none evicted): keys that drift from turn to
turn would run every turn eagerly, host-bound. CUDA is hardware this suite lacks, so the session runs on the CPU with
a GPU's forward length (``prefill_chunk`` 4,096: the engine takes a quarter of the view) and the graph bookkeeping
switched on around each forward's own eager run: the keys and decisions are the ones a GPU would make.
"""

from __future__ import annotations

from typing import Any

import pytest
from model_support import gpu_length_session

from kvmem_torch.graph_steps import PREFILL_GRAPHS
from kvmem_torch.runner import Runner

TURNS = 6


@pytest.fixture(scope="module")
def turns() -> list[list[tuple[tuple[int, int, int, bool], bool]]]:
    """Per turn of a default-knob session (each adds ~2.8K tokens), its prefill forwards' (key, replays)."""
    seen: list[tuple[tuple[int, int, int, bool], bool]] = []
    eager = Runner.forward

    def keyed(
        runner: Runner, tokens: Any, positions: Any, last_only: bool = True, capture: bool = False, snapshots: Any = ()
    ) -> Any:
        if len(tokens) > 1 and last_only:
            runner.graph_prefill = runner.graph_snapshots = True  # as on CUDA with fla's recurrent kernels
            key = runner.prefill_key(len(tokens), len(snapshots), capture)
            replays = runner._replays_prefill(len(tokens), len(snapshots), capture)
            if replays:
                runner.prefill_graphs.setdefault(key, object())  # what a capture would keep
            runner.graph_prefill = False
            seen.append((key, replays))
        return eager(runner, tokens, positions, last_only, capture, snapshots)

    def taken() -> list:
        out = list(seen)
        seen.clear()
        return out

    patch = pytest.MonkeyPatch()
    patch.setattr(Runner, "forward", keyed)
    try:
        return gpu_length_session(TURNS, lambda engine: taken)
    finally:
        patch.undo()


def test_after_the_first_turns_a_turns_full_length_forwards_and_replay_run_as_graphs(turns: list) -> None:
    for forwards in turns[2:]:
        full = [replays for (rows, *_), replays in forwards if rows >= 512]  # all but the turn's last, shorter one
        assert len(full) >= 5 and all(full), forwards


def test_a_session_keeps_a_graph_slot_free_for_the_last_forwards_lengths(turns: list) -> None:
    keys = {key for forwards in turns for key, replays in forwards if replays}
    assert len(keys) < PREFILL_GRAPHS, keys
