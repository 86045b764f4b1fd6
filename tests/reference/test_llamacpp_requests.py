"""Per-request guarantees of the engine on the real small model: stop strings stream exactly the final text,
requests over the limits are refused before any work."""

from __future__ import annotations

from typing import Iterator

import pytest

from kvmem_core.config import KVMemConfig
from kvmem_core.contract import SamplingParams, StepRequest
from kvmem_core.engine import KVMemEngine
from kvmem_core.errors import ConfigError, LimitError
from kvmem_core.prompt import MAX_MESSAGES
from llamacpp_support import chat, model_path

pytestmark = pytest.mark.llamacpp
CFG = KVMemConfig(ctx=4096, budget=2048, gen_budget=512)
SEA = [{"role": "user", "content": "Write one sentence about the sea."}]


@pytest.fixture(scope="module")
def engine() -> Iterator[KVMemEngine]:
    from kvmem_llamacpp import create_adapter

    e = KVMemEngine(create_adapter(str(model_path()), CFG), CFG)
    yield e
    e.close()


def streamed(engine: KVMemEngine, request: StepRequest) -> tuple[str, str, str]:
    pieces: list[str] = []
    result = engine.step(request, lambda piece: pieces.append(piece) is None)
    return "".join(pieces), result.text, result.finish_reason


def test_a_stop_string_split_over_tokens_streams_exactly_the_final_text(engine: KVMemEngine) -> None:
    free = engine.step(chat(SEA, 24), lambda piece: True)
    pieces = [engine.adapter.token_bytes(t).decode() for t in free.token_ids]
    k = next(i for i in range(4, len(pieces) - 1) if len(pieces[i]) > 1 and len(pieces[i + 1]) > 3)
    stop = pieces[k][-1] + pieces[k + 1][:3]  # ends one token, starts the next
    request = StepRequest(messages=tuple(SEA), sampling=SamplingParams(temperature=0.0, max_tokens=24, stop=(stop,)))
    sent, final, finish = streamed(engine, request)
    assert finish == "stop" and final == "".join(pieces[: k + 1])[:-1]
    assert sent == final


def test_a_request_over_the_limits_is_refused_before_anything_changes(engine: KVMemEngine) -> None:
    before = engine.list_workspaces()
    with pytest.raises(LimitError, match="max_tokens"):
        engine.step(chat(SEA, CFG.ctx + 1), lambda piece: True)
    with pytest.raises(LimitError, match="messages"):
        engine.count_tokens(chat(SEA * (MAX_MESSAGES + 1)))
    assert engine.list_workspaces() == before


def test_retrieval_heads_outside_the_model_are_refused_at_load() -> None:
    from kvmem_llamacpp import create_adapter

    adapter = create_adapter(str(model_path()), CFG)
    try:
        with pytest.raises(ConfigError, match=r"retrieval heads 99:0 are outside this model \(30 attention layers"):
            KVMemEngine(adapter, CFG.replace(retrieval_heads=((99, 0), (3, 1))))
    finally:
        adapter.close()
