"""A passkey planted early in a transcript three times the budget: retrieval finds it, recency loses it."""

from __future__ import annotations

import random

import pytest

from kvmem_core.config import KVMemConfig
from kvmem_core.errors import ConfigError
from kvmem_core.synthetic import PROSE
from llamacpp_support import chat, model_path

pytestmark = pytest.mark.llamacpp
CFG = KVMemConfig(
    ctx=4096, budget=448, gen_budget=256, block_tokens=64, sink_tokens=64, recent_tokens=128, positions="original"
)
PASSKEY = "48213"


def filler(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(PROSE) for _ in range(n))


TRANSCRIPT = [
    {
        "role": "user",
        "content": f"Keep these notes. {filler(1, 8)} The secret passkey is {PASSKEY}. Remember it. {filler(2, 36)}",
    },
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
    key_block = len(engine.tokenize(text[: text.index(PASSKEY)])) // CFG.block_tokens
    found = engine.step(chat(TRANSCRIPT, max_tokens=12), lambda piece: True)
    assert key_block in found.selection["blocks"]
    assert key_block not in found.selection["mandatory_blocks"]
    assert PASSKEY in found.text
    lost = engine.step(chat(TRANSCRIPT, max_tokens=12, method="recent"), lambda piece: True)
    # the same transcript: only what the retrieval step recomputed against its selection is prefilled again
    assert lost.cached_tokens == len(ids) - found.selection["replayed_tokens"] > 3 * CFG.budget
    assert key_block not in lost.selection["blocks"]
    assert PASSKEY not in lost.text


def test_a_repeated_prompt_scores_with_its_whole_question(engine):
    text = engine.adapter.render_chat(TRANSCRIPT)
    ids = engine.tokenize(text)
    first = engine.step(chat(TRANSCRIPT, max_tokens=12), lambda piece: True)
    again = engine.step(chat(TRANSCRIPT, max_tokens=12), lambda piece: True)
    question = len(engine.tokenize(engine.adapter.render_chat(TRANSCRIPT[:-1], add_generation_prompt=False)))
    assert again.cached_tokens <= question < len(ids) - 1  # the question was recomputed, not served from cache
    assert again.selection["blocks"] == first.selection["blocks"] and again.text == first.text


def test_an_oracle_selection_puts_the_named_block_in_view(engine):
    text = engine.adapter.render_chat(TRANSCRIPT)
    key_block = len(engine.tokenize(text[: text.index(PASSKEY)])) // CFG.block_tokens
    oracle = engine.step(chat(TRANSCRIPT, max_tokens=12, method="recent", blocks=(key_block,)), lambda piece: True)
    assert key_block in oracle.selection["blocks"] and oracle.selection["oracle_blocks"] == [key_block]
    assert PASSKEY in oracle.text
    with pytest.raises(ConfigError, match="kvmem.blocks"):
        engine.step(chat(TRANSCRIPT, blocks=(10_000,)), lambda piece: True)


def test_a_long_last_turn_scores_with_its_last_tokens(engine, monkeypatch):
    """A turn that pastes a long log before its question: the query's last QUERY_WINDOW tokens score (their
    cost grows with rows x workspace), and they hold the question."""
    from kvmem_core.prompt import QUERY_WINDOW

    question = f"Here is the build log: {filler(4, 12)} What is the secret passkey? Reply with the number."
    transcript = [*TRANSCRIPT[:-1], {"role": "user", "content": question}]
    assert len(engine.tokenize(question)) > QUERY_WINDOW
    scored, forward = [], engine.adapter.forward

    def counting(*args, **kwargs):
        out = forward(*args, **kwargs)
        scored.append(0 if out.queries is None else out.queries.shape[1])
        return out

    monkeypatch.setattr(engine.adapter, "forward", counting)
    text = engine.adapter.render_chat(transcript)
    key_block = len(engine.tokenize(text[: text.index(PASSKEY)])) // CFG.block_tokens
    found = engine.step(chat(transcript, max_tokens=12), lambda piece: True)
    assert sum(scored) == QUERY_WINDOW
    assert key_block in found.selection["blocks"] and PASSKEY in found.text


def test_a_replay_from_a_block_edge_continues_from_a_resident_token(engine):
    """The replay after a selection starts ``recent_tokens`` before the prompt's end. On a block edge, the block
    before it is outside the recent window, and llama.cpp decodes only a batch that continues the view's last
    position: that block must stay in the view."""
    bt, question = CFG.block_tokens, f"{filler(5, 30)} What is the secret passkey? Reply with the number."
    for pad in range(2 * bt):
        messages = [
            *TRANSCRIPT[:2],
            {"role": "user", "content": f"More notes: {filler(3, 38)}" + " ok" * pad},
            TRANSCRIPT[3],
            {"role": "user", "content": question},
        ]
        n = len(engine.tokenize(engine.adapter.render_chat(messages)))
        if n % bt == 0:
            break
    query_start = len(engine.tokenize(engine.adapter.render_chat(messages[:4], add_generation_prompt=False)))
    r0 = n - CFG.recent_tokens
    assert n % bt == 0 and query_start < r0, "the replay must start on a block edge"
    # sink + recent window + four oracle blocks fill the budget: nothing else would bring the block before r0
    out = engine.step(chat(messages, max_tokens=4, blocks=[1, 2, 3, 4], groups=False), lambda piece: True)
    assert r0 // bt - 1 in out.selection["blocks"]
    assert out.selection["replayed_tokens"] == CFG.recent_tokens
