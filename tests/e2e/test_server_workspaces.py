"""Workspaces end to end on live servers with the official SDK: ``prompt_cache_key`` and ``previous_response_id``
keep a conversation in one workspace; a workspace is pinned, exported as one file, imported on another server
running the same model (its KV reused there), and refused by a server with another KV layout."""

from __future__ import annotations

from typing import Any, Iterator

import json
import urllib.error
import urllib.request

import openai
import pytest
from serving import LiveServer

pytestmark = pytest.mark.llamacpp
STORY = "Marigold the lighthouse keeper counted ships every night and wrote their names in a blue book. " * 8
GREEDY: dict[str, Any] = {"model": "", "temperature": 0, "max_tokens": 8}
TAR = {"Content-Type": "application/x-tar"}


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, LiveServer]]:
    flags = ("--no-ui", "--ctx", "4096", "--kvmem-retrieval-heads", "17:3,17:4,21:8")
    started: dict[str, LiveServer] = {}
    try:
        for name, extra in (("a", ()), ("b", ()), ("other_layout", ("--kvmem-block-tokens", "32"))):
            started[name] = LiveServer(tmp_path_factory.mktemp(name), *flags, *extra).start()
        yield started
    finally:
        for live in started.values():
            live.stop()


class Reply:
    """A plain HTTP reply: status, headers, body."""

    def __init__(self, status: int, headers: dict[str, str], content: bytes) -> None:
        self.status_code, self.headers, self.content = status, {k.lower(): v for k, v in headers.items()}, content

    def json(self) -> Any:
        return json.loads(self.content)


def http(method: str, url: str, content: bytes | None = None, headers: dict[str, str] | None = None) -> Reply:
    req = urllib.request.Request(url, data=content, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return Reply(resp.status, dict(resp.headers), resp.read())
    except urllib.error.HTTPError as exc:
        return Reply(exc.code, dict(exc.headers), exc.read())


JSON = {"Content-Type": "application/json"}


def sdk(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0)


def chat(live: LiveServer, messages: list[dict[str, str]], **extra: Any) -> Any:
    return sdk(live).chat.completions.create(messages=messages, extra_body=extra or None, **GREEDY)


def workspace_of(done: Any) -> str:
    return done.model_extra["kvmem"]["workspace_id"]


def test_a_prompt_cache_key_routes_two_histories_and_both_keep_their_blocks(servers: dict[str, LiveServer]) -> None:
    a = servers["a"]
    turn1 = [{"role": "user", "content": "Who kept the lighthouse? " + STORY}]
    first = chat(a, turn1, prompt_cache_key="conversation-1")
    edited = chat(
        a, [{"role": "user", "content": "How many ships were there? " + STORY}], prompt_cache_key="conversation-1"
    )
    assert workspace_of(edited) != workspace_of(first)  # a second history under the key forks
    turn2 = turn1 + [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "What colour was the book?"},
    ]
    second = chat(a, turn2, prompt_cache_key="conversation-1")
    assert workspace_of(second) == workspace_of(first)  # the first history is still whole and continues
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens // 64 * 64
    keyless = chat(a, turn1)
    other_key = chat(a, turn1, prompt_cache_key="conversation-2")
    assert len({workspace_of(first), workspace_of(keyless), workspace_of(other_key)}) == 3
    assert keyless.usage.prompt_tokens_details.cached_tokens > 0  # another workspace, the same shared blocks


def test_previous_response_id_continues_the_previous_responses_workspace(servers: dict[str, LiveServer]) -> None:
    client = sdk(servers["a"])
    opts = {"model": "", "temperature": 0, "max_output_tokens": 8}
    first = client.responses.create(input=STORY + "Who kept the lighthouse?", **opts)
    second = client.responses.create(input="And what did she write?", previous_response_id=first.id, **opts)
    assert first.model_extra["kvmem"]["workspace_id"] == second.model_extra["kvmem"]["workspace_id"]
    assert second.usage.input_tokens_details.cached_tokens > 0
    keyed = client.responses.create(
        input=STORY + "Name the keeper.", extra_body={"prompt_cache_key": "responses-1"}, **opts
    )
    chained = client.responses.create(input="Why?", previous_response_id=keyed.id, **opts)
    assert chained.prompt_cache_key == "responses-1"  # the chain keeps its key
    assert keyed.model_extra["kvmem"]["workspace_id"] == chained.model_extra["kvmem"]["workspace_id"]


def test_a_pinned_workspace_exports_and_imports_on_another_server(servers: dict[str, LiveServer]) -> None:
    a, b = servers["a"], servers["b"]
    # A prefix no other test sends: blocks shared with earlier requests were prefilled in other batches, whose
    # rounding can flip this small model's first greedy token.
    ask = [
        {"role": "system", "content": "Answer from the story."},
        {"role": "user", "content": STORY + "Where did the keeper write the names?"},
    ]
    original = chat(a, ask, prompt_cache_key="portable")
    ws_id = workspace_of(original)
    pinned = http("POST", f"{a.url}/v1/kvmem/workspaces/{ws_id}/pin", b"{}", JSON).json()
    assert pinned["pinned"] is True and pinned["key"] == "portable"
    export = http("GET", f"{a.url}/v1/kvmem/workspaces/{ws_id}/export")
    assert export.status_code == 200 and export.headers["content-type"] == "application/x-tar"
    imported = http("POST", f"{b.url}/v1/kvmem/workspaces/import", export.content, TAR)
    assert imported.status_code == 201
    assert {k: imported.json()[k] for k in ("id", "key", "pinned", "blocks")} == {
        "id": ws_id,
        "key": "portable",
        "pinned": True,
        "blocks": pinned["blocks"],
    }
    follow = ask + [
        {"role": "assistant", "content": original.choices[0].message.content},
        {"role": "user", "content": "Why?"},
    ]
    assert workspace_of(chat(b, follow, prompt_cache_key="portable")) == ws_id  # the conversation continues there
    there = chat(b, ask, prompt_cache_key="portable")
    assert there.choices[0].message.content == original.choices[0].message.content
    assert there.usage.prompt_tokens_details.cached_tokens >= original.usage.prompt_tokens // 64 * 64 - 64
    again = http("POST", f"{b.url}/v1/kvmem/workspaces/import", export.content, TAR)
    assert (again.status_code, again.json()["error"]["code"]) == (409, "workspace_exists")
    assert http("DELETE", f"{a.url}/v1/kvmem/workspaces/{ws_id}/pin").json()["pinned"] is False


def test_other_layouts_damaged_files_and_unknown_workspaces_are_refused(servers: dict[str, LiveServer]) -> None:
    a = servers["a"]
    ws_id = workspace_of(chat(a, [{"role": "user", "content": STORY + "Say yes."}]))
    export = http("GET", f"{a.url}/v1/kvmem/workspaces/{ws_id}/export").content
    mismatch = http("POST", f"{servers['other_layout'].url}/v1/kvmem/workspaces/import", export, TAR)
    assert (mismatch.status_code, mismatch.json()["error"]["code"]) == (409, "model_mismatch")
    middle = len(export) // 2  # inside some block's KV
    damaged = http(
        "POST",
        f"{servers['b'].url}/v1/kvmem/workspaces/import",
        export[:middle] + bytes([export[middle] ^ 0xFF]) + export[middle + 1 :],
        TAR,
    )
    assert (damaged.status_code, damaged.json()["error"]["code"]) == (400, "invalid_workspace_file")
    as_json = http("POST", f"{a.url}/v1/kvmem/workspaces/import", export, {"Content-Type": "text/plain"})
    assert as_json.status_code == 415
    for response in (
        http("GET", f"{a.url}/v1/kvmem/workspaces/ws-0000000000000000/export"),
        http("POST", f"{a.url}/v1/kvmem/workspaces/ws-0000000000000000/pin", b"{}", JSON),
    ):
        assert (response.status_code, response.json()["error"]["code"]) == (404, "workspace_not_found")
