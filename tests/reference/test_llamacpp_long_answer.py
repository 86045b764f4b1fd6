"""An answer longer than the generation reserve: old blocks leave the view, decoding goes on coherently."""

from __future__ import annotations

import re

import pytest

from kvmem_core.config import KVMemConfig
from kvmem_core.contract import SamplingParams, StepRequest
from llamacpp_support import model_path

pytestmark = pytest.mark.llamacpp
CFG = KVMemConfig(ctx=4096, budget=128, gen_budget=32, block_tokens=32, sink_tokens=32, recent_tokens=32)


def test_answer_longer_than_the_view_keeps_counting():
    from kvmem_core.engine import KVMemEngine
    from kvmem_llamacpp import create_adapter

    engine = KVMemEngine(create_adapter(str(model_path()), CFG), CFG, heads=((17, 3),))
    try:
        view = engine.adapter.caps.max_view_tokens
        prompt = ", ".join(str(i) for i in range(1, 60)) + ","
        request = StepRequest(prompt=prompt, sampling=SamplingParams(temperature=0.0, max_tokens=view + 32))
        result = engine.step(request, lambda piece: True)
        assert result.finish_reason == "length" and len(result.token_ids) == view + 32
        assert result.prompt_tokens + len(result.token_ids) > view
        assert engine.metrics()["blocks_dropped"] > 0 and engine.view.next_pos > view
        numbers = [int(x) for x in re.findall(r"\d+", result.text)]
        last = numbers[-21:-1]  # the final number may be cut by max_tokens mid-way
        assert numbers[:3] == [60, 61, 62] and last == list(range(last[0], last[0] + 20))
    finally:
        engine.close()


def test_blocks_an_answer_completes_are_stored_once_it_is_out():
    from kvmem_core.engine import KVMemEngine
    from kvmem_llamacpp import create_adapter

    engine = KVMemEngine(create_adapter(str(model_path()), CFG), CFG, heads=((17, 3),))
    try:
        request = StepRequest(prompt="1, 2, 3,", sampling=SamplingParams(temperature=0.0, max_tokens=100))
        result = engine.step(request, lambda piece: True)
        in_view = result.prompt_tokens + len(result.token_ids) - 1  # the last sampled token is not computed
        assert in_view // CFG.block_tokens >= 2 and len(result.token_ids) == 100
        assert len(engine.store.workspaces.get(result.workspace_id).hashes) == in_view // CFG.block_tokens
        assert result.timings["archive_s"] > 0  # exported after the answer, not between its tokens
    finally:
        engine.close()


def test_decode_stops_at_the_next_token_once_the_client_is_gone():
    """The model counts on from 59; a stop string it follows holds every piece back, so no text streams. The
    engine asks after each token whether the client is still there (``decode_alive``, the engine process's
    abort check): gone after the third token, decode ends there, the tokens so far committed."""
    from kvmem_core.engine import KVMemEngine
    from kvmem_llamacpp import create_adapter

    engine = KVMemEngine(create_adapter(str(model_path()), CFG), CFG, heads=((17, 3),))
    try:
        asked: list[int] = []
        engine.decode_alive = lambda: asked.append(1) is None and len(asked) < 3
        prompt = ", ".join(str(i) for i in range(1, 60)) + ","
        stop = " " + ", ".join(str(i) for i in range(60, 90))
        request = StepRequest(prompt=prompt, sampling=SamplingParams(temperature=0.0, max_tokens=60, stop=(stop,)))
        streamed: list[str] = []
        result = engine.step(request, streamed.append)
        assert result.finish_reason == "abort" and len(result.token_ids) == 3 and streamed == []
        assert stop.startswith(result.text)
    finally:
        engine.close()
