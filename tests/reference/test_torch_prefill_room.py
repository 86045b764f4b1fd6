"""The torch view's prefill room (SmolLM2 on the CPU, where a GPU's room is given explicitly): cells beyond the
budget let a turn's new tokens go through in whole prefill chunks, with the view's history still in place, and the
view never passes its budget plus that room."""

from __future__ import annotations

import pytest
import torch
from model_support import small_model

GGUF = small_model()

from kvmem_core.config import KVMemConfig  # noqa: E402
from kvmem_core.contract import SamplingParams, StepRequest  # noqa: E402
from kvmem_core.engine import KVMemEngine  # noqa: E402
from kvmem_torch import create_adapter  # noqa: E402
from kvmem_torch.adapter import prefill_room_for  # noqa: E402

CONFIG = KVMemConfig(
    ctx=8192, budget=1024, gen_budget=256, sink_tokens=128, recent_tokens=256, retrieval_heads=((20, 3), (25, 1))
)
CHUNK = 1024  # what a GPU adapter asks for, scaled to this small view
LINES = "\n".join(f"line {i}: the value of key_{i} is {i * 37 % 1000}" for i in range(150))


def forwards_of_a_long_turn(room: int) -> list[tuple[int, int]]:
    """(tokens, cells already in the view) of each prefill forward of a turn far past the budget."""
    torch.set_num_threads(1)
    adapter = create_adapter(str(GGUF), CONFIG, device="cpu", progress=False, prefill_chunk=CHUNK, prefill_room=room)
    engine, seen = KVMemEngine(adapter, CONFIG), []
    forward = adapter.forward

    def recorded(tokens, positions, **kw):  # type: ignore[no-untyped-def]
        seen.append((len(tokens), adapter.runner.length))
        assert adapter.runner.length + len(tokens) <= CONFIG.view_tokens + room
        return forward(tokens, positions, **kw)

    adapter.forward = recorded
    try:
        messages = ({"role": "user", "content": f"{LINES}\nWhat is the value of key_7?"},)
        engine.step(StepRequest(messages=messages, sampling=SamplingParams(temperature=0.0, max_tokens=4)), print)
    finally:
        engine.close()
    return [f for f in seen if f[0] > CONFIG.recent_tokens]  # the prefill's, not the replay's or decode's


@pytest.mark.timeout(300)
def test_a_whole_chunk_goes_through_with_the_history_in_place() -> None:
    roomy, tight = forwards_of_a_long_turn(CHUNK), forwards_of_a_long_turn(0)
    assert [n for n, _ in roomy[:-1]] == [CHUNK] * (len(roomy) - 1)  # whole chunks
    assert {n for n, _ in tight[:-1]} == {512}  # a quarter of the view, raised to the core's least chunk
    assert len(roomy) < len(tight)
    # after the first chunk the view keeps a budget's worth of history, where a quarter chunk leaves less
    assert min(held for _, held in roomy[1:]) >= CONFIG.budget, roomy
    assert min(held for _, held in tight[1:]) < CONFIG.budget - 256, tight


def test_only_a_gpu_view_gets_the_room_by_default() -> None:
    assert prefill_room_for("cuda:0", 4096) == 4096 and prefill_room_for("cpu", 512) == 0
