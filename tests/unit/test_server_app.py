"""The HTTP layer in-process, before any engine is up: auth, validation, error JSON, the UI files."""

from __future__ import annotations

import json
from typing import Iterator

import pytest
from serving import AppClient, error_of as error

KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AppClient]:
    root = tmp_path_factory.mktemp("site")
    (root / "ui").mkdir()
    (root / "ui" / "index.html").write_text("<h1>KVMem</h1>")
    (root / "ui" / "app.js").write_text("console.log(1)")
    (root / "secret.txt").write_text("private")
    c = AppClient(api_key=KEY, ui_dir=root / "ui")
    yield c
    c.close()


def test_health_needs_no_key_and_reports_the_engine_state(client: AppClient) -> None:
    status, _, body = client.request("GET", "/health")
    assert status == 503 and json.loads(body)["status"] == "stopped"


@pytest.mark.parametrize(
    "headers", [{}, {"Authorization": "Bearer wrong"}, {"X-Api-Key": "wrong"}, {"Authorization": KEY}]
)
def test_api_routes_refuse_a_missing_or_wrong_key(client: AppClient, headers: dict[str, str]) -> None:
    for method, path in (
        ("GET", "/v1/models"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/metrics"),
        ("POST", "/tokenize"),
        ("GET", "/v1/kvmem/workspaces"),
        ("GET", "/openapi.json"),
    ):
        status, _, body = client.request(method, path, headers=headers, json=CHAT)
        assert status == 401, path
        assert error(body)["code"] == "invalid_api_key"


def test_x_api_key_header_is_accepted(client: AppClient) -> None:
    assert client.request("GET", "/metrics", headers={"X-Api-Key": KEY})[0] == 200


def test_ui_files_need_no_key_and_stay_inside_their_folder(client: AppClient) -> None:
    status, _, body = client.request("GET", "/")
    assert (status, body) == (200, b"<h1>KVMem</h1>")
    assert client.request("GET", "/app.js")[2] == b"console.log(1)"
    for path in ("/..%2Fsecret.txt", "/nothing.css"):
        status, _, body = client.request("GET", path)
        assert status == 404 and b"private" not in body


def test_validation_runs_before_the_engine_is_needed(client: AppClient) -> None:
    status, _, body = client.request("POST", "/v1/chat/completions", headers=AUTH, json={"messages": []})
    assert status == 400 and error(body)["param"] == "messages"
    status, _, body = client.request(
        "POST", "/v1/chat/completions", headers={**AUTH, "Content-Type": "application/json"}, data=b"{not json"
    )
    assert status == 400 and error(body)["code"] == "invalid_json"


def test_a_valid_request_without_an_engine_is_503_with_retry_after(client: AppClient) -> None:
    status, headers, body = client.request("POST", "/v1/chat/completions", headers=AUTH, json=CHAT)
    assert status == 503 and headers["Retry-After"] == "2"
    assert error(body)["type"] == "server_error"


def test_oversized_body_is_413(client: AppClient) -> None:
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 10_000}]}
    status, _, body = client.request("POST", "/v1/chat/completions", headers=AUTH, json=big)
    assert status == 413 and error(body)["code"] == "body_too_large"


def test_unknown_routes_and_methods_get_error_json(client: AppClient) -> None:
    status, _, body = client.request("POST", "/v1/nothing", headers=AUTH, json={})
    assert status == 405 and error(body)
    status, _, body = client.request("GET", "/v1/responses/resp_missing", headers=AUTH)
    assert status == 404 and error(body)["code"] == "response_not_found"


def test_openapi_lists_the_request_schemas(client: AppClient) -> None:
    status, _, body = client.request("GET", "/openapi.json", headers=AUTH)
    doc = json.loads(body)
    assert status == 200 and doc["openapi"].startswith("3.")
    assert {"ChatRequest", "CompletionRequest", "ResponsesRequest", "KVMemOptions"} <= set(doc["components"]["schemas"])
    assert doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatRequest"
    }
