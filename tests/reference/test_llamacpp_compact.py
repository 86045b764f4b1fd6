"""Compact positions: a workspace past SmolLM2's trained 8192 tokens keeps answering from selected blocks."""

from __future__ import annotations

import random

import pytest

from kvmem_core.config import KVMemConfig
from kvmem_core.synthetic import PROSE
from llamacpp_support import chat, model_path

pytestmark = [pytest.mark.llamacpp, pytest.mark.slow]  # ~9K tokens of prefill: minutes on one CPU thread
CFG = KVMemConfig(ctx=16384, budget=1024, gen_budget=256, sink_tokens=128, recent_tokens=256, positions="compact")
PASSKEY = "73058"


def filler(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(PROSE) for _ in range(n))


def test_workspace_beyond_trained_context_answers_from_a_compact_view():
    from kvmem.engines import load_engine

    engine = load_engine("llama.cpp", str(model_path()), CFG)
    try:
        turns = [
            {"role": "user", "content": f"Notes. {filler(1, 12)} The secret passkey is {PASSKEY}. Remember it."},
            {"role": "assistant", "content": "Noted."},
        ]
        for i in range(2, 10):
            turns += [
                {"role": "user", "content": f"More notes: {filler(i, 62)}"},
                {"role": "assistant", "content": "Noted."},
            ]
        turns.append({"role": "user", "content": "What is the secret passkey? Reply with the number."})
        ids = engine.tokenize(engine.adapter.render_chat(turns))
        assert len(ids) > engine.adapter.caps.trained_ctx
        result = engine.step(chat(turns, max_tokens=12), lambda piece: True)
        assert result.selection["position_mode"] == "compact"
        assert engine.view.next_pos < engine.adapter.caps.trained_ctx
        assert result.prompt_tokens == len(ids)
        assert PASSKEY in result.text
    finally:
        engine.close()
