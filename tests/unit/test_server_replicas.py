"""ReplicaSet routing on stand-in engine clients: affinity by key, workspace and opening; least-loaded otherwise;
retry on another replica before the first piece; workspace calls to the holder; the LRU table's bound."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any, AsyncIterator, Callable

import pytest
from kvmem.server.errors import APIError
from kvmem.server.replicas import ReplicaSet, RouteTable, replica_envs, routing_keys

from kvmem_core.contract import StepRequest, StepResult


class FakeClient:
    """An engine client that answers at once: one workspace per conversation opening, or a scripted failure."""

    def __init__(self, name: str, max_queue: int = 2) -> None:
        self.name, self.max_queue = name, max_queue
        self.state, self.busy, self.model_id, self.metrics = "ready", 0, "m", {}
        self.fail: APIError | None = None
        self.steps: list[StepRequest] = []
        self.workspaces: dict[str, dict[str, Any]] = {}

    async def generate(
        self, request: StepRequest, on_start: Callable[[str], None] | None = None
    ) -> AsyncIterator[str | StepResult]:
        if self.fail is not None:
            raise self.fail
        self.steps.append(request)
        ws_id = f"{self.name}-ws{len(self.steps)}"
        self.workspaces[ws_id] = {"id": ws_id, "last_used": len(self.steps)}
        if on_start is not None:
            on_start(ws_id)
        yield "piece"
        yield StepResult("piece", (1,), "stop", 1, 0, ws_id)

    async def call(
        self, op: str, arg: str | None = None, request: StepRequest | None = None, path: str | None = None
    ) -> Any:
        if op == "list_workspaces":
            return list(self.workspaces.values())
        if op == "workspace_info":
            return self.workspaces.get(arg or "")
        return f"{op} by {self.name}"


def run(replicas: ReplicaSet, request: StepRequest) -> str:
    async def go() -> str:
        items = [item async for item in replicas.generate(request)]
        return items[-1].workspace_id

    return asyncio.run(go())


def chat(opening: str, key: str | None = None, turn: int = 1) -> StepRequest:
    messages = [{"role": "user", "content": opening}] + [{"role": "user", "content": str(i)} for i in range(1, turn)]
    return StepRequest(messages=tuple(messages), cache_key=key)


def test_conversations_stay_on_their_replica_and_new_ones_spread():
    a, b = FakeClient("a"), FakeClient("b")
    replicas = ReplicaSet([a, b])  # type: ignore[list-item]
    first = [run(replicas, chat(f"hello {i}")) for i in range(4)]
    assert [ws.split("-")[0] for ws in first] == ["a", "b", "a", "b"]
    second = [run(replicas, chat(f"hello {i}", turn=2)) for i in range(4)]
    assert [ws.split("-")[0] for ws in second] == ["a", "b", "a", "b"]
    assert run(replicas, StepRequest(messages=({"role": "user", "content": "x"},), workspace_id=first[1])).startswith(
        "b"
    )


def test_a_key_routes_whatever_the_opening_and_new_keys_spread():
    a, b = FakeClient("a"), FakeClient("b")
    replicas = ReplicaSet([a, b])  # type: ignore[list-item]
    home = run(replicas, chat("one", key="k")).split("-")[0]
    assert {run(replicas, chat(f"other {i}", key="k")).split("-")[0] for i in range(3)} == {home}
    assert [run(replicas, chat("same", key=f"k{i}")).split("-")[0] for i in range(2)] == ["b", "a"]


def test_a_busy_or_dead_replica_sends_its_conversation_elsewhere_and_the_table_follows():
    a, b = FakeClient("a"), FakeClient("b")
    replicas = ReplicaSet([a, b])  # type: ignore[list-item]
    assert run(replicas, chat("c")).startswith("a")
    a.fail = APIError(503, "the engine died", "engine_died")
    assert run(replicas, chat("c", turn=2)).startswith("b")  # tried a, then b
    a.fail, a.busy = None, 3  # back, but its queue is full
    assert run(replicas, chat("c", turn=3)).startswith("b")
    a.busy = 0
    assert run(replicas, chat("c", turn=4)).startswith("b")  # the table moved with the conversation


def test_every_replica_full_is_a_429_and_other_errors_are_not_retried():
    a, b = FakeClient("a"), FakeClient("b")
    replicas = ReplicaSet([a, b])  # type: ignore[list-item]
    a.fail = b.fail = APIError(429, "busy", "queue_full")
    with pytest.raises(APIError) as caught:
        run(replicas, chat("c"))
    assert caught.value.status == 429
    a.fail, b.fail = APIError(400, "bad", "invalid_request_error"), None
    with pytest.raises(APIError):
        run(replicas, chat("d"))
    assert not b.steps


def test_workspace_calls_reach_the_holder_and_listings_merge():
    a, b = FakeClient("a"), FakeClient("b")
    replicas = ReplicaSet([a, b])  # type: ignore[list-item]
    ids = [run(replicas, chat(f"c{i}")) for i in range(2)]
    replicas.table = RouteTable()  # forgotten: every replica is asked
    assert asyncio.run(replicas.call("workspace_info", ids[1]))["id"] == ids[1]
    assert asyncio.run(replicas.call("workspace_info", "nowhere")) is None
    listed = asyncio.run(replicas.call("list_workspaces"))
    assert sorted(w["id"] for w in listed) == sorted(ids)
    assert asyncio.run(replicas.call("tokenize", "x")).startswith("tokenize by")


def test_the_table_keeps_the_newest_keys():
    table = RouteTable(capacity=2)
    table.put(["x"], 0)
    table.put(["y"], 1)
    assert table.get(["x"]) == 0  # x is now the newest
    table.put(["z"], 1)
    assert table.get(["y"]) is None and table.get(["x", "z"]) == 0 and len(table) == 2


def test_routing_keys_and_replica_environments():
    keys = routing_keys(
        StepRequest(
            messages=(
                {"role": "system", "content": "s"},
                {"role": "user", "content": "u"},
                {"role": "assistant", "content": "a"},
            ),
            cache_key="k",
            workspace_id="w",
        )
    )
    assert keys == ["key:k", "ws:w"]
    opening = routing_keys(StepRequest(messages=({"role": "system", "content": "s"}, {"role": "user", "content": "u"})))
    later = routing_keys(
        StepRequest(
            messages=(
                {"role": "system", "content": "s"},
                {"role": "user", "content": "u"},
                {"role": "assistant", "content": "a"},
            ),
            workspace_id="w",
        )
    )
    assert opening[0].startswith("open:") and later == ["ws:w", opening[0]]
    envs = replica_envs(2, [3, 5], {"A": "1"}, "CUDA_VISIBLE_DEVICES")
    assert envs == [
        {"A": "1", "CUDA_VISIBLE_DEVICES": "3", "KVMEM_REPLICA": "r0"},
        {"A": "1", "CUDA_VISIBLE_DEVICES": "5", "KVMEM_REPLICA": "r1"},
    ]
    assert replica_envs(1, [], {"A": "1"}, "CUDA_VISIBLE_DEVICES") == [{"A": "1"}]


def test_replicas_on_the_cpu_split_its_cores_unless_told(monkeypatch: pytest.MonkeyPatch):
    from kvmem import devices
    from kvmem.serve_config import replica_opts

    monkeypatch.delenv("KVMEM_THREADS", raising=False)
    monkeypatch.delenv("KVMEM_THREADS_BATCH", raising=False)
    monkeypatch.setattr("kvmem.serve_config.usable_cores", lambda: 8)
    args = argparse.Namespace(device="cpu", threads=None, threads_batch=None, n_gpu_layers=None, replicas=4, gpus=[])
    cpu = devices.Placement("llama.cpp", "cpu", None, "test")
    assert (replica_opts(args, cpu, False)["n_threads"], replica_opts(args, cpu, False)["n_threads_batch"]) == (2, 2)
    args.threads = 3
    assert replica_opts(args, cpu, False)["n_threads"] == 3
