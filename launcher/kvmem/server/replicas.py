"""Several engine processes behind one API process: ``ReplicaSet`` routes every request to one replica.

A step goes to the replica that last served its conversation, found in a small LRU table by
the step's routing keys (``routing_keys``): its ``prompt_cache_key``, the workspace it
prefers (a ``previous_response_id``'s), and its conversation's opening. A step with no
known key, or whose replica is not ready or has a full queue, goes to the least-loaded
ready replica, and the table then follows it there. Each replica keeps its own queue bound
(``--max-queue``): a request gets 429 only when every ready replica's queue is full, so the
server holds at most N × (1 + max-queue) requests. A step that fails before its first piece
because its replica died or was full is tried on another; once text has streamed, the
failure is the client's. With a shared ``--kvmem-nvme-dir`` a replica that never saw a
conversation adopts its blocks from disk (``kvmem_core.store``), so a moved conversation
keeps its prefix hits. Non-generating calls go to the replica holding the workspace they
name (every replica is asked when the table does not know it), or to the least-loaded one.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from collections import OrderedDict
from typing import Any, AsyncIterator, Callable, Iterable

from kvmem import protocol as P
from kvmem.output_parser import ChatFormat
from kvmem.server.engine_client import EngineClient
from kvmem.server.errors import APIError, engine_unavailable
from kvmem_core.contract import StepRequest, StepResult
from kvmem_core.store import REPLICA_ENV

WORKSPACE_OPS = ("workspace_info", "delete_workspace", "pin_workspace", "unpin_workspace", "export_workspace")
OPENING_CHARS = 2048  # of a raw prompt: its start stands in for the first block
RETRY_STATUSES = (429, 503)


class RouteTable:
    """The replica that last served each routing key; the newest ``capacity`` keys are kept (LRU)."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._replica: OrderedDict[str, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._replica)

    def get(self, keys: Iterable[str]) -> int | None:
        """The replica of the first known key, or None; a hit counts as a use."""
        for key in keys:
            if key in self._replica:
                self._replica.move_to_end(key)
                return self._replica[key]
        return None

    def put(self, keys: Iterable[str], replica: int) -> None:
        """Route every key to ``replica`` from now on."""
        for key in keys:
            self._replica[key] = replica
            self._replica.move_to_end(key)
        while len(self._replica) > self.capacity:
            self._replica.popitem(last=False)


def routing_keys(request: StepRequest) -> list[str]:
    """A step's routing keys, most specific first: its cache key, its preferred workspace, and, without a cache
    key, a hash of its conversation's opening (system, tools and first user message; a raw prompt's first
    characters). The API process cannot compute the first block's chain hash without tokenizing; the opening
    determines it. A cache key routes on its own: every step under it goes where the key went, whatever its opening."""
    keys = []
    if request.cache_key is not None:
        keys.append(f"key:{request.cache_key}")
    if request.workspace_id is not None:
        keys.append(f"ws:{request.workspace_id}")
    return keys if request.cache_key is not None else keys + [f"open:{_opening_hash(request)}"]


def _opening_hash(request: StepRequest) -> str:
    if request.messages is None:
        opening: Any = (request.prompt or "")[:OPENING_CHARS]
    else:
        first_user = next((i for i, m in enumerate(request.messages) if m.get("role") == "user"), len(request.messages))
        opening = [list(request.messages[: first_user + 1]), request.tools]
    blob = json.dumps(opening, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


class ReplicaSet:
    """``EngineClient``'s interface over several engine clients; see the module docstring."""

    def __init__(self, clients: list[EngineClient], table: RouteTable | None = None) -> None:
        assert clients, "a replica set needs a replica"
        self.clients = clients
        self.table = table or RouteTable()
        self._turn = 0  # where the next tie among equally loaded replicas starts

    @property
    def state(self) -> str:
        """``ready`` while any replica is; else the first replica's state."""
        return "ready" if self._ready() else self.clients[0].state

    @property
    def model_id(self) -> str:
        return next((c.model_id for c in self.clients if c.model_id), "")

    @property
    def ctx(self) -> int | None:
        """The largest workspace a ready replica reported (all run the same configuration)."""
        return max((c.ctx for c in self.clients if c.ctx), default=None)

    @property
    def chat_format(self) -> ChatFormat:
        return next((c.chat_format for c in self.clients if c.model_id), self.clients[0].chat_format)

    @property
    def pid(self) -> int | None:
        return self.clients[0].pid

    @property
    def busy(self) -> int:
        return sum(c.busy for c in self.clients)

    @property
    def restarts(self) -> int:
        return sum(c.restarts for c in self.clients)

    @property
    def metrics(self) -> dict[str, float]:
        """The engines' metrics summed over the replicas."""
        total: dict[str, float] = {}
        for client in self.clients:
            for name, value in client.metrics.items():
                total[name] = total.get(name, 0) + value
        return total

    def describe(self) -> list[dict[str, Any]]:
        """Each replica's state, engine pid, queue, restarts and workspaces as of its last step (``/health``)."""
        return [
            {
                "replica": i,
                "state": c.state,
                "engine_pid": c.pid,
                "busy": c.busy,
                "restarts": c.restarts,
                "workspaces": int(c.metrics.get("store_workspaces", 0)),
            }
            for i, c in enumerate(self.clients)
        ]

    async def start(self) -> None:
        """Start every replica; ``RuntimeError`` if any fails to load."""
        await asyncio.gather(*(c.start() for c in self.clients))

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients))

    async def generate(
        self, request: StepRequest, on_start: Callable[[str], None] | None = None
    ) -> AsyncIterator[str | StepResult]:
        """``EngineClient.generate`` on the replica the routing picks, retried on another while nothing has
        streamed and the replica was full or died; the table learns where the step ran."""
        keys = routing_keys(request)
        tried: set[int] = set()
        while True:
            index = self._pick(self.table.get(keys), tried)
            tried.add(index)

            def started(workspace_id: str, index: int = index) -> None:
                self.table.put([*keys, f"ws:{workspace_id}"], index)
                if on_start is not None:
                    on_start(workspace_id)

            streamed = False
            try:
                async with contextlib.aclosing(self.clients[index].generate(request, started)) as gen:
                    async for item in gen:
                        streamed = True
                        yield item
                return
            except APIError as exc:
                if streamed or exc.status not in RETRY_STATUSES or len(tried) == len(self.clients):
                    raise

    async def call(
        self, op: str, arg: str | None = None, request: StepRequest | None = None, path: str | None = None
    ) -> Any:
        """``EngineClient.call`` routed: listings merged over the ready replicas, workspace calls to the replica
        holding the workspace, the rest to the least-loaded replica."""
        if op == "list_workspaces":
            return await self._list_workspaces()
        if op in WORKSPACE_OPS:
            return await self._workspace_call(op, arg or "", path)
        index = self._pick(None, set())
        value = await self.clients[index].call(op, arg, request, path)
        if op == "import_workspace" and isinstance(value, dict):
            self.table.put([f"ws:{value['id']}"], index)
        return value

    async def _list_workspaces(self) -> list[dict[str, Any]]:
        ready = [i for i in range(len(self.clients)) if self.clients[i].state == "ready"]
        if not ready:
            raise engine_unavailable(f"the engine is {self.state}")
        listings = await asyncio.gather(*(self.clients[i].call("list_workspaces") for i in ready))
        merged = [summary for listing in listings for summary in listing]
        return sorted(merged, key=lambda summary: summary["last_used"], reverse=True)

    async def _workspace_call(self, op: str, ws_id: str, path: str | None) -> Any:
        """Ask the replica the table names, then the others, until one holds the workspace (a truthy value). If
        none does and one could not answer, its 503: the workspace may be there."""
        home = self.table.get([f"ws:{ws_id}"])
        order = sorted(range(len(self.clients)), key=lambda i: i != home)
        value: Any = None
        unavailable: APIError | None = None
        for index in order:
            try:
                value = await self.clients[index].call(op, ws_id, path=path)
            except APIError as exc:
                if exc.status != 503:
                    raise
                unavailable = exc
                continue
            if value:
                self.table.put([f"ws:{ws_id}"], index)
                return value
        if unavailable is not None:
            raise unavailable
        return value

    def _pick(self, home: int | None, tried: set[int]) -> int:
        """The replica to ask next: ``home`` when it is ready with room in its queue, else the least-loaded
        ready one with room (ties taken in turn, so idle replicas share new conversations), else any not yet
        tried (its refusal is the answer)."""
        count = len(self.clients)

        def rank(i: int) -> tuple[bool, bool, bool, int, int]:
            client = self.clients[i]
            return (
                client.state != "ready",
                client.busy > client.max_queue,
                i != home,
                client.busy,
                (i - self._turn) % count,
            )

        candidates = [i for i in range(count) if i not in tried]
        if not candidates:
            raise engine_unavailable(f"the engine is {self.state}")
        chosen = min(candidates, key=rank)
        if chosen != home:
            self._turn = chosen + 1
        return chosen

    def _ready(self) -> bool:
        return any(c.state == "ready" for c in self.clients)


def replica_envs(count: int, gpus: list[int], env: dict[str, str], visible_var: str) -> list[dict[str, str]]:
    """Each replica's environment: ``env`` plus, with ``gpus`` (one per replica), its own device through
    ``visible_var`` (``CUDA_VISIBLE_DEVICES``/``HIP_VISIBLE_DEVICES``), and, when there are several, its owner
    name in the shared NVMe directory. Without GPUs the replicas share the CPU."""
    assert not gpus or len(gpus) == count
    envs = []
    for i in range(count):
        replica = dict(env)
        if gpus:
            replica[visible_var] = str(gpus[i])
        if count > 1:
            replica[REPLICA_ENV] = f"r{i}"
        envs.append(replica)
    return envs


def make_engine(spec: P.EngineSpec, max_queue: int, envs: list[dict[str, str]]) -> EngineClient | ReplicaSet:
    """One ``EngineClient`` for one environment (the single-engine server, unchanged), a ``ReplicaSet`` for
    several."""
    if len(envs) == 1:
        return EngineClient(spec, max_queue=max_queue, env=envs[0])
    return ReplicaSet([EngineClient(spec, max_queue=max_queue, env=env) for env in envs])
