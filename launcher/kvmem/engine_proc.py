"""The engine process: one loaded ``Engine`` serving steps one at a time over ZMQ.

Started by the API server as ``python -m kvmem.engine_proc IN_ADDR OUT_ADDR SPEC_JSON``; it
connects a PULL socket to ``IN_ADDR`` (requests) and a PUSH socket to ``OUT_ADDR`` (replies),
loads the engine, says ``Ready`` and serves. Text pieces stream back as ``Text`` frames while
a step runs. Between prefill chunks and between decoded pieces it reads its inbox, so an
``Abort`` (client gone) stops the step within one chunk: during decode the step ends early
(``Done``); during prefill it stops there (``Failed`` 499 ``client_gone``, which frees the
server's slot), and the blocks completed before it stay stored, so a retry reuses them.
An error caused by one request fails that request only (a ``KVMemError`` with its status,
anything else a 500) and the engine serves on. Only errors that leave the process unusable
are fatal (``is_fatal``): the process sends ``Dead`` and exits non-zero, and the server
restarts it.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import sys
from typing import Any

import msgspec
import zmq

from kvmem import protocol as P
from kvmem.output_parser import ChatFormat
from kvmem_core.contract import Engine
from kvmem_core.errors import KVMemError

log = logging.getLogger("kvmem.engine")
FATAL_TYPES = (MemoryError, OSError, AssertionError, SystemError, zmq.ZMQError)
# a disk full, read-only or failing under a file the engine writes: that request fails, the process is sound
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO})
DEVICE_FAULTS = (
    "out of memory",
    "CUDA error",
    "HIP error",
    "device-side assert",
    "illegal memory access",
    "CUBLAS_STATUS",
    "cuDNN error",
    "NCCL error",
)


class StepAborted(Exception):
    """The client of the running step left (its ``Abort`` arrived) while the step prefilled."""


def load(spec: P.EngineSpec) -> Engine:
    """Load the engine ``spec`` names (imported lazily: the server process never loads models)."""
    from kvmem.engines import load_engine

    return load_engine(spec.backend, spec.model, P.config_from_wire(spec.config), **spec.opts)


def is_fatal(exc: BaseException) -> bool:
    """True for errors after which this process cannot be trusted: out of memory, a lost or faulted device,
    an ``OSError`` other than a storage fault (``STORAGE_ERRNOS``: the store turns its NVMe tier off on those and
    serves on; one reaching here fails its request only), a broken internal invariant (``AssertionError``), a
    dead socket."""
    if isinstance(exc, OSError) and exc.errno in STORAGE_ERRNOS:
        return False
    if isinstance(exc, FATAL_TYPES):
        return True
    return isinstance(exc, RuntimeError) and any(fault in str(exc) for fault in DEVICE_FAULTS)


def request_error(req_id: str, exc: BaseException) -> P.Failed | None:
    """The ``Failed`` frame for an error that harms only its request, or None when ``exc`` is fatal."""
    if isinstance(exc, KVMemError):
        return P.Failed(id=req_id, status=exc.http_status, code=exc.code, message=str(exc))
    if is_fatal(exc):
        return None
    if isinstance(exc, OSError):
        return P.Failed(id=req_id, status=503, code="storage_error", message=f"storage error: {exc}")
    log.error("request %s failed", req_id, exc_info=exc)
    return P.Failed(
        id=req_id, status=500, code="internal_error", message=f"internal error: {type(exc).__name__}: {exc}"
    )


class EngineLoop:
    """Reads frames, runs each request to its end, writes replies; one request at a time."""

    def __init__(self, engine: Engine, inbox: zmq.Socket, outbox: zmq.Socket) -> None:
        self.engine = engine
        self.inbox = inbox
        self.outbox = outbox
        self.pending: collections.deque[P.Message] = collections.deque()
        self.aborted: set[str] = set()
        self.parent = os.getppid()
        self.running: str | None = None
        setattr(engine, "prefill_progress", self.check_abort)  # KVMemEngine reports each prefill chunk
        setattr(engine, "decode_alive", self.still_wanted)  # and asks after each decoded token

    def send(self, msg: Any) -> None:
        self.outbox.send(P.encode(msg))

    def run(self) -> None:
        """Serve until a ``Shutdown`` frame; a fatal error propagates to the caller."""
        while True:
            msg = self.pending.popleft() if self.pending else self.receive()
            if isinstance(msg, P.Shutdown):
                return
            if isinstance(msg, P.Step):
                self.step(msg)
            elif isinstance(msg, P.Call):
                self.call(msg)
            self.aborted.clear()

    def receive(self) -> P.Message:
        """The next frame; a ``Shutdown`` if the server process is gone (it may have been killed)."""
        while not self.inbox.poll(1000):
            if os.getppid() != self.parent:
                return P.Shutdown()
        return P.decode(self.inbox.recv())

    def drain(self) -> None:
        """Read whatever arrived without blocking: aborts apply now, the rest waits its turn."""
        while self.inbox.poll(0):
            msg = P.decode(self.inbox.recv())
            if isinstance(msg, P.Abort):
                self.aborted.add(msg.id)
            else:
                self.pending.append(msg)

    def check_abort(self, done: int, total: int) -> None:
        """Between prefill chunks: raise ``StepAborted`` if the running step's client has left."""
        self.drain()
        if self.running in self.aborted:
            raise StepAborted(f"client gone after {done} of {total} prefill tokens")

    def still_wanted(self) -> bool:
        """After each decoded token: False once the running step's client has left (decode ends there)."""
        self.drain()
        return self.running not in self.aborted

    def step(self, msg: P.Step) -> None:
        self.drain()
        if msg.id in self.aborted:
            self.send(client_gone(msg.id, "client gone before the step started"))
            return

        def on_text(piece: str) -> bool:
            self.send(P.Text(id=msg.id, text=piece))
            self.drain()
            return msg.id not in self.aborted

        self.running = msg.id
        try:
            result = self.engine.step(
                P.from_wire_request(msg.request),
                on_text,
                lambda ws_id: self.send(P.Started(id=msg.id, workspace_id=ws_id)),
            )
        except StepAborted as exc:
            self.send(client_gone(msg.id, str(exc)))
            return
        except Exception as exc:
            self.fail(msg.id, exc)
            return
        finally:
            self.running = None
        self.send(P.Done(id=msg.id, result=P.to_wire_result(result), metrics=self.engine.metrics()))

    def call(self, msg: P.Call) -> None:
        try:
            value = self.dispatch(msg)
        except Exception as exc:
            self.fail(msg.id, exc)
            return
        self.send(P.Reply(id=msg.id, value=value))

    def dispatch(self, msg: P.Call) -> Any:
        op, arg, engine = msg.op, msg.arg or "", self.engine
        if op == "count_tokens" and msg.request is not None:
            return engine.count_tokens(P.from_wire_request(msg.request))
        calls = {
            "tokenize": lambda: engine.tokenize(arg),
            "list_workspaces": engine.list_workspaces,
            "workspace_info": lambda: engine.workspace_info(arg),
            "delete_workspace": lambda: engine.delete_workspace(arg),
            "pin_workspace": lambda: engine.pin_workspace(arg, True),
            "unpin_workspace": lambda: engine.pin_workspace(arg, False),
            "export_workspace": lambda: engine.export_workspace(arg, msg.path or ""),
            "import_workspace": lambda: engine.import_workspace(msg.path or ""),
            "metrics": engine.metrics,
        }
        if op not in calls:
            raise KVMemError(f"unknown engine call {op!r}")
        return calls[op]()

    def fail(self, req_id: str, exc: Exception) -> None:
        failed = request_error(req_id, exc)
        if failed is None:
            raise exc
        self.send(failed)


def client_gone(req_id: str, why: str) -> P.Failed:
    """The end of a step whose client left: nobody reads it, but it frees the server's step slot."""
    return P.Failed(id=req_id, status=499, code="client_gone", message=why)


def serve(in_addr: str, out_addr: str, spec: P.EngineSpec) -> int:
    """Load, announce, serve; returns the process exit code."""
    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.connect(in_addr)
    outbox.connect(out_addr)
    outbox.setsockopt(zmq.LINGER, 2000)
    try:
        engine = load(spec)
    except Exception as exc:
        outbox.send(P.encode(P.Dead(message=f"engine failed to load: {type(exc).__name__}: {exc}")))
        return 1
    chat_format = P.to_wire_format(ChatFormat.detect(engine.chat_template))
    outbox.send(
        P.encode(
            P.Ready(
                model_id=engine.model_id,
                pid=os.getpid(),
                ctx=engine.config.ctx,
                chat_format=chat_format,
                metrics=engine.metrics(),
            )
        )
    )
    try:
        EngineLoop(engine, inbox, outbox).run()
    except Exception as exc:
        outbox.send(P.encode(P.Dead(message=f"engine error: {type(exc).__name__}: {exc}")))
        return 1
    finally:
        engine.close()
    return 0


def main(argv: list[str]) -> int:
    in_addr, out_addr, spec_json = argv
    return serve(in_addr, out_addr, msgspec.json.decode(spec_json, type=P.EngineSpec))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
