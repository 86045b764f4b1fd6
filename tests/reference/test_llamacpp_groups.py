"""Whole-message selection and pins on the real small model: a pinned message's blocks are mandatory for
its step only, a selected block brings its tool call and result, and bad pins are refused before any work."""

from __future__ import annotations

import random
from typing import Iterator

import numpy as np
import pytest

from kvmem_core.config import KVMemConfig
from kvmem_core.engine import KVMemEngine
from kvmem_core.errors import BudgetError, ConfigError
from kvmem_core.groups import block_groups
from kvmem_core.prompt import build_prompt
from kvmem_core.synthetic import PROSE
from llamacpp_support import chat, model_path

pytestmark = pytest.mark.llamacpp
BT = 64
CFG = KVMemConfig(
    ctx=4096, budget=768, gen_budget=128, block_tokens=BT, sink_tokens=64, recent_tokens=128, positions="original"
)


def _round(i: int, rng: random.Random) -> list[dict[str, object]]:
    call = {"id": f"call_{i}", "type": "function", "function": {"name": "read_notes", "arguments": f'{{"page": {i}}}'}}
    return [
        {"role": "user", "content": f"Read page {i} of the notes."},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"call_{i}", "content": " ".join(rng.choice(PROSE) for _ in range(6))},
        {"role": "assistant", "content": f"Page {i} read."},
    ]


RNG = random.Random(3)
TRANSCRIPT = [
    {"role": "system", "content": "You read notes with tools."},
    *(m for i in range(16) for m in _round(i, RNG)),
    {"role": "user", "content": "Which page mentioned the museum?"},
]


@pytest.fixture(scope="module")
def engine() -> Iterator[KVMemEngine]:
    from kvmem.engines import load_engine

    eng = load_engine("llama.cpp", str(model_path()), CFG)
    yield eng
    eng.close()


def blocks_of(span: tuple[int, int]) -> set[int]:
    return set(range(span[0] // BT, -(-span[1] // BT)))


@pytest.mark.slow  # ~30 s of CPU prefill
def test_a_pinned_message_is_mandatory_for_its_step_only(engine: KVMemEngine) -> None:
    request = chat(TRANSCRIPT, max_tokens=2, pin=[11])
    prompt = build_prompt(engine.adapter, request)
    assert len(prompt.ids) > 2 * CFG.budget
    pinned = blocks_of(prompt.messages[11])  # the tool result of round 2, early in the transcript
    assert pinned <= set(engine.step(request, lambda piece: True).selection["mandatory_blocks"])
    again = engine.step(chat(TRANSCRIPT, max_tokens=2, method="recent"), lambda piece: True)
    assert not pinned & set(again.selection["mandatory_blocks"])


@pytest.mark.slow  # 30-100 s on a 2-vCPU machine: ./kvmem test --slow runs it
def test_a_selected_block_brings_its_tool_call_and_result(engine: KVMemEngine) -> None:
    prompt = build_prompt(engine.adapter, chat(TRANSCRIPT))
    n_blocks = len(prompt.ids) // BT
    turns = block_groups(prompt.groups, n_blocks, BT)
    call, result = prompt.messages[14], prompt.messages[15]  # round 3's call and result
    members = set(np.flatnonzero(turns == turns[sum(result) // 2 // BT]).tolist())
    assert set(range(result[0] // BT + 1, result[1] // BT)) <= members and len(members) >= 2
    assert members <= set(range(call[0] // BT, result[1] // BT + 1))
    forced = max(members)
    on = engine.step(chat(TRANSCRIPT, max_tokens=2, blocks=[forced]), lambda piece: True).selection
    off = engine.step(chat(TRANSCRIPT, max_tokens=2, blocks=[forced], groups=False), lambda piece: True).selection
    assert on["groups"] and not off["groups"]
    assert members <= set(on["blocks"]) and members - {forced} <= set(on["expanded_blocks"])
    assert not members - {forced} <= set(off["blocks"])


def test_bad_pins_are_refused_before_any_work(engine: KVMemEngine) -> None:
    before = engine.list_workspaces()
    with pytest.raises(ConfigError, match=r"kvmem.pin names messages \[99\] but the request has 66"):
        engine.step(chat(TRANSCRIPT, pin=[3, 99]), lambda piece: True)
    with pytest.raises(BudgetError, match="pinned messages"):
        engine.step(chat(TRANSCRIPT, pin=list(range(1, 50))), lambda piece: True)
    assert engine.list_workspaces() == before
