"""A turn's prefill reads the recurrent states its forwards hand out at checkpoint marks only once its last forward
is issued (``kvmem_core.prefill``): on a GPU a read waits for the forward that computed the states, so a read between
forwards would leave the device idle until the host issues the next one.

A default-knob session on the CPU with a GPU's forward length (``prefill_chunk`` 4,096: the engine takes a quarter
of the view, 640 tokens), each turn adding ~2.8K tokens in one user message: the query's start falls in the turn's
first forward and the replay start (512 tokens before the end) in its fourth of five, so both are snapshots taken
inside forwards before the last. The reads are recorded where the adapter hands the states out.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
from model_support import gpu_length_session

TURNS = 3


@pytest.fixture(scope="module")
def events() -> list[list[tuple[str, int]]]:
    """Per turn, in order: ("forward", tokens) for each prefill forward and ("states", n) for each read of a
    forward's snapshot states."""
    return gpu_length_session(TURNS, _record_state_reads)


def _record_state_reads(engine: Any) -> Callable[[], list]:
    """Hook ``engine``'s prefill forwards and the reads of their states. -> a call handing out what was recorded"""
    log: list[tuple[str, int]] = []
    in_prefill = [False]
    adapter = engine.adapter
    forward, prefill = adapter.forward, engine._prefill

    def logged_forward(tokens: Any, positions: Any, **kwargs: Any) -> Any:
        out = forward(tokens, positions, **kwargs)
        if in_prefill[0]:
            log.append(("forward", len(tokens)))
        read = out._reads.get("states")
        if read is not None:
            out._reads["states"] = lambda: log.append(("states", len(kwargs.get("snapshot_at", ())))) or read()
        return out

    def logged_prefill(*args: Any, **kwargs: Any) -> Any:
        in_prefill[0] = True
        try:
            return prefill(*args, **kwargs)
        finally:
            in_prefill[0] = False

    def taken() -> list:
        out = list(log)
        log.clear()
        return out

    adapter.forward, engine._prefill = logged_forward, logged_prefill
    return taken


def test_snapshot_states_are_read_after_the_turns_last_prefill_forward(events: list) -> None:
    for turn in events[1:]:  # the first turn prefills the system prompt and the first message alone
        kinds = [kind for kind, _ in turn]
        forwards = [n for kind, n in turn if kind == "forward"]
        assert len(forwards) >= 5 and "states" in kinds, turn
        assert max(i for i, k in enumerate(kinds) if k == "forward") < kinds.index("states"), turn


def test_marks_before_the_last_forward_are_still_checkpointed(events: list) -> None:
    for turn in events[1:]:
        read = sum(n for kind, n in turn if kind == "states")
        assert read >= 2, turn  # the query's start and the replay start, at least, each inside an earlier forward
