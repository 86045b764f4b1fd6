"""Other web pages against a live ``kvmem serve`` in real Chromium: CSRF, DNS rebinding, and CORS.

Chromium resolves every ``*.test`` name to 127.0.0.1, so one static server on another port
plays two sites: ``evil.test`` (a page the user happens to visit) and ``friend.test`` (named
in ``--cors-origins``). A page on ``evil.test`` must neither run a step nor read a
workspace; a page on ``rebind.test:PORT`` (DNS rebinding: same origin as the API in the
browser's eyes) must be refused by the Host check; ``friend.test`` may use the API.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serving import LiveServer
from webui_support import chromium, static_server, stop

from kvmem.serve_process import free_port

pytestmark = pytest.mark.llamacpp
ALIAS = "gpt-4o-mini"
FETCH = """async ([url, init]) => {
  try {
    const r = await fetch(url, init);
    return {status: r.status, type: r.type, body: r.type === "opaque" ? null : await r.text()};
  } catch (e) {
    return {error: String(e)};
  }
}"""


@pytest.fixture(scope="module")
def site_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    root = tmp_path_factory.mktemp("site")
    (root / "index.html").write_text("<!doctype html><title>another site</title><p>hello")
    port = free_port()
    proc = static_server(port, root)
    yield port
    stop(proc)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, site_port: int) -> Iterator[LiveServer]:
    live = LiveServer(
        tmp_path_factory.mktemp("run"),
        "--cors-origins",
        f"http://friend.test:{site_port}",
        "--served-model-name",
        ALIAS,
        "--kvmem-block-tokens",
        "32",
    ).start(timeout=300)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def workspace(server: LiveServer) -> str:
    """A workspace whose block previews hold a secret."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    secret = [{"role": "user", "content": "The password is swordfish. " * 12}]
    done = client.chat.completions.create(model=ALIAS, messages=secret, max_tokens=2, temperature=0)
    assert done.model == ALIAS
    return done.kvmem["workspace_id"]


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    with chromium("--host-resolver-rules=MAP *.test 127.0.0.1") as instance:
        yield instance


def page_on(browser: Any, url: str) -> Any:
    page = browser.new_context().new_page()
    page.goto(url)
    return page


def fetch(page: Any, url: str, **init: Any) -> dict[str, Any]:
    return page.evaluate(FETCH, [url, init])


def chat_body(content: str) -> str:
    return json.dumps({"model": ALIAS, "messages": [{"role": "user", "content": content}], "max_tokens": 2})


def counters(server: LiveServer) -> dict[str, float]:
    """Every sample of ``/metrics`` by name and labels."""
    text = urllib.request.urlopen(server.url + "/metrics", timeout=5).read().decode()
    return {
        s.name + json.dumps(s.labels, sort_keys=True): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_a_foreign_page_can_neither_run_steps_nor_read_workspaces(
    browser: Any, server: LiveServer, site_port: int, workspace: str
) -> None:
    page = page_on(browser, f"http://evil.test:{site_port}/")
    chat, info = server.url + "/v1/chat/completions", f"{server.url}/v1/kvmem/workspaces/{workspace}"
    before = counters(server)
    text_plain = {"method": "POST", "headers": {"Content-Type": "text/plain"}, "body": chat_body("Say pwned.")}
    assert "error" in fetch(page, chat, **text_plain)  # the browser got no CORS grant to read it
    assert fetch(page, chat, mode="no-cors", **text_plain)["type"] == "opaque"
    assert "error" in fetch(
        page, chat, method="POST", headers={"Content-Type": "application/json"}, body=chat_body("Say pwned.")
    )  # its preflight was refused
    assert "error" in fetch(page, info)
    assert fetch(page, info, mode="no-cors")["type"] == "opaque"
    after = counters(server)
    assert after["kvmem_steps_total{}"] == before["kvmem_steps_total{}"]  # nothing ran, even unread
    refused = 'kvmem_requests_total{"route": "/v1/chat/completions", "status": "403"}'
    assert after[refused] - before.get(refused, 0) >= 2


def test_dns_rebinding_is_refused_by_the_host_check(browser: Any, server: LiveServer, workspace: str) -> None:
    rebound = f"http://rebind.test:{server.port}"
    page = browser.new_context().new_page()
    assert page.goto(rebound + "/").status == 403
    got = fetch(page, f"{rebound}/v1/kvmem/workspaces/{workspace}")  # same origin for the browser
    assert got["status"] == 403 and json.loads(got["body"])["error"]["code"] == "host_not_allowed"
    assert "swordfish" not in got["body"]


def test_a_cors_origin_uses_the_api_and_reads_its_answers(
    browser: Any, server: LiveServer, site_port: int, workspace: str
) -> None:
    page = page_on(browser, f"http://friend.test:{site_port}/")
    models = fetch(page, server.url + "/v1/models")
    assert models["status"] == 200 and json.loads(models["body"])["data"][0]["id"] == ALIAS
    done = fetch(
        page,
        server.url + "/v1/chat/completions",
        method="POST",
        headers={"Content-Type": "application/json"},
        body=chat_body("Name a colour."),
    )
    assert done["status"] == 200 and json.loads(done["body"])["model"] == ALIAS
    info = fetch(page, f"{server.url}/v1/kvmem/workspaces/{workspace}")
    assert info["status"] == 200 and "swordfish" in info["body"]  # what the other pages could not read
    wrong_type = fetch(
        page,
        server.url + "/v1/chat/completions",
        method="POST",
        headers={"Content-Type": "text/plain"},
        body=chat_body("x"),
    )
    assert wrong_type["status"] == 415  # refused, and the refusal is readable by the allowed page
