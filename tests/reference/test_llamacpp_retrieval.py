"""A passkey planted early in a transcript three times the budget: retrieval finds it, recency loses it."""
from __future__ import annotations

import random

import pytest

from kvmem_core.config import KVMemConfig
from kvmem_core.synthetic import PROSE
from llamacpp_support import chat, model_path

pytestmark = pytest.mark.llamacpp
CFG = KVMemConfig(ctx=4096, budget=448, gen_budget=256, block_tokens=64, sink_tokens=64, recent_tokens=128,
                  positions="original")
PASSKEY = "48213"


def filler(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(PROSE) for _ in range(n))


TRANSCRIPT = [
    {"role": "user", "content": f"Keep these notes. {filler(1, 8)} The secret passkey is {PASSKEY}. Remember it. {filler(2, 36)}"},
    {"role": "assistant", "content": "I have kept the notes."},
    {"role": "user", "content": f"More notes: {filler(3, 38)}"},
    {"role": "assistant", "content": "Noted as well."},
    {"role": "user", "content": "What is the secret passkey? Reply with the number."},
]


@pytest.fixture(scope="module")
def engine():
    from kvmem.engines import load_engine

    eng = load_engine("llama.cpp", str(model_path()), CFG)
    yield eng
    eng.close()


def test_retrieval_selects_the_passkey_block_and_recent_loses_it(engine):
    text = engine.adapter.render_chat(TRANSCRIPT)
    ids = engine.tokenize(text)
    assert len(ids) >= 3 * CFG.budget
    key_block = len(engine.tokenize(text[:text.index(PASSKEY)])) // CFG.block_tokens
    found = engine.step(chat(TRANSCRIPT, max_tokens=12), lambda piece: True)
    assert key_block in found.selection["blocks"]
    assert key_block not in found.selection["mandatory_blocks"]
    assert PASSKEY in found.text
    lost = engine.step(chat(TRANSCRIPT, max_tokens=12, method="recent"), lambda piece: True)
    assert lost.cached_tokens == len(ids) - 1  # the same transcript: nothing prefilled again
    assert key_block not in lost.selection["blocks"]
    assert PASSKEY not in lost.text
