"""Fuzzing requests: every malformed one gets a 4xx with the OpenAI error JSON, and no request restarts the engine.

Each malformed example starts from a valid request and breaks exactly one thing (a wrong
type, an out-of-range number, a bad role, an unknown ``kvmem`` knob, non-JSON bytes...), so
none of them may reach the engine. The default test runs against the app with no engine;
the slow one sends thousands to a live server with a real engine and then checks it still
answers a real request with the same engine process. Well-formed but hostile chat requests
(``chat_template_kwargs`` above all) go through the engine's own request path in-process in
``test_chat_request_fuzz``; here a live engine takes the keys that used to kill it.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings
from serving import AppClient

from kvmem_core.config import METHODS, SCORERS
from kvmem_core.prompt import RESERVED_KWARGS

MESSAGE = {"role": "user", "content": "hi"}
VALID = {
    "/v1/chat/completions": {"messages": [MESSAGE], "max_tokens": 2},
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/responses": {"input": "hi", "max_output_tokens": 2},
    "/v1/messages": {"messages": [MESSAGE], "max_tokens": 2},
}
scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
json_values = st.recursive(
    scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3), max_leaves=8
)
not_bool = json_values.filter(lambda v: not isinstance(v, bool))
not_number = json_values.filter(lambda v: isinstance(v, (str, list, dict)))
not_text = json_values.filter(lambda v: not isinstance(v, str) and v is not None)

bad_message = st.one_of(
    st.fixed_dictionaries(
        {
            "role": st.text(max_size=10).filter(
                lambda r: r not in ("system", "developer", "user", "assistant", "tool")
            ),
            "content": st.just("x"),
        }
    ),
    st.fixed_dictionaries(
        {
            "role": st.just("user"),
            "content": st.integers() | st.booleans() | st.dictionaries(st.text(max_size=3), scalars, max_size=2),
        }
    ),
    st.fixed_dictionaries({"role": st.just("user")}),
    st.fixed_dictionaries(
        {"role": st.just("user"), "content": st.just([{"type": "image_url", "image_url": {"url": "x"}}])}
    ),
    st.fixed_dictionaries(
        {
            "role": st.just("assistant"),
            "content": st.just("x"),
            "tool_calls": not_text.filter(lambda v: v != [] and not isinstance(v, list)),
        }
    ),
)
bad_kvmem = st.one_of(
    st.dictionaries(
        st.text(min_size=1, max_size=8).filter(
            lambda k: (
                k
                not in (
                    "method",
                    "retrieval_method",
                    "budget",
                    "gen_budget",
                    "sink_tokens",
                    "recent_tokens",
                    "retrieval_heads",
                )
            )
        ),
        scalars,
        min_size=1,
        max_size=2,
    ),
    st.fixed_dictionaries({"method": st.text(max_size=12).filter(lambda m: m not in METHODS + ("recency",))}),
    st.fixed_dictionaries(
        {
            "retrieval_method": st.text(max_size=12).filter(
                lambda m: m not in SCORERS + ("key-direction-fixed4", "key-direction-adaptive")
            )
        }
    ),
    st.fixed_dictionaries({"budget": st.integers(max_value=0) | st.integers(min_value=1, max_value=700)}),
    not_text.filter(lambda v: not isinstance(v, dict)),
)
COMMON = {
    "temperature": st.floats(min_value=2.001, max_value=1e9) | st.floats(max_value=-0.001, min_value=-1e9) | not_number,
    "top_p": st.floats(min_value=1.001, max_value=1e9) | st.floats(max_value=0.0, min_value=-1e9) | not_number,
    "top_k": st.integers(max_value=-1) | not_number,
    "seed": st.floats(allow_nan=False).filter(lambda f: not f.is_integer()) | st.text(max_size=4),
    "stream": not_bool,
    "kvmem": bad_kvmem,
}
BAD = {
    "/v1/chat/completions": {
        **COMMON,
        "messages": st.one_of(
            st.just([]),
            not_text.filter(lambda v: not isinstance(v, list)),
            st.lists(st.just(MESSAGE), max_size=2).flatmap(lambda ok: bad_message.map(lambda b: ok + [b])),
        ),
        "max_tokens": st.integers(max_value=0) | not_number,
        "max_completion_tokens": st.integers(max_value=0) | not_number,
        "n": st.integers(min_value=2) | st.integers(max_value=0),
        "stop": st.integers() | st.lists(st.integers(), min_size=1, max_size=3),
        "tools": st.lists(
            st.fixed_dictionaries(
                {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.integers()})}
            ),
            min_size=1,
            max_size=2,
        ),
    },
    "/v1/completions": {
        **COMMON,
        "prompt": st.just("") | st.integers() | st.lists(st.text(max_size=3), min_size=2, max_size=3) | st.just([]),
        "max_tokens": st.integers(max_value=0) | not_number,
        "echo": st.just(True),
    },
    "/v1/responses": {
        **{k: v for k, v in COMMON.items() if k != "stream"},
        "input": st.just([])
        | st.integers()
        | st.lists(
            st.fixed_dictionaries({"type": st.sampled_from(["web_search_call", "reasoning", "function_call"])}),
            min_size=1,
            max_size=2,
        ),
        "max_output_tokens": st.integers(max_value=0) | not_number,
        "previous_response_id": st.text(min_size=1, max_size=12).map(lambda s: "resp_missing_" + s),
        "tools": st.lists(
            st.fixed_dictionaries({"type": st.sampled_from(["web_search", "file_search", "computer"])}),
            min_size=1,
            max_size=2,
        ),
    },
    "/v1/messages": {
        **{k: v for k, v in COMMON.items() if k not in ("temperature", "seed")},
        "temperature": st.floats(min_value=1.001, max_value=1e9)
        | st.floats(max_value=-0.001, min_value=-1e9)
        | not_number,
        "messages": st.one_of(
            st.just([]),
            st.just([{"role": "system", "content": "x"}]),
            st.just([{"role": "user", "content": [{"type": "image", "source": {}}]}]),
            st.lists(st.integers(), min_size=1, max_size=2),
        ),
        "max_tokens": st.integers(max_value=0) | not_number,
        "tools": st.lists(st.fixed_dictionaries({"name": st.integers() | st.just("")}), min_size=1, max_size=2),
    },
}


@st.composite
def malformed(draw: st.DrawFn) -> tuple[str, bytes]:
    """(path, body) where the body breaks one rule."""
    path = draw(st.sampled_from(sorted(VALID)))
    kind = draw(st.sampled_from(["field", "field", "field", "missing", "bytes", "not-object"]))
    if kind == "bytes":
        return path, draw(st.binary(max_size=40).filter(lambda b: not b.strip().startswith(b"{")))
    if kind == "not-object":
        return path, json.dumps(draw(json_values.filter(lambda v: not isinstance(v, dict)))).encode()
    body: dict[str, Any] = dict(VALID[path])
    if kind == "missing":
        required = {
            "/v1/chat/completions": "messages",
            "/v1/completions": "prompt",
            "/v1/responses": "input",
            "/v1/messages": draw(st.sampled_from(["messages", "max_tokens"])),
        }[path]
        del body[required]
    else:
        field = draw(st.sampled_from(sorted(BAD[path])))
        body[field] = draw(BAD[path][field])
    return path, json.dumps(body).encode()


def check(path: str, status: int, body: bytes) -> None:
    assert 400 <= status < 500, (status, body[:300])
    data = json.loads(body)
    anthropic = path == "/v1/messages"
    assert set(data) == ({"type", "error"} if anthropic else {"error"})
    err = data["error"]
    assert set(err) == ({"type", "message", "code"} if anthropic else {"message", "type", "param", "code"})
    assert isinstance(err["message"], str) and err["message"]


@pytest.fixture(scope="module")
def served_app() -> Iterator[AppClient]:
    client = AppClient()
    yield client
    client.close()


@given(case=malformed())
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_malformed_requests_are_4xx_without_an_engine(served_app: AppClient, case: tuple[str, bytes]) -> None:
    path, body = case
    status, _, reply = served_app.request("POST", path, data=body, headers={"Content-Type": "application/json"})
    check(path, status, reply)


@pytest.fixture(scope="module")
def engine_app() -> Iterator[AppClient]:
    client = AppClient(start_engine=True, max_body_bytes=1 << 20)
    yield client
    client.close()


@pytest.mark.slow
@pytest.mark.llamacpp
@given(
    case=malformed()
    | st.tuples(
        st.just("/v1/chat/completions"),
        st.text(min_size=1, max_size=20).map(
            lambda m: json.dumps({**VALID["/v1/chat/completions"], "model": "x-" + m}).encode()
        ),
    )
)
@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_thousands_of_malformed_requests_leave_a_live_engine_serving(
    engine_app: AppClient, case: tuple[str, bytes]
) -> None:
    path, body = case
    pid = engine_app.engine.pid
    status, _, reply = engine_app.request("POST", path, data=body, headers={"Content-Type": "application/json"})
    check(path, status, reply)
    assert engine_app.engine.pid == pid and engine_app.engine.state == "ready"


@pytest.mark.slow
@pytest.mark.llamacpp
def test_the_live_engine_still_answers_after_the_fuzz(engine_app: AppClient) -> None:
    status, _, reply = engine_app.request(
        "POST", "/v1/chat/completions", json={**VALID["/v1/chat/completions"], "temperature": 0}
    )
    assert status == 200 and json.loads(reply)["choices"][0]["message"]["content"]


@pytest.mark.llamacpp
def test_template_kwargs_that_used_to_kill_the_engine_fail_only_their_request(engine_app: AppClient) -> None:
    pid, restarts = engine_app.engine.pid, engine_app.engine.restarts
    for key in RESERVED_KWARGS:
        body = {**VALID["/v1/chat/completions"], "chat_template_kwargs": {key: 1}}
        status, _, reply = engine_app.request("POST", "/v1/chat/completions", json=body)
        assert status == 400 and json.loads(reply)["error"]["code"] == "template_error", reply
    body = {
        **VALID["/v1/chat/completions"],
        "chat_template_kwargs": {"documents": 3, "x": {"y": [1]}},
        "temperature": 0,
    }
    status, _, reply = engine_app.request("POST", "/v1/chat/completions", json=body)
    assert status == 200 and json.loads(reply)["choices"][0]["message"]["content"]
    assert (engine_app.engine.pid, engine_app.engine.restarts, engine_app.engine.state) == (pid, restarts, "ready")
