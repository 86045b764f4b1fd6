"""The engine wire: every message survives a round trip; foreign frames are refused."""

from __future__ import annotations

import time
from typing import Callable

import msgspec
import pytest

from kvmem import protocol as P
from kvmem_core.config import KVMemConfig
from kvmem_core.contract import SamplingParams, StepRequest, StepResult


def test_step_request_round_trips_through_a_frame() -> None:
    req = StepRequest(
        messages=({"role": "user", "content": "hi"},),
        tools=({"type": "function", "function": {"name": "f"}},),
        template_kwargs={"reasoning_effort": "low"},
        sampling=SamplingParams(0.0, 0.5, 7, 42, 9, ("END",)),
        overrides={"budget": 1024, "method": "recent"},
    )
    msg = P.decode(P.encode(P.Step(id="a", request=P.to_wire_request(req))))
    assert isinstance(msg, P.Step)
    assert P.from_wire_request(msg.request) == req


def test_step_result_round_trips_through_a_frame() -> None:
    result = StepResult(
        "text", (1, 2, 3), "stop", 10, 4, "ws1", {"blocks_selected": 2, "tiers": {"host": 1}}, {"select_s": 0.5}
    )
    msg = P.decode(P.encode(P.Done(id="a", result=P.to_wire_result(result), metrics={"blocks": 3.0})))
    assert isinstance(msg, P.Done)
    assert P.from_wire_result(msg.result) == result
    assert msg.metrics == {"blocks": 3.0}


@pytest.mark.parametrize(
    "msg",
    [
        P.Call(id="c", op="tokenize", arg="hello"),
        P.Abort(id="x"),
        P.Shutdown(),
        P.Ready(
            model_id="m", pid=1, ctx=4096, chat_format=P.WireChatFormat("hermes", ("<think>", "</think>")), metrics={}
        ),
        P.Started(id="x", workspace_id="ws-1"),
        P.Text(id="x", text="piece"),
        P.Reply(id="x", value=[1, 2]),
        P.Failed(id="x", status=413, code="budget_exceeded", message="too big"),
        P.Dead(message="boom"),
    ],
)
def test_every_message_round_trips(msg: P.Message) -> None:
    assert P.decode(P.encode(msg)) == msg


def test_foreign_version_is_refused() -> None:
    frame = P.encode(P.Abort(id="x", v=P.PROTOCOL_VERSION + 1))
    with pytest.raises(P.ProtocolError, match="protocol version"):
        P.decode(frame)


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\x93\x01\x02\x03",
        msgspec.msgpack.encode({"type": "Nope", "v": 1}),
        msgspec.msgpack.encode({"type": "Text", "v": 1, "id": 5, "text": "x"}),
    ],
)
def test_malformed_frames_are_refused(frame: bytes) -> None:
    with pytest.raises(P.ProtocolError):
        P.decode(frame)


def test_config_round_trips_including_retrieval_heads() -> None:
    config = KVMemConfig(
        budget=1024, recent_tokens=256, method="recent", retrieval_heads=((3, 1), (7, 4)), nvme_dir="/tmp/x"
    )
    wire = msgspec.json.decode(msgspec.json.encode(P.config_to_wire(config)))
    assert P.config_from_wire(wire) == config


def test_engine_spec_travels_as_json() -> None:
    spec = P.EngineSpec(backend="llama.cpp", model=None, config=P.config_to_wire(KVMemConfig()), opts={"device": "cpu"})
    assert msgspec.json.decode(msgspec.json.encode(spec), type=P.EngineSpec) == spec


def test_numpy_values_in_engine_dicts_travel_as_plain_numbers() -> None:
    import numpy as np

    msg = P.Reply(
        id="x", value={"blocks": np.int64(3), "scores": np.array([0.5, 0.25]), "path": __import__("pathlib").Path("/a")}
    )
    assert P.decode(P.encode(msg)).value == {"blocks": 3, "scores": [0.5, 0.25], "path": "/a"}


def test_request_errors_fail_one_request_and_only_unusable_engine_errors_are_fatal() -> None:
    from kvmem.engine_proc import request_error
    from kvmem_core.errors import BudgetError, CorruptBlockError, TemplateError

    assert request_error("r", BudgetError("spans")) == P.Failed(
        id="r", status=413, code="budget_exceeded", message="spans"
    )
    assert request_error("r", CorruptBlockError("bad")).status == 500
    failed = request_error("r", TemplateError("no tools here"))
    assert (failed.status, failed.code) == (400, "template_error") and "no tools here" in failed.message
    for exc in (
        TypeError("render() got multiple values for keyword argument 'tools'"),
        KeyError("x"),
        ValueError("y"),
        RuntimeError("a bug one request hit"),
    ):
        failed = request_error("r", exc)
        assert (failed.status, failed.code) == (500, "internal_error") and type(exc).__name__ in failed.message
    for code in (28, 30, 5):  # ENOSPC, EROFS, EIO: a disk fault fails its request only, never a restart loop
        failed = request_error("r", OSError(code, "disk fault"))
        assert (failed.status, failed.code) == (503, "storage_error")
    for exc in (
        MemoryError(),
        OSError(24, "Too many open files"),
        AssertionError("invariant"),
        RuntimeError("CUDA error: an illegal memory access was encountered"),
        RuntimeError("CUDA out of memory."),
    ):
        assert request_error("r", exc) is None


def test_a_step_aborted_before_it_starts_still_ends_so_the_server_frees_its_slot() -> None:
    """Its ``Abort`` came in with it: the engine never runs it (no engine call is made) but answers ``client_gone``;
    without that answer the server would hold the step slot for good."""
    import types

    import zmq

    from kvmem.engine_proc import EngineLoop

    ctx = zmq.Context()
    to_engine, inbox, outbox, from_engine = (ctx.socket(kind) for kind in (zmq.PUSH, zmq.PULL, zmq.PUSH, zmq.PULL))
    try:
        to_engine.bind("inproc://in")
        inbox.connect("inproc://in")
        from_engine.bind("inproc://out")
        outbox.connect("inproc://out")
        request = P.to_wire_request(StepRequest(messages=({"role": "user", "content": "hi"},)))
        for msg in (P.Step(id="s", request=request), P.Abort(id="s"), P.Shutdown()):
            to_engine.send(P.encode(msg))
        while not inbox.poll(100):
            pass
        EngineLoop(types.SimpleNamespace(), inbox, outbox).run()  # an engine with no methods: none may be called
        assert from_engine.poll(2000), "the aborted step ended without a word: its slot stays taken"
        reply = P.decode(from_engine.recv())
        assert isinstance(reply, P.Failed) and (reply.id, reply.status, reply.code) == ("s", 499, "client_gone")
    finally:
        ctx.destroy(linger=0)


def test_the_engine_loop_tells_decode_at_each_token_whether_its_client_is_still_there() -> None:
    """``decode_alive``, set on the engine, reads the aborts that arrived: True until the running step's ``Abort``
    comes in, then False (decode ends at that token); another request's abort changes nothing."""
    import types

    import zmq

    from kvmem.engine_proc import EngineLoop

    ctx = zmq.Context()
    to_engine, inbox = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    try:
        to_engine.bind("inproc://in")
        inbox.connect("inproc://in")
        engine = types.SimpleNamespace()
        loop = EngineLoop(engine, inbox, ctx.socket(zmq.PUSH))
        loop.running = "s"
        assert engine.decode_alive() is True
        to_engine.send(P.encode(P.Abort(id="other")))
        assert until(lambda: engine.decode_alive() and "other" in loop.aborted)
        to_engine.send(P.encode(P.Abort(id="s")))
        assert until(lambda: not engine.decode_alive())
    finally:
        ctx.destroy(linger=0)


def until(check: Callable[[], bool], timeout: float = 2.0) -> bool:
    """Whether ``check`` holds within ``timeout`` (a frame crosses the socket in the meantime)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
