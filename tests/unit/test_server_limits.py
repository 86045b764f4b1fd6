"""Per-request limits: too many messages or too many tokens asked are a 400, every engine call queues (429), and the
body limit follows the workspace the engine reports."""

from __future__ import annotations

import asyncio
import json
from typing import Iterator

import pytest
import zmq
from kvmem import protocol as P
from kvmem.server.engine_client import EngineClient
from kvmem.server.errors import APIError
from serving import AppClient

from kvmem_core.config import KVMemConfig
from kvmem_core.contract import SamplingParams, StepRequest
from kvmem_core.errors import LimitError
from kvmem_core.prompt import MAX_MESSAGES, check_request

CONFIG = KVMemConfig(ctx=4096)
MESSAGE = {"role": "user", "content": "hi"}


@pytest.fixture(scope="module")
def client() -> Iterator[AppClient]:
    c = AppClient(max_body_bytes=8 << 20)  # the default body limit: 65,537 tiny messages fit it
    yield c
    c.close()


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": [MESSAGE] * (MAX_MESSAGES + 1)}, "messages"),
        ("/v1/messages", {"messages": [MESSAGE] * (MAX_MESSAGES + 1), "max_tokens": 4}, None),
        ("/v1/responses", {"input": [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)}, "input"),
    ],
)
def test_a_body_of_too_many_messages_is_a_400_before_the_engine(
    client: AppClient, path: str, body: dict, param: str | None
) -> None:
    status, _, reply = client.request("POST", path, json=body)
    data = json.loads(reply)
    assert status == 400 and str(MAX_MESSAGES) in json.dumps(data)
    if param is not None:
        assert data["error"]["param"] == param and data["error"]["code"] == "invalid_value"


def test_the_engine_refuses_too_many_messages_and_max_tokens_over_ctx() -> None:
    check_request(StepRequest(messages=(MESSAGE,) * MAX_MESSAGES, sampling=SamplingParams(max_tokens=4096)), CONFIG)
    with pytest.raises(LimitError, match=f"at most {MAX_MESSAGES}"):
        check_request(StepRequest(messages=(MESSAGE,) * (MAX_MESSAGES + 1)), CONFIG)
    with pytest.raises(LimitError, match="--ctx is 4096") as exc:
        check_request(StepRequest(prompt="hi", sampling=SamplingParams(max_tokens=4097)), CONFIG)
    assert (exc.value.http_status, exc.value.code) == (400, "limit_exceeded")


def ready_engine(max_queue: int = 16) -> EngineClient:
    """A client whose engine counts as ready; nothing is spawned (frames it sends go nowhere)."""
    engine = EngineClient(
        P.EngineSpec(backend="llama.cpp", model=None, config=P.config_to_wire(CONFIG)), max_queue=max_queue
    )
    engine.state = "ready"
    engine._ready.set()
    return engine


def test_a_number_the_wire_cannot_carry_is_a_400_and_never_holds_the_step_slot() -> None:
    async def go() -> APIError:
        engine = ready_engine()
        request = StepRequest(messages=(MESSAGE,), template_kwargs={"n": -(2**63) - 1})
        try:
            async for _ in engine.generate(request):
                pass
        except APIError as exc:
            assert not engine._slot.locked() and engine.busy == 0
            return exc
        finally:
            await engine.close()
        raise AssertionError("the step was not refused")

    err = asyncio.run(go())
    assert (err.status, err.code) == (400, "invalid_value")


@pytest.mark.parametrize(
    ("op", "arg"),
    [
        ("tokenize", "hi"),
        ("count_tokens", None),
        ("list_workspaces", None),
        ("workspace_info", "ws-1"),
        ("delete_workspace", "ws-1"),
    ],
)
def test_engine_calls_queue_with_the_steps_and_get_429_past_the_bound(op: str, arg: str | None) -> None:
    async def go() -> APIError:
        engine = ready_engine(max_queue=1)
        await engine._slot.acquire()  # a step runs
        engine.waiting = 1  # and one waits
        try:
            await engine.call(op, arg, StepRequest(messages=(MESSAGE,)) if op == "count_tokens" else None)
        except APIError as exc:
            return exc
        finally:
            await engine.close()
        raise AssertionError("the call was not refused")

    err = asyncio.run(go())
    assert (err.status, err.code, err.headers) == (429, "queue_full", {"Retry-After": "1"})


def test_a_request_the_socket_refuses_fails_with_503_at_once_and_frees_the_slot(tmp_path) -> None:
    """A PUSH socket with no engine connected refuses a non-blocking send: the request is not left waiting for
    a reply that cannot come, and the next one finds the slot free."""

    async def go() -> list[APIError]:
        engine = ready_engine()
        engine._push = engine._ctx.socket(zmq.PUSH)
        engine._push.bind(f"ipc://{tmp_path}/nobody")
        errors = []
        try:
            for _ in range(2):
                try:
                    await asyncio.wait_for(_drain(engine.generate(StepRequest(messages=(MESSAGE,)))), 2)
                except APIError as exc:
                    errors.append(exc)
            try:
                await asyncio.wait_for(engine.call("tokenize", "hi"), 2)
            except APIError as exc:
                errors.append(exc)
            assert not engine._slot.locked() and engine.busy == 0
        finally:
            engine._push.close(0)
            await engine.close()
        return errors

    errors = asyncio.run(go())
    assert [(e.status, e.code) for e in errors] == [(503, "engine_unavailable")] * 3
    assert "could not be sent" in errors[0].message and errors[0].headers == {"Retry-After": "2"}


async def _drain(stream) -> None:  # noqa: ANN001 - an async generator
    async for _ in stream:
        pass


def test_the_body_limit_follows_the_workspace_the_engine_reports() -> None:
    from kvmem.server.app import BODY_BYTES_PER_TOKEN, BODY_FLOOR, body_limit

    assert body_limit(None) == body_limit(4096) == BODY_FLOOR
    assert body_limit(1 << 20) == (1 << 20) * BODY_BYTES_PER_TOKEN  # 16 MiB for a 1M-token workspace
    client = AppClient(max_body_bytes=None)  # the default: auto
    body = {"messages": [{"role": "user", "content": "x" * (BODY_FLOOR + 1024)}]}
    try:
        status, _, reply = client.request("POST", "/v1/chat/completions", json=body)
        assert status == 413 and json.loads(reply)["error"]["code"] == "body_too_large"  # no workspace size yet
        client.engine.ctx = 1 << 20  # what the engine's Ready says of a 1M-token workspace
        status, _, reply = client.request("POST", "/v1/chat/completions", json=body)
        assert status == 503, reply  # read whole and valid; the engine is not started here
    finally:
        client.close()
