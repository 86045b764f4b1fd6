"""What a server sends, checked against the openai SDK's own pydantic types (every required field, every
literal), and sent raw over HTTP so that no client library smooths it over first."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

_RESPONSE_EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
_BODIES = {"/v1/chat/completions": ChatCompletion, "/v1/completions": Completion, "/v1/responses": Response}
_CHUNKS = {
    "/v1/chat/completions": ChatCompletionChunk.model_validate,
    "/v1/completions": Completion.model_validate,
    "/v1/responses": _RESPONSE_EVENT.validate_python,
}


@dataclass
class Reply:
    status_code: int
    text: str

    def json(self) -> Any:
        return json.loads(self.text)


def _request(base_url: str, path: str, body: dict[str, Any]) -> urllib.request.Request:
    return urllib.request.Request(
        base_url + path, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )


def post(base_url: str, path: str, body: dict[str, Any], timeout: float = 120) -> Reply:
    """POST ``body`` as JSON to ``base_url + path``; the raw reply."""
    try:
        with urllib.request.urlopen(_request(base_url, path, body), timeout=timeout) as reply:
            return Reply(reply.status, reply.read().decode())
    except urllib.error.HTTPError as exc:
        return Reply(exc.code, exc.read().decode())


def check_body(path: str, data: Any) -> Any:
    """A whole reply of an OpenAI route as the SDK's type for it (pydantic's ValidationError if it is not one)."""
    return _BODIES[path].model_validate(data)


def check_event(path: str, data: Any) -> Any:
    """One streamed chunk or event of an OpenAI route as the SDK's type for it."""
    return _CHUNKS[path](data)


def checked_routes() -> tuple[str, ...]:
    return tuple(_BODIES)


def create(base_url: str, path: str, body: dict[str, Any]) -> Any:
    """A non-streamed reply of an OpenAI route, validated as the SDK's type for it (AssertionError if not 200)."""
    reply = post(base_url, path, body)
    assert reply.status_code == 200, reply.text
    return check_body(path, reply.json())


def stream(base_url: str, path: str, body: dict[str, Any]) -> list[Any]:
    """A streamed reply's events, each validated as the SDK's chunk or event type; the ``[DONE]`` line ends it."""
    events, done = [], False
    with urllib.request.urlopen(_request(base_url, path, {**body, "stream": True}), timeout=120) as reply:
        for raw in reply:
            line = raw.decode().rstrip("\n")
            if not line.startswith("data: "):
                continue
            assert not done, "an event after [DONE]"
            if line == "data: [DONE]":
                done = True
                continue
            events.append(check_event(path, json.loads(line[6:])))
    assert done or path == "/v1/responses", "the stream did not end with [DONE]"
    return events
