"""Two engine replicas behind one live server on the CPU, sharing one NVMe directory: conversations stay on
their replica (their workspace and cache hits), a killed replica's conversation continues on the other from
disk with no lost turn, 64 concurrent clients are all answered, with 429 past the replicas' queues, and a
Responses chain and the workspace routes find the replica holding the workspace."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any, Iterator

import aiohttp
import pytest
from serving import LiveServer, get_json

pytestmark = pytest.mark.llamacpp
STORY = "Marigold the lighthouse keeper counted ships every night and wrote their names in a blue book. " * 8
MAX_QUEUE = 2


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("replicas")
    server = LiveServer(
        root,
        "--no-ui",
        "--ctx",
        "2048",
        "--kvmem-retrieval-heads",
        "17:3,17:4,21:8",
        "--replicas",
        "2",
        "--max-queue",
        str(MAX_QUEUE),
        "--kvmem-nvme-dir",
        str(root / "nvme"),
    )
    server.start()
    all_ready(server)
    try:
        yield server
    finally:
        server.stop()


def chat(
    live: LiveServer, messages: list[dict[str, str]], key: str | None = None, max_tokens: int = 4
) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "", "messages": messages, "temperature": 0, "max_tokens": max_tokens}
    if key is not None:
        body["prompt_cache_key"] = key

    async def go() -> tuple[int, Any]:
        async with aiohttp.ClientSession() as session:
            async with session.post(live.url + "/v1/chat/completions", json=body) as resp:
                return resp.status, await resp.json()

    status, reply = asyncio.run(go())
    assert status == 200, reply
    return reply


def conversation(name: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": f"{name}: {STORY}"}, {"role": "user", "content": "Who counted ships?"}]


def next_turn(messages: list[dict[str, str]], reply: dict[str, Any], question: str) -> list[dict[str, str]]:
    return [
        *messages,
        {"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
        {"role": "user", "content": question},
    ]


def replicas(live: LiveServer) -> list[dict[str, Any]]:
    return get_json(live.url + "/health")[1]["replicas"]


def all_ready(live: LiveServer, timeout: float = 300) -> None:
    """Wait until every replica is ready (``/health`` is ok as soon as one is)."""
    deadline = time.monotonic() + timeout
    while any(r["state"] != "ready" for r in replicas(live)):
        assert time.monotonic() < deadline, replicas(live)
        time.sleep(0.5)


def cached(reply: dict[str, Any]) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_conversations_keep_their_replica_and_their_cache(live: LiveServer):
    talks = {name: conversation(name) for name in ("ada", "bo", "cy", "di")}
    first = {
        name: chat(live, messages, key=name if name in ("ada", "bo") else None) for name, messages in talks.items()
    }
    assert [r["workspaces"] for r in replicas(live)] == [2, 2]  # new conversations spread over idle replicas
    for name, messages in talks.items():
        again = chat(live, next_turn(messages, first[name], "And then?"), key=name if name in ("ada", "bo") else None)
        assert again["kvmem"]["workspace_id"] == first[name]["kvmem"]["workspace_id"]  # same replica, same workspace
        assert cached(again) >= first[name]["usage"]["prompt_tokens"] // 64 * 64 > 0


def test_a_killed_replicas_conversation_continues_on_the_other_from_disk(live: LiveServer):
    before = [r["workspaces"] for r in replicas(live)]
    messages = conversation("moving")
    first = chat(live, messages, key="moving")
    after = replicas(live)
    home = next(i for i, r in enumerate(after) if r["workspaces"] > before[i])
    time.sleep(1.0)  # the block files' write-through lands (a kill loses only writes in flight)
    os.kill(after[home]["engine_pid"], signal.SIGKILL)
    messages = next_turn(messages, first, "And then?")
    second = chat(live, messages, key="moving")
    assert second["kvmem"]["workspace_id"] != first["kvmem"]["workspace_id"]  # a workspace of the other replica
    assert cached(second) >= first["usage"]["prompt_tokens"] // 64 * 64 > 0  # its blocks adopted from disk
    all_ready(live)
    assert replicas(live)[home]["restarts"] == 1
    third = chat(live, next_turn(messages, second, "Why?"), key="moving")
    assert third["kvmem"]["workspace_id"] == second["kvmem"]["workspace_id"] and cached(third) > cached(second)


def test_64_concurrent_clients_are_all_answered_and_refused_only_past_the_queues(live: LiveServer):
    async def one(session: aiohttp.ClientSession, i: int) -> tuple[int, str | None]:
        body = {"model": "", "messages": [{"role": "user", "content": f"Count to {i}."}], "max_tokens": 2}
        async with session.post(live.url + "/v1/chat/completions", json=body) as resp:
            await resp.read()
            return resp.status, resp.headers.get("Retry-After")

    async def crowd() -> list[tuple[int, str | None]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            return await asyncio.gather(*(one(session, i) for i in range(64)))

    answers = asyncio.run(crowd())
    statuses = [status for status, _ in answers]
    assert len(answers) == 64 and set(statuses) <= {200, 429}, statuses
    assert statuses.count(200) >= 2 * (1 + MAX_QUEUE)
    assert statuses.count(429) > 0 and all(retry == "1" for status, retry in answers if status == 429)


def test_a_response_chain_and_the_workspace_routes_reach_the_replica_holding_it(live: LiveServer):
    async def post(path: str, body: dict[str, Any]) -> Any:
        async with aiohttp.ClientSession() as session:
            async with session.post(live.url + path, json=body) as resp:
                assert resp.status == 200, await resp.text()
                return await resp.json()

    first = asyncio.run(
        post(
            "/v1/responses",
            {"model": "", "input": STORY + "Who counted ships?", "max_output_tokens": 4, "temperature": 0},
        )
    )
    second = asyncio.run(
        post(
            "/v1/responses",
            {
                "model": "",
                "input": "Where?",
                "previous_response_id": first["id"],
                "max_output_tokens": 4,
                "temperature": 0,
            },
        )
    )
    ws_id = first["kvmem"]["workspace_id"]
    assert second["kvmem"]["workspace_id"] == ws_id and second["usage"]["input_tokens_details"]["cached_tokens"] > 0
    status, info = get_json(f"{live.url}/v1/kvmem/workspaces/{ws_id}")
    assert status == 200 and info["id"] == ws_id
    listed = get_json(live.url + "/v1/kvmem/workspaces")[1]["data"]
    assert ws_id in [w["id"] for w in listed] and len(listed) == sum(r["workspaces"] for r in replicas(live))
