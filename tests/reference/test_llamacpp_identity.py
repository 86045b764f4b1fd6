"""With the whole workspace in budget, KVMem on llama.cpp equals plain llama-cpp-python bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from kvmem_core.config import KVMemConfig
from llamacpp_support import N_BATCH, PARAGRAPH, Plain, chat, common_prefix, model_path

pytestmark = pytest.mark.llamacpp
CFG = KVMemConfig(ctx=4096, budget=2048, gen_budget=512, block_tokens=64, sink_tokens=64, recent_tokens=256)


@pytest.fixture(scope="module")
def engine(gpu_layers):
    from kvmem_core.engine import KVMemEngine
    from kvmem_llamacpp import create_adapter

    adapter = create_adapter(str(model_path()), CFG, n_batch=N_BATCH, n_gpu_layers=gpu_layers)
    eng = KVMemEngine(adapter, CFG, heads=((17, 3),))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def plain(gpu_layers):
    return Plain(model_path(), n_gpu_layers=gpu_layers)


def test_cold_prompt_over_several_chunks_is_bit_identical(engine, plain):
    messages = [{"role": "user", "content": PARAGRAPH * 9 + "Where did the ships dock?"}]
    result = engine.step(chat(messages), lambda piece: True)
    assert result.prompt_tokens > 2 * N_BATCH and result.cached_tokens == 0
    first, tokens = plain.run(engine.tokenize(engine.adapter.render_chat(messages)), 0, 8)
    assert np.array_equal(engine.last_logits, first)
    assert list(result.token_ids) == tokens
    assert result.selection["method"] == "full"


def test_second_turn_prefills_only_its_suffix_and_stays_identical(engine, plain):
    turn1 = [{"role": "user", "content": PARAGRAPH * 5 + "What did the ledger note?"}]
    r1 = engine.step(chat(turn1), lambda piece: True)
    ids1 = engine.tokenize(engine.adapter.render_chat(turn1))
    _, tokens1 = plain.run(ids1, r1.cached_tokens, 8)  # the view kept the shared system prompt
    assert list(r1.token_ids) == tokens1
    computed = plain.tokens()
    assert computed == ids1 + list(r1.token_ids)[: len(computed) - len(ids1)]
    turn2 = turn1 + [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "And the weather?"}]
    ids2 = engine.tokenize(engine.adapter.render_chat(turn2))
    r2 = engine.step(chat(turn2), lambda piece: True)
    expected_hit = common_prefix(ids2, computed)
    assert expected_hit > len(ids1)
    assert r2.cached_tokens == expected_hit
    assert r2.timings["prefill_tokens"] == len(ids2) - expected_hit
    first, tokens = plain.run(ids2, expected_hit, 8)
    assert np.array_equal(engine.last_logits, first)
    assert list(r2.token_ids) == tokens
    _, cold = plain.run(ids2, 0, 8)
    assert list(r2.token_ids) == cold


@pytest.mark.slow  # ~20 s
def test_full_after_a_retrieval_step_recomputes_what_saw_the_selection(engine, plain):
    messages = [{"role": "user", "content": PARAGRAPH * 30 + "Which details did the ledger keep for each ship?"}]
    ids = engine.tokenize(engine.adapter.render_chat(messages))
    small = engine.step(chat(messages, 8, budget=512), lambda piece: True)
    assert small.selection["method"] == "retrieval" and small.selection["replayed_tokens"] > 0
    result = engine.step(chat(messages, 8, method="full"), lambda piece: True)
    assert result.cached_tokens <= len(ids) - small.selection["replayed_tokens"]
    plain.run(ids, 0, 1)  # the prefix as the first step computed it, then the rest as the second did
    first, tokens = plain.run(ids, result.cached_tokens, 8)
    assert np.array_equal(engine.last_logits, first)
    assert list(result.token_ids) == tokens
