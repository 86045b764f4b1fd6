"""The OpenAI-compatible API end to end: a live ``kvmem serve`` on the embedded model, the official SDK."""

from __future__ import annotations

import json
import urllib.request
from typing import Any, Iterator

import openai
import pytest
from serving import LiveServer, exercise, get_json

from kvmem_core.config import KVMemConfig

pytestmark = pytest.mark.llamacpp
SHORT = {"max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = LiveServer(
        tmp_path_factory.mktemp("serve"),
        "--no-ui",
        "--ctx",
        "4096",
        "--kvmem-budget",
        "1024",
        "--kvmem-recent-tokens",
        "256",
    ).start()
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def metrics(server: LiveServer) -> dict[str, float]:
    text = urllib.request.urlopen(server.url + "/metrics", timeout=5).read().decode()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line and line[0] != "#"
    }


def test_the_shared_client_script_passes(server: LiveServer) -> None:
    seen = exercise(server.url)
    assert seen["model"].startswith("SmolLM2")
    kv = seen["chat"].model_extra["kvmem"]
    assert kv["workspace_id"] and "method" in kv["selection"]


def test_turn_two_hits_the_cache_and_equals_a_cold_run(server: LiveServer, client: openai.OpenAI, model: str) -> None:
    turn1 = [{"role": "user", "content": "Name a color of the sky."}]
    r1 = client.chat.completions.create(model=model, messages=turn1, **SHORT)
    turn2 = turn1 + [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "And of grass?"},
    ]
    warm = client.chat.completions.create(model=model, messages=turn2, **SHORT)
    usage = warm.usage
    assert usage.prompt_tokens_details.cached_tokens > 0
    assert usage.model_extra["prompt_cache_hit_tokens"] == usage.prompt_tokens_details.cached_tokens
    assert (
        usage.model_extra["prompt_cache_miss_tokens"] == usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens
    )
    for ws in get_json(server.url + "/v1/kvmem/workspaces")[1]["data"]:
        urllib.request.urlopen(urllib.request.Request(f"{server.url}/v1/kvmem/workspaces/{ws['id']}", method="DELETE"))
    client.completions.create(model=model, prompt="Zebra stripes", max_tokens=1, temperature=0)
    cold = client.chat.completions.create(model=model, messages=turn2, **SHORT)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert cold.choices[0].message.content == warm.choices[0].message.content


def test_responses_stream_with_previous_response_id(client: openai.OpenAI, model: str) -> None:
    first = client.responses.create(
        model=model, input="Say a fruit.", instructions="Answer briefly.", max_output_tokens=6, temperature=0
    )
    with client.responses.stream(
        model=model,
        input="Another one.",
        instructions="Answer briefly.",
        previous_response_id=first.id,
        max_output_tokens=64,
        temperature=0,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final.output_text
    assert final.usage.input_tokens_details.cached_tokens > 0
    assert final.previous_response_id == first.id
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_tool_call_transcript_round_trip(client: openai.OpenAI, model: str) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather for a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    transcript: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C, snowing"},
    ]
    first = client.chat.completions.create(model=model, messages=transcript, tools=tools, **SHORT)
    reply = first.choices[0].message
    assert first.choices[0].finish_reason in ("stop", "length", "tool_calls")
    transcript.append(
        {
            "role": "assistant",
            "content": reply.content or "",
            **({"tool_calls": [c.model_dump() for c in reply.tool_calls]} if reply.tool_calls else {}),
        }
    )
    transcript.append({"role": "user", "content": "Thanks."})
    second = client.chat.completions.create(model=model, messages=transcript, tools=tools, **SHORT)
    assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens // 2
    via_responses = client.responses.create(
        model=model,
        tools=[{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
        input=[
            {"role": "user", "content": "Weather in Oslo?"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "-3 C"},
        ],
        max_output_tokens=6,
        temperature=0,
    )
    assert via_responses.status in ("completed", "incomplete") and via_responses.output


def test_metrics_counters_move(server: LiveServer, client: openai.OpenAI, model: str) -> None:
    before = metrics(server)
    done = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Count to two."}], **SHORT)
    after = metrics(server)
    chat_ok = 'kvmem_requests_total{route="/v1/chat/completions",status="200"}'
    assert after[chat_ok] == before.get(chat_ok, 0) + 1
    assert (
        after['kvmem_tokens_total{kind="prompt"}']
        == before['kvmem_tokens_total{kind="prompt"}'] + done.usage.prompt_tokens
    )
    assert (
        after['kvmem_tokens_total{kind="completion"}']
        == before['kvmem_tokens_total{kind="completion"}'] + done.usage.completion_tokens
    )
    assert after["kvmem_engine_up"] == 1 and after["kvmem_queue_length"] == 0


def test_tokenize_in_both_places(server: LiveServer) -> None:
    replies = []
    for path in ("/tokenize", "/v1/tokenize"):
        req = urllib.request.Request(
            server.url + path,
            data=json.dumps({"content": "Hello world"}).encode(),
            headers={"Content-Type": "application/json"},
        )
        replies.append(json.loads(urllib.request.urlopen(req, timeout=10).read()))
    assert replies[0] == replies[1] and len(replies[0]["tokens"]) == 2


def test_workspace_routes(server: LiveServer, client: openai.OpenAI, model: str) -> None:
    done = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi there."}], **SHORT)
    ws_id = done.model_extra["kvmem"]["workspace_id"]
    status, listing = get_json(server.url + "/v1/kvmem/workspaces")
    assert status == 200 and ws_id in [w["id"] for w in listing["data"]]
    status, info = get_json(f"{server.url}/v1/kvmem/workspaces/{ws_id}")
    assert status == 200 and info["id"] == ws_id and "totals" in info
    assert get_json(f"{server.url}/v1/kvmem/workspaces/ws-nope")[0] == 404


def test_workspace_info_shows_block_text_view_and_budget(server: LiveServer, client: openai.OpenAI, model: str) -> None:
    story = "Marigold the lighthouse keeper counted ships every night. " * 30
    done = client.chat.completions.create(model=model, messages=[{"role": "user", "content": story}], **SHORT)
    info = get_json(f"{server.url}/v1/kvmem/workspaces/{done.model_extra['kvmem']['workspace_id']}")[1]
    bt = KVMemConfig().block_tokens
    assert (info["budget"], info["block_tokens"]) == (1024, bt) and info["gen_budget"] > 0
    blocks = info["blocks"]
    assert len(blocks) >= 2 and "Marigold" in "".join(b["text"] for b in blocks[:2])
    assert [b["start"] for b in blocks] == [bt * i for i in range(len(blocks))]
    assert all(b["tiers"][0] == "gpu" for b in blocks)  # the prompt fit the budget: every block is in the view
    assert info["totals"]["tokens_in_view"] == bt * len(blocks)


@pytest.mark.parametrize(
    "call, status, code",
    [
        (
            lambda c, m: c.completions.create(model=m, prompt="word " * 4200, max_tokens=2),
            400,
            "context_length_exceeded",
        ),
        (
            lambda c, m: c.chat.completions.create(
                model=m,
                messages=[{"role": "user", "content": "word " * 800}],
                max_tokens=2,
                extra_body={"kvmem": {"method": "full", "budget": 768}},
            ),
            413,
            "budget_exceeded",
        ),
        (
            lambda c, m: c.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}]),
            404,
            "model_not_found",
        ),
        (
            lambda c, m: c.chat.completions.create(model=m, messages=[{"role": "user", "content": "hi"}], max_tokens=0),
            400,
            "invalid_value",
        ),
        (
            lambda c, m: c.chat.completions.create(
                model=m, messages=[{"role": "user", "content": "hi"}], extra_body={"kvmem": {"method": "psychic"}}
            ),
            400,
            "invalid_kvmem_options",
        ),
        (  # the model has no MTP layers: refused by the engine, which serves on
            lambda c, m: c.chat.completions.create(
                model=m,
                messages=[{"role": "user", "content": "hi"}],
                temperature=0,
                extra_body={"kvmem": {"speculative": "mtp"}},
            ),
            400,
            "invalid_config",
        ),
    ],
)
def test_request_errors_are_typed_and_leave_the_engine_serving(
    client: openai.OpenAI, model: str, call: Any, status: int, code: str, server: LiveServer
) -> None:
    engine_pid = server.health()["engine_pid"]
    with pytest.raises(openai.APIStatusError) as info:
        call(client, model)
    assert info.value.status_code == status and info.value.body["code"] == code
    assert server.health()["engine_pid"] == engine_pid
    assert client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "ok?"}], max_tokens=2
    ).choices
