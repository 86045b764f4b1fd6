"""The API side of the engine process: spawn it, talk to it, restart it when it dies.

Steps and calls are serialized: one runs in the engine while at most ``max_queue`` wait;
past that a request is refused with 429. The slot is held until the engine reports the
request's end, even when the client left early (its ``Abort`` makes that quick), so a new
step never races an old one. A request frame that cannot be sent fails its request with 503 at once
and frees the slot (the engine never saw it). When the process exits, in-flight requests fail with 503
and a fresh engine is spawned on new sockets; requests meanwhile get 503 with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import sys
import tempfile
import uuid
from typing import Any, AsyncIterator, Callable

import msgspec
import zmq
import zmq.asyncio

from kvmem import protocol as P
from kvmem.output_parser import ChatFormat
from kvmem.server.errors import APIError, engine_unavailable, invalid
from kvmem_core.contract import StepRequest, StepResult

log = logging.getLogger("kvmem.server")
READY_TIMEOUT_S = 600.0


class EngineClient:
    """Owns one engine process; ``generate`` and ``call`` are its request verbs."""

    def __init__(self, spec: P.EngineSpec, max_queue: int = 16, env: dict[str, str] | None = None) -> None:
        self.spec = spec
        self.max_queue = max_queue
        self.env = {**os.environ, **(env or {})}
        self.state = "stopped"
        self.model_id = ""
        self.ctx: int | None = None  # the engine's workspace size in tokens, once it said ready
        self.chat_format = ChatFormat()
        self.metrics: dict[str, float] = {}
        self.restarts = 0
        self.waiting = 0
        self.pid: int | None = None
        self._ctx = zmq.asyncio.Context()
        self._dir = tempfile.mkdtemp(prefix="kvmem-zmq-")
        self._generation = 0
        self._streams: dict[str, asyncio.Queue[P.Message]] = {}
        self._active: str | None = None
        self._slot = asyncio.Semaphore(1)
        self._ready = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._proc: asyncio.subprocess.Process | None = None
        self._last_dead = ""
        self._crashes = 0

    @property
    def busy(self) -> int:
        """Steps running or waiting (the queue length in metrics)."""
        return self.waiting + (self._active is not None)

    async def start(self) -> None:
        """Spawn the engine and wait for it; ``RuntimeError`` with its reason if it fails to load."""
        await self._spawn()
        await self._await_ready()

    async def close(self) -> None:
        """Ask the engine to exit, then make sure it did."""
        self.state = "stopped"
        for task in self._tasks:
            task.cancel()
        proc = self._proc
        if proc is not None and proc.returncode is None:
            self._send(P.Shutdown())
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()
        self._ctx.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)

    async def generate(
        self, request: StepRequest, on_start: Callable[[str], None] | None = None
    ) -> AsyncIterator[str | StepResult]:
        """Yield text pieces as the engine makes them, then the ``StepResult``; APIError on failure.
        ``on_start`` learns the step's workspace id before its first piece."""
        req_id = uuid.uuid4().hex
        frame = wire_frame(P.Step(id=req_id, request=P.to_wire_request(request)))
        queue = await self._open(req_id, frame)
        finished = False
        try:
            while True:
                msg = await queue.get()
                if isinstance(msg, P.Started):
                    if on_start is not None:
                        on_start(msg.workspace_id)
                    continue
                if isinstance(msg, P.Text):
                    yield msg.text
                    continue
                finished = True
                if isinstance(msg, P.Done):
                    yield P.from_wire_result(msg.result)
                    return
                raise _failure(msg)
        finally:
            self._streams.pop(req_id, None)
            if not finished:
                self._send(P.Abort(id=req_id))

    async def call(
        self, op: str, arg: str | None = None, request: StepRequest | None = None, path: str | None = None
    ) -> Any:
        """Run one non-generating engine call (``protocol.CALL_OPS``) and return its value. Calls queue with
        the steps (429 past ``max_queue``): tokenizing a large body ties the engine up as a step does."""
        assert op in P.CALL_OPS
        req_id = uuid.uuid4().hex
        wire = P.to_wire_request(request) if request is not None else None
        frame = wire_frame(P.Call(id=req_id, op=op, arg=arg, request=wire, path=path))
        queue = await self._open(req_id, frame)
        try:
            msg = await queue.get()
        finally:
            self._streams.pop(req_id, None)
        if isinstance(msg, P.Reply):
            return msg.value
        raise _failure(msg)

    async def _take_slot(self) -> None:
        if self.state != "ready":
            raise engine_unavailable(
                f"the engine is {self.state}" + (f": {self._last_dead}" if self._last_dead else "")
            )
        if self.waiting >= self.max_queue and self._slot.locked():
            raise APIError(
                429,
                f"server busy: {self.waiting} requests queued (--max-queue {self.max_queue})",
                "queue_full",
                headers={"Retry-After": "1"},
            )
        self.waiting += 1
        try:
            await self._slot.acquire()
        finally:
            self.waiting -= 1
        if not self._ready.is_set():
            self._slot.release()
            raise engine_unavailable()

    async def _open(self, req_id: str, frame: bytes) -> asyncio.Queue[P.Message]:
        """Take the slot, send the request's frame and return the queue its replies arrive on. A frame that
        cannot be sent (the socket refuses it) frees the slot and fails the request with 503 at once."""
        await self._take_slot()
        queue: asyncio.Queue[P.Message] = asyncio.Queue()
        self._streams[req_id] = queue
        self._active = req_id
        try:
            await self._push.send(frame, flags=zmq.NOBLOCK)  # settles at once: sent, or refused (no engine, full)
        except zmq.ZMQError as exc:
            self._streams.pop(req_id, None)
            self._release()
            log.error("could not send a request to the engine: %s", exc)
            raise engine_unavailable(f"the request could not be sent to the engine ({exc}); retry shortly") from None
        return queue

    def _send(self, msg: Any) -> None:
        """Push a control message (abort, shutdown) to the engine without waiting; a failure is logged."""
        try:
            sent = self._push.send(P.encode(msg), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("engine send failed: %s", exc)
            return
        sent.add_done_callback(_log_send_failure)

    async def _spawn(self) -> None:
        self._generation += 1
        in_addr = f"ipc://{self._dir}/in-{self._generation}"
        out_addr = f"ipc://{self._dir}/out-{self._generation}"
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.bind(in_addr)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(out_addr)
        self._ready.clear()
        self.state = "starting" if self._generation == 1 else "restarting"
        spec_json = msgspec.json.encode(self.spec).decode()
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "kvmem.engine_proc",
            in_addr,
            out_addr,
            spec_json,
            env=self.env,
            start_new_session=True,
        )
        self.pid = self._proc.pid
        self._tasks = [asyncio.create_task(self._read(self._pull)), asyncio.create_task(self._watch(self._proc))]

    async def _await_ready(self) -> None:
        ready = asyncio.create_task(self._ready.wait())
        exited = asyncio.create_task(self._proc.wait())
        await asyncio.wait([ready, exited], timeout=READY_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
        ready.cancel()
        exited.cancel()
        if not self._ready.is_set():
            raise RuntimeError(self._last_dead or "the engine process exited before it was ready")

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            try:
                msg = P.decode(await sock.recv())
            except P.ProtocolError as exc:
                log.error("dropped a frame from the engine: %s", exc)
                continue
            self._dispatch(msg)

    def _dispatch(self, msg: P.Message) -> None:
        if isinstance(msg, P.Ready):
            self.model_id, self.ctx, self.chat_format, self.metrics = (
                msg.model_id,
                msg.ctx,
                P.from_wire_format(msg.chat_format),
                msg.metrics,
            )
            self.state = "ready"
            self._last_dead = ""
            self._ready.set()
            log.info("engine ready: %s (pid %d), workspaces up to %d tokens", msg.model_id, msg.pid, msg.ctx)
        elif isinstance(msg, P.Dead):
            self._last_dead = msg.message
            log.error("engine died: %s", msg.message)
        elif isinstance(msg, (P.Started, P.Text, P.Done, P.Failed, P.Reply)):
            if isinstance(msg, P.Done):
                self.metrics = msg.metrics
            if msg.id in self._streams:
                self._streams[msg.id].put_nowait(msg)
            if msg.id == self._active and not isinstance(msg, (P.Started, P.Text)):
                self._release()

    def _release(self) -> None:
        self._active = None
        self._slot.release()

    async def _watch(self, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        if self.state == "stopped":
            return
        was_ready = self._ready.is_set()
        self._ready.clear()
        self._tasks[0].cancel()
        self._push.close(0)
        self._pull.close(0)
        self._fail_inflight(self._last_dead or f"engine process exited with code {code}")
        if self.state == "starting":
            self.state = "failed"
            return
        log.error("engine process exited with code %s; restarting", code)
        self._crashes = 0 if was_ready else self._crashes + 1
        await asyncio.sleep(min(0.5 * 2**self._crashes, 10.0) if self._crashes else 0)
        self.restarts += 1
        await self._spawn()

    def _fail_inflight(self, reason: str) -> None:
        for req_id, queue in list(self._streams.items()):
            queue.put_nowait(P.Failed(id=req_id, status=503, code="engine_died", message=reason))
        if self._active is not None:
            self._release()


def _log_send_failure(sent: asyncio.Future[Any]) -> None:
    if not sent.cancelled() and sent.exception() is not None:
        log.warning("engine send failed: %s", sent.exception())


def wire_frame(msg: P.Step | P.Call) -> bytes:
    """The frame for a request, made before it takes the step slot: a 400 when the request holds what the
    wire cannot carry (an integer over 64 bits), never a slot held for a frame that was not sent."""
    try:
        return P.encode(msg)
    except OverflowError as exc:
        raise invalid(f"the request holds a number the engine cannot take: {exc}", code="invalid_value") from None


def _failure(msg: P.Message) -> APIError:
    if isinstance(msg, P.Failed):
        headers = {"Retry-After": "2"} if msg.status == 503 else None
        return APIError(msg.status, msg.message, msg.code, headers=headers)
    return APIError(500, f"unexpected engine reply {type(msg).__name__}", "internal_error")
