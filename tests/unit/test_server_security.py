"""Host, Origin and Content-Type checks and CORS, over plain HTTP against the app in-process (no engine)."""

from __future__ import annotations

import json
from typing import Iterator

import pytest
from serving import AppClient

from kvmem.server.security import Security, exposure_warning, same_origin
from kvmem_core.errors import ConfigError

FRIEND = "http://localhost:3000"
CHAT = json.dumps({"model": "", "messages": [{"role": "user", "content": "hi"}]})
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def client() -> Iterator[AppClient]:
    c = AppClient(security=Security(allowed_hosts=("kvmem.lan",), cors_origins=(FRIEND,)))
    yield c
    c.close()


def code(body: bytes) -> str:
    return json.loads(body)["error"]["code"]


def own_host(client: AppClient) -> str:
    return f"127.0.0.1:{client.server.port}"


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"]
)
def test_api_posts_need_json_content_type(client: AppClient, content_type: str) -> None:
    for path in ("/v1/chat/completions", "/v1/responses", "/tokenize"):
        status, _, body = client.request("POST", path, data=CHAT, headers={"Content-Type": content_type})
        assert (status, code(body)) == (415, "unsupported_media_type"), path


def test_a_post_without_content_type_is_415_and_messages_keep_their_error_shape(client: AppClient) -> None:
    status, _, body = client.request(
        "POST", "/v1/chat/completions", data=CHAT.encode(), skip_auto_headers=["Content-Type"]
    )
    assert (status, code(body)) == (415, "unsupported_media_type")
    status, _, body = client.request("POST", "/v1/messages", data=CHAT, headers={"Content-Type": "text/plain"})
    assert status == 415 and json.loads(body)["type"] == "error"


def test_json_with_a_charset_passes_the_check(client: AppClient) -> None:
    status, _, body = client.request(
        "POST", "/v1/chat/completions", data=CHAT, headers={"Content-Type": "application/json; charset=utf-8"}
    )
    assert (status, code(body)) == (503, "engine_unavailable")


@pytest.mark.parametrize("host", ["attacker.example", "attacker.example:8080", "127.0.0.1.nip.io", "192.168.1.7"])
def test_a_foreign_host_is_refused_on_every_route(client: AppClient, host: str) -> None:
    for method, path in (
        ("GET", "/v1/kvmem/workspaces/w1"),
        ("GET", "/health"),
        ("GET", "/"),
        ("POST", "/v1/chat/completions"),
    ):
        status, _, body = client.request(method, path, data=CHAT, headers={"Host": host, **JSON})
        assert (status, code(body)) == (403, "host_not_allowed"), (method, path)


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:8080", "127.0.0.1:9", "[::1]:8080", "kvmem.lan"])
def test_loopback_names_and_allowed_hosts_pass(client: AppClient, host: str) -> None:
    assert client.request("GET", "/v1/models", headers={"Host": host})[0] == 200


def test_host_rules_follow_the_bound_address() -> None:
    wildcard = Security(bind_host="0.0.0.0")
    assert (
        wildcard.host_allowed("10.1.2.3:8080")
        and wildcard.host_allowed("[fe80::1]")
        and wildcard.host_allowed("localhost")
    )
    assert not wildcard.host_allowed("rebind.attacker.example")
    lan = Security(bind_host="192.168.1.5", allowed_hosts=("box.lan",))
    assert lan.host_allowed("192.168.1.5:8080") and lan.host_allowed("box.lan")
    assert not lan.host_allowed("localhost") and not lan.host_allowed("10.0.0.1")
    assert Security(bind_host="::1").host_allowed("[::1]:8080")
    assert Security(allowed_hosts=("*",)).host_allowed("anything.example")


def test_a_cross_origin_request_is_refused_before_auth_and_routing() -> None:
    c = AppClient(api_key="k")
    try:
        for method, path in (
            ("POST", "/v1/chat/completions"),
            ("GET", "/v1/kvmem/workspaces"),
            ("OPTIONS", "/v1/models"),
        ):
            status, headers, body = c.request(
                method, path, data=CHAT, headers={"Origin": "http://attacker.example", **JSON}
            )
            assert (status, code(body)) == (403, "origin_not_allowed"), path
            assert "Access-Control-Allow-Origin" not in headers
        status, _, body = c.request("GET", "/v1/models", headers={"Origin": "null"})
        assert (status, code(body)) == (403, "origin_not_allowed")
    finally:
        c.close()


def test_same_origin_requests_pass(client: AppClient) -> None:
    origin = f"http://{own_host(client)}"
    status, headers, _ = client.request("GET", "/v1/models", headers={"Origin": origin})
    assert status == 200 and "Access-Control-Allow-Origin" not in headers
    assert same_origin("http://localhost", "localhost:80") and same_origin("https://kvmem.lan", "kvmem.lan")
    assert not same_origin("http://localhost:3000", "localhost:8080") and not same_origin("https://a", "a:80")


def test_a_cors_origin_gets_preflight_and_readable_responses(client: AppClient) -> None:
    preflight = {
        "Origin": FRIEND,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    status, headers, _ = client.request("OPTIONS", "/v1/chat/completions", headers=preflight)
    assert status == 204 and headers["Access-Control-Allow-Origin"] == FRIEND
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert {"authorization", "content-type"} <= set(
        headers["Access-Control-Allow-Headers"].lower().replace(" ", "").split(",")
    )
    status, headers, _ = client.request("GET", "/v1/models", headers={"Origin": FRIEND})
    assert status == 200 and headers["Access-Control-Allow-Origin"] == FRIEND and "Origin" in headers["Vary"]
    status, headers, body = client.request(
        "POST", "/v1/chat/completions", data=CHAT, headers={"Origin": FRIEND, **JSON}
    )
    assert status == 503 and headers["Access-Control-Allow-Origin"] == FRIEND  # errors are readable too
    assert "Retry-After" in headers["Access-Control-Expose-Headers"]


def test_cors_origins_must_be_origins() -> None:
    assert Security(cors_origins=("*",)).cors_allowed("http://anything.example:1")
    assert Security(cors_origins=("http://LOCALHOST:3000/",)).cors_allowed("http://localhost:3000")
    for bad in ("localhost:3000", "http://localhost:3000/app", "ftp://x"):
        with pytest.raises(ConfigError):
            Security(cors_origins=(bad,))


def test_exposure_warning_only_off_loopback_without_a_key() -> None:
    assert exposure_warning("0.0.0.0", None) and exposure_warning("192.168.1.5", "") and exposure_warning("::", None)
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        assert exposure_warning(host, None) is None
    assert exposure_warning("0.0.0.0", "key") is None
