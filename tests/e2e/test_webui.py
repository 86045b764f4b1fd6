"""The chat page in a real headless Chromium, served as plain static files (no API behind it):
safe rendering of hostile model output, thinking blocks, the memory view, conversations kept
in the browser, narrow screens and the server-down state. test_webui_live.py covers the page
against a live `kvmem serve`."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from playwright.sync_api import expect
from kvmem.serve_process import free_port
from webui_support import browser, new_page, open_page, screenshot_on_failure, static_server, stop  # noqa: F401

XSS = (
    'Here: <img src=x onerror="window.__xss=1"> and <script>window.__xss=2</script> '
    '[link](javascript:window.__xss=3) <b onmouseover="window.__xss=4">b</b>\n\n'
    '<iframe src="javascript:window.__xss=5"></iframe>\n\n'
    "**bold**\n\n```python\nprint('<script>')\n```"
)


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    port = free_port()
    proc = static_server(port)
    yield f"http://127.0.0.1:{port}"
    stop(proc)


@pytest.fixture()
def page(browser, request, base_url):  # noqa: F811
    """A fresh page (empty storage) for tests that use the page's own flows."""
    page = new_page(browser, request)
    page.goto(base_url + "/")
    page.wait_for_selector("#conv-list .conv")
    return page


@pytest.fixture(scope="module")
def shared_page(browser, base_url):  # noqa: F811
    page = open_page(browser)
    page.goto(base_url + "/")
    page.wait_for_selector("#conv-list .conv")
    yield page
    page.context.close()


@pytest.fixture()
def probe(shared_page, request):
    """One page shared by the tests that call the page's modules directly."""
    screenshot_on_failure(request, shared_page)
    return shared_page


def seed(page, conversations: list[dict]) -> None:
    """Stores conversations as the page keeps them, then reloads so the page reads them back."""
    page.evaluate(
        """(convs) => { for (const c of convs) localStorage.setItem('kvmem.conv.' + c.id, JSON.stringify(c));
                        localStorage.setItem('kvmem.current', convs[0].id); }""",
        conversations,
    )
    page.reload()
    page.wait_for_selector("#conv-list .conv")


def conversation(
    cid: str, title: str, messages: list[dict], updated: int = 1_700_000_000_000, ws: str | None = None
) -> dict:
    return {"id": cid, "title": title, "created": updated, "updated": updated, "workspaceId": ws, "messages": messages}


def test_renderer_shows_html_in_model_output_as_text(probe) -> None:
    html = probe.evaluate(
        """async (text) => { const r = await import('/js/render.js');
                             const box = document.createElement('div'); box.id = 'rendered';
                             box.innerHTML = r.markdownToHtml(text); document.body.append(box);
                             await new Promise((ok) => setTimeout(ok, 300));
                             return box.innerHTML; }""",
        XSS,
    )
    box = probe.locator("#rendered")
    assert box.locator("img, script, iframe, b").count() == 0
    assert box.locator("a[href^='javascript']").count() == 0
    assert box.locator("[onerror], [onmouseover]").count() == 0
    text = box.inner_text()
    assert '<img src=x onerror="window.__xss=1">' in text
    assert "<script>window.__xss=2</script>" in text
    assert box.locator("strong").inner_text() == "bold"
    assert box.locator("pre code").inner_text().startswith("print('<script>')")
    assert probe.evaluate("window.__xss") is None, html
    assert probe.errors == []


def test_stored_hostile_answer_renders_as_text_with_thinking_folded(page) -> None:
    answer = '<think>Plan: <img src=x onerror="window.__xss=6"></think>' + XSS
    seed(
        page,
        [
            conversation(
                "c1",
                "hostile",
                [
                    {"role": "user", "content": "<script>window.__xss=7</script>"},
                    {"role": "assistant", "content": answer},
                ],
            )
        ],
    )
    msgs = page.locator("#messages .msg")
    assert msgs.count() == 2
    assert msgs.nth(0).inner_text().startswith("<script>window.__xss=7</script>")
    think = page.locator(".msg-assistant details.think")
    assert think.count() == 1 and think.get_attribute("open") is None
    assert think.locator("summary").inner_text() == "Thoughts"
    think.locator("summary").click()
    assert '<img src=x onerror="window.__xss=6">' in think.inner_text()
    assert page.locator("#messages img, #messages script, #messages iframe").count() == 0
    page.wait_for_timeout(300)
    assert page.evaluate("window.__xss") is None
    assert page.errors == []


def test_split_think_handles_open_closed_and_template_opened_blocks(probe) -> None:
    cases = probe.evaluate(
        """async () => { const { splitThink } = await import('/js/render.js');
                         return ['<think>a</think>b', '<think>still', 'x</think>y', 'plain'].map(splitThink); }"""
    )
    assert cases == [
        {"thinking": "a", "answer": "b", "open": False},
        {"thinking": "still", "answer": "", "open": True},
        {"thinking": "x", "answer": "y", "open": False},
        {"thinking": "", "answer": "plain", "open": False},
    ]


def test_thinking_settings_and_history_reach_the_request(probe) -> None:
    body = probe.evaluate(
        """async () => { const { requestBody } = await import('/js/settings.js');
                         const { historyOf } = await import('/js/chat.js');
                         const { DEFAULT_SETTINGS } = await import('/js/store.js');
                         const history = historyOf([{role: 'user', content: 'q'},
                                                    {role: 'assistant', content: 'a', reasoning: 'r'}]);
                         return [requestBody(history, {...DEFAULT_SETTINGS, thinking: 'off', thinkingBudget: 64}),
                                 requestBody(history, DEFAULT_SETTINGS)]; }"""
    )
    assert body[0]["messages"][1] == {"role": "assistant", "content": "a", "reasoning_content": "r"}
    assert body[0]["reasoning_budget_tokens"] == 64 and body[0]["chat_template_kwargs"] == {"enable_thinking": False}
    assert "reasoning_budget_tokens" not in body[1] and "chat_template_kwargs" not in body[1]


WORKSPACE = {
    "id": "ws_test",
    "block_tokens": 32,
    "budget": 128,
    "gen_budget": 64,
    "blocks": [
        {
            "index": i,
            "start": 32 * i,
            "end": 32 * (i + 1),
            "tier": tier,
            "preview": f"words of block {i} <b>not bold</b> tail",
        }
        for i, tier in enumerate(["gpu", "host", "nvme", "host", "gpu", "nvme"])
    ]
    + [{"index": 6, "start": 192, "end": 208, "tier": "gpu", "preview": ""}],
    "last_selection": {"blocks": [0, 4, 6]},
    "totals": {"tokens_stored": 208, "cache_hit_tokens": 150},
}


def test_memory_view_draws_blocks_by_tier_selection_and_scale(probe) -> None:
    probe.evaluate(
        """async (ws) => { const m = await import('/js/memory.js');
                           const root = document.getElementById('memory');
                           document.getElementById('memory-panel').hidden = false;
                           m.renderMemory(root, {status: 'ok', workspace: ws, lastAnswer: {cachedTokens: 96}}); }""",
        WORKSPACE,
    )
    blocks = probe.locator("#memory .block")
    assert blocks.count() == 7
    assert [blocks.nth(i).get_attribute("class") for i in range(7)] == [
        "block tier-gpu selected",
        "block tier-host",
        "block tier-nvme",
        "block tier-host",
        "block tier-gpu selected",
        "block tier-nvme",
        "block tier-gpu selected",
    ]
    assert probe.locator("#memory .stat-value").all_inner_texts() == ["208", "80", "96"]
    full, half = blocks.nth(0).bounding_box()["width"], blocks.nth(6).bounding_box()["width"]
    assert abs(half / full - 0.5) < 0.05
    segs = {
        c: probe.locator(f"#memory .{c}").bounding_box()["width"] for c in ("seg-view", "seg-budget", "seg-reserve")
    }
    bar = probe.locator("#memory .scale-bar").first.bounding_box()["width"]
    assert abs(segs["seg-view"] / bar - 80 / 208) < 0.01
    assert abs(segs["seg-budget"] / bar - 48 / 208) < 0.01
    assert abs(segs["seg-reserve"] / bar - 64 / 208) < 0.01
    blocks.nth(1).hover()
    tip = probe.locator("#memory .tooltip")
    assert tip.is_visible()
    assert tip.inner_text() == "Block 1 · tokens 32–64 · host RAM\n“words of block 1 <b>not bold</b> tail”"
    blocks.nth(6).hover()
    assert tip.inner_text() == "Block 6 · tokens 192–208 · GPU view\n(no text preview)"


def test_conversations_rename_export_delete_and_switch(page) -> None:
    seed(
        page,
        [
            conversation("c2", "second", [{"role": "user", "content": "two"}], updated=2),
            conversation(
                "c1", "first", [{"role": "user", "content": "one"}, {"role": "assistant", "content": "uno"}], updated=1
            ),
        ],
    )
    assert page.locator("#conv-list .conv-name").all_inner_texts() == ["second", "first"]
    page.locator("#conv-list .conv", has_text="first").click()
    expect(page.locator("#messages .msg")).to_have_text(["one", "uno"])
    page.click("#rename")
    page.fill("#rename-input", "renamed")
    page.click("#rename-dialog button[value=ok]")
    expect(page.locator("#conv-title")).to_have_text("renamed")
    with page.expect_download() as info:
        page.click("#export")
    exported = json.loads(open(info.value.path(), encoding="utf-8").read())
    assert exported["title"] == "renamed" and exported["format"] == "kvmem.conversation"
    assert exported["messages"] == [{"role": "user", "content": "one"}, {"role": "assistant", "content": "uno"}]
    page.click("#delete")
    assert page.locator("#delete-ws-row").is_hidden()
    page.click("#delete-dialog button[value=ok]")
    expect(page.locator("#conv-list .conv-name")).to_have_text(["second"])
    page.reload()
    assert page.locator("#conv-list .conv-name").all_inner_texts() == ["second"]
    assert page.locator("#conv-title").inner_text() == "second"


def test_phone_width_has_no_sideways_scroll_and_a_drawer(browser, request, base_url) -> None:  # noqa: F811
    page = new_page(browser, request, width=390, height=800)
    page.goto(base_url + "/")
    page.wait_for_selector("#conv-list .conv")
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    assert page.locator("#sidebar").bounding_box()["x"] < 0
    page.click("#toggle-sidebar")
    page.wait_for_function("() => document.getElementById('sidebar').getBoundingClientRect().x >= 0")
    page.click("#scrim", position={"x": 370, "y": 400})
    page.click("#toggle-memory")
    assert page.locator("#memory-panel").bounding_box()["width"] == 390
    expect(page.locator("#memory")).to_contain_text("No memory yet")


def test_server_down_shows_a_clear_error_and_keeps_the_message(browser, request) -> None:  # noqa: F811
    port = free_port()
    proc = static_server(port)
    page = new_page(browser, request)
    page.goto(f"http://127.0.0.1:{port}/")
    page.wait_for_selector("#conv-list .conv")
    stop(proc)
    page.fill("#prompt", "are you there?")
    page.press("#prompt", "Enter")
    page.wait_for_selector("#banner:not([hidden])")
    assert "cannot be reached" in page.locator("#banner-text").inner_text()
    assert page.locator("#banner-action").inner_text() == "Retry"
    assert page.input_value("#prompt") == "are you there?"
    assert page.locator("#messages .msg").count() == 0
    assert page.locator("#conv-list .conv-name").all_inner_texts() == ["New conversation"]
    assert page.evaluate("Object.keys(localStorage).filter((k) => k.startsWith('kvmem.conv.'))") == []
    assert page.locator("#server-status").get_attribute("class") == "status-dot down"


def test_memory_view_reads_the_store_shape_and_full_selection(probe) -> None:
    store_shaped = {  # kvmem_core.store.Store.workspace_info after a step whose prompt fit the budget
        "id": "ws_a",
        "namespace": "n",
        "blocks": [
            {"index": 0, "hash": "h0", "start": 0, "end": 32, "tier": "host+nvme"},
            {"index": 1, "hash": "h1", "start": 32, "end": 64, "tier": "nvme"},
            {"index": 2, "hash": "h2", "start": 64, "end": 96, "tier": "missing"},
        ],
        "tokens": 96,
        "created": 0.0,
        "last_used": 0.0,
        "in_use": True,
        "totals": {"blocks": 3, "tokens": 96, "host_blocks": 1, "nvme_blocks": 2, "missing_blocks": 1},
        "last_selection": {"method": "full", "position_mode": "original"},
    }
    ws = probe.evaluate("async (ws) => (await import('/js/memory.js')).normalizeWorkspace(ws)", store_shaped)
    assert ws["blockTokens"] == 32 and ws["budget"] is None
    assert [(b["tier"], b["selected"]) for b in ws["blocks"]] == [("host", True), ("nvme", True), ("none", True)]
    assert ws["totals"] == {"stored": 96, "inView": 96, "cacheHits": None}
    store_shaped["last_selection"] = {"method": "retrieval", "blocks": [0, 2], "history_tokens": 64, "tail_tokens": 5}
    ws = probe.evaluate("async (ws) => (await import('/js/memory.js')).normalizeWorkspace(ws)", store_shaped)
    assert [b["selected"] for b in ws["blocks"]] == [True, False, True]
    assert ws["totals"]["inView"] == 69


ERROR_CASES = [
    (
        429,
        {"error": {"message": "server busy", "type": "rate_limit_error", "param": None, "code": "queue_full"}},
        {"Retry-After": "3"},
        "busy",
        "The server is busy with other requests (429). Try again in 3 s.",
    ),
    (
        400,
        {
            "error": {
                "message": "prompt of 1500 tokens exceeds --ctx 1024.",
                "type": "invalid_request_error",
                "param": "messages",
                "code": "context_length_exceeded",
            }
        },
        {},
        "too_long",
        "This conversation is too long for the server (400): prompt of 1500 tokens exceeds --ctx 1024. "
        "Start a new chat or delete this one.",
    ),
    (
        413,
        {
            "error": {
                "message": "mandatory spans exceed the budget.",
                "type": "invalid_request_error",
                "param": None,
                "code": "mandatory_over_budget",
            }
        },
        {},
        "too_long",
        "This conversation is too long for the server (413): mandatory spans exceed the budget. "
        "Start a new chat or delete this one.",
    ),
    (
        401,
        {
            "error": {
                "message": "missing API key",
                "type": "authentication_error",
                "param": None,
                "code": "invalid_api_key",
            }
        },
        {},
        "auth",
        "The server needs a valid API key (401). Enter it in Settings.",
    ),
    (
        503,
        {
            "error": {
                "message": "the engine is starting",
                "type": "server_error",
                "param": None,
                "code": "engine_unavailable",
            }
        },
        {"Retry-After": "2"},
        "restarting",
        "The engine is restarting (503). Try again in 2 s.",
    ),
    (500, "not json", {}, "server", "The server refused the request (500): 500"),
]


def test_error_responses_become_one_clear_sentence(probe) -> None:
    got = probe.evaluate(
        """async (cases) => { const api = await import('/js/api.js');
             const out = [];
             for (const [status, body, headers] of cases) {
               const payload = typeof body === 'string' ? body : JSON.stringify(body);
               const err = await api.errorFrom(new Response(payload, {status, headers}));
               out.push([err.kind, api.errorText(err)]);
             }
             return out; }""",
        [case[:3] for case in ERROR_CASES],
    )
    assert got == [[kind, text] for *_, kind, text in ERROR_CASES]
