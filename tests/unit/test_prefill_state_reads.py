"""A turn's prefill reads the recurrent states its forwards hand out at checkpoint marks only once its last forward
is issued (``kvmem_core.prefill``): on a GPU a read waits for the forward that computed the states, so a read between
forwards would leave the device idle until the host issues the next one.

A default-knob session on the CPU with a GPU's forward length (``prefill_chunk`` 4,096: the engine takes a quarter
of the view, 640 tokens), each turn adding ~2.8K tokens in one user message: the query's start falls in the turn's
first forward and the replay start (512 tokens before the end) in its fourth of five, so both are snapshots taken
inside forwards before the last. The reads are recorded where the adapter hands the states out.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from model_support import small_model

from kvmem_bench.speed_ab import LINES, Session
from kvmem_bench.speed_torch import index_heads
from kvmem_bench.torch_device import random_adapter
from kvmem_core.config import KVMemConfig
from kvmem_core.engine import KVMemEngine

TURNS = 3


@pytest.fixture(scope="module")
def events() -> list[list[tuple[str, int]]]:
    """Per turn, in order: ("forward", tokens) for each prefill forward and ("states", n) for each read of a
    forward's snapshot states."""
    torch.set_num_threads(1)
    config = KVMemConfig()
    adapter = random_adapter(
        "tiny", small_model(), device="cpu", view_tokens=config.view_tokens, block_tokens=64, prefill_chunk=4096
    )
    engine = KVMemEngine(adapter, config, heads=index_heads(adapter))
    log: list[tuple[str, int]] = []
    in_prefill = [False]
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

    adapter.forward, engine._prefill = logged_forward, logged_prefill
    session, out = Session(engine, LINES), []
    try:
        for _ in range(TURNS):
            log.clear()
            session.step()
            out.append(list(log))
    finally:
        engine.close()
    return out


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
