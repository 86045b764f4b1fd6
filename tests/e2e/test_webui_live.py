"""The chat page against a live `kvmem serve` on the default model, in headless Chromium.

One server (auth on, small memory knobs so a short chat spans several blocks), one browser
page walked through a session: API key, streamed answers with stats, cache hits on the second
turn, Stop, reload, the memory view, a too-long message, hostile output, delete with the
workspace. The tests run in order and share the page.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from playwright.sync_api import expect
from serving import LiveServer, get_json
from webui_support import browser, open_page, screenshot_on_failure  # noqa: F401

KEY = "webui-test-key"
SERVER_FLAGS = [
    "--api-key",
    KEY,
    "--ctx",
    "1024",
    "--kvmem-block-tokens",
    "32",
    "--kvmem-budget",
    "256",
    "--kvmem-gen-budget",
    "64",
    "--kvmem-sink-tokens",
    "32",
    "--kvmem-recent-tokens",
    "64",
    "--kvmem-cpu-gb",
    "1",
    "--kvmem-retrieval-heads",
    "17:3,17:4,21:8",  # SmolLM2's calibrated heads: no calibration at start
]
STATS = re.compile(r"^(\d+) tokens · ([\d.]+) tok/s · (\d+) cache-hit tokens · prompt (\d+)")
# clicks Stop as soon as the streaming answer shows its first text
STOP_AT_FIRST_TEXT = """() => { const box = document.getElementById('messages');
    const obs = new MutationObserver(() => {
        const a = document.querySelector('#messages .msg-assistant.streaming .markdown');
        if (a && a.textContent.trim()) { obs.disconnect(); document.getElementById('stop').click(); } });
    obs.observe(box, {subtree: true, childList: true, characterData: true}); }"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    live = LiveServer(tmp_path_factory.mktemp("run"), *SERVER_FLAGS).start(timeout=180)
    try:
        yield live.url
    finally:
        live.stop()


def api_get(base: str, path: str) -> tuple[int, dict]:
    return get_json(base + path, headers={"Authorization": f"Bearer {KEY}"}, timeout=10)


@pytest.fixture(scope="module")
def session_page(browser, server):  # noqa: F811
    page = open_page(browser)
    page.goto(server + "/")
    yield page
    page.context.close()


@pytest.fixture()
def page(session_page, request):
    screenshot_on_failure(request, session_page)
    return session_page


def set_setting(page, name: str, value: str) -> None:
    if page.locator("#settings-panel").is_hidden():
        page.click("#toggle-settings")
    page.fill(f"#settings-form [name={name}]", value)
    page.locator(f"#settings-form [name={name}]").press("Tab")
    page.click("#toggle-settings")


def ask(page, text: str) -> str:
    """Send `text` and return the new answer's stats line once it finished."""
    answers = page.locator("#messages .msg-assistant")
    n = answers.count()
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")
    expect(answers).to_have_count(n + 1)
    expect(answers.nth(n)).not_to_have_class(re.compile("streaming"), timeout=60_000)
    return answers.nth(n).locator(".msg-stats").inner_text()


def last_answer(page):
    return page.locator("#messages .msg-assistant").last


def current_workspace(page) -> str:
    return page.evaluate(
        "JSON.parse(localStorage.getItem('kvmem.conv.' + localStorage.getItem('kvmem.current'))).workspaceId"
    )


def test_401_until_the_api_key_is_set_then_models_load(page, server) -> None:
    expect(page.locator("#banner-text")).to_contain_text("needs a valid API key (401)")
    page.click("#banner-action")
    expect(page.locator("#settings-panel")).to_be_visible()
    page.fill("#settings-form [name=apiKey]", KEY)
    page.locator("#settings-form [name=apiKey]").press("Tab")
    _, models = api_get(server, "/v1/models")
    served = [m["id"] for m in models["data"]]
    expect(page.locator("#set-model option")).to_have_text(served)
    expect(page.locator("#banner")).to_be_hidden()
    expect(page.locator("#server-status")).to_have_class("status-dot up")
    page.click("#toggle-settings")


def test_answer_streams_in_pieces_and_reports_speed(page) -> None:
    set_setting(page, "maxTokens", "24")
    set_setting(page, "temperature", "0")
    page.evaluate("""() => { window.__lengths = new Set();
        new MutationObserver(() => { const a = document.querySelector('#messages .msg-assistant.streaming .markdown');
                                     if (a) window.__lengths.add(a.textContent.length); })
          .observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true}); }""")
    stats = ask(page, "Name three colours.")
    m = STATS.match(stats)
    assert m, stats
    assert 1 <= int(m[1]) <= 24 and float(m[2]) > 0
    assert last_answer(page).locator(".markdown").inner_text().strip()
    assert page.evaluate("window.__lengths.size") >= 2
    expect(page.locator("#conv-title")).to_have_text("Name three colours.")


def test_second_turn_hits_the_cache(page) -> None:
    m = STATS.match(ask(page, "Now name one more."))
    assert m and int(m[3]) > 0, m


def test_stop_aborts_the_answer_and_the_server_keeps_serving(page) -> None:
    set_setting(page, "maxTokens", "32")
    page.evaluate(STOP_AT_FIRST_TEXT)
    assert ask(page, "Tell me a long story about a dragon.").endswith("stopped")
    assert last_answer(page).locator(".markdown").inner_text().strip()
    expect(page.locator("#send")).to_be_visible()
    expect(page.locator("#stop")).to_be_hidden()
    assert STATS.match(ask(page, "Thanks."))


def test_reload_finds_the_conversation(page) -> None:
    page.reload()
    expect(page.locator("#conv-list .conv.active .conv-name")).to_have_text("Name three colours.")
    expect(page.locator("#messages .msg")).to_have_count(8)
    assert "stopped" in page.locator("#messages .msg-assistant .msg-stats").nth(2).inner_text()
    page.click("#new-chat")
    expect(page.locator("#messages .msg")).to_have_count(0)
    expect(page.locator("#conv-list .conv")).to_have_count(2)
    page.locator("#conv-list .conv", has_text="Name three colours.").click()
    expect(page.locator("#messages .msg")).to_have_count(8)


def test_memory_view_shows_the_workspace_blocks(page, server) -> None:
    page.click("#toggle-memory")
    blocks = page.locator("#memory .block")
    expect(blocks.first).to_be_visible(timeout=10_000)
    ws_id = current_workspace(page)
    status, ws = api_get(server, f"/v1/kvmem/workspaces/{ws_id}")
    assert status == 200
    assert blocks.count() == len(ws["blocks"]) >= 2
    stored, in_view, hits = (int(v.replace(",", "")) for v in page.locator("#memory .stat-value").all_inner_texts())
    assert stored == sum(b["end"] - b["start"] for b in ws["blocks"])
    sel = ws["last_selection"]
    assert in_view == (stored if sel["method"] == "full" else sel["history_tokens"] + sel["tail_tokens"])
    assert hits == int(STATS.match(last_answer(page).locator(".msg-stats").inner_text())[3])
    selected = set(range(len(ws["blocks"]))) if sel["method"] == "full" else set(sel["blocks"])
    assert {i for i in range(blocks.count()) if "selected" in blocks.nth(i).get_attribute("class")} == selected
    blocks.first.hover()
    expect(page.locator("#memory .tooltip")).to_contain_text(
        f"Block 0 · tokens {ws['blocks'][0]['start']}–{ws['blocks'][0]['end']}"
    )
    page.click("#toggle-memory")


def test_too_long_message_is_a_clear_error(page) -> None:
    long_text = "word " * 1500
    page.fill("#prompt", long_text)
    page.press("#prompt", "Enter")
    expect(page.locator("#banner-text")).to_contain_text("too long for the server", timeout=30_000)
    assert page.input_value("#prompt") == long_text
    page.fill("#prompt", "")
    page.click("#banner-close")


def test_html_in_a_real_answer_stays_text(page) -> None:
    ask(page, "Repeat exactly: <img src=x onerror=window.__xss=1> <script>window.__xss=2</script>")
    assert page.locator("#messages img, #messages script").count() == 0
    page.wait_for_timeout(200)
    assert page.evaluate("window.__xss") is None
    assert page.errors == []


def test_delete_offers_to_free_the_server_workspace(page, server) -> None:
    page.locator("#conv-list .conv", has_text="Name three colours.").click()
    ws_id = current_workspace(page)
    assert api_get(server, f"/v1/kvmem/workspaces/{ws_id}")[0] == 200
    page.click("#delete")
    expect(page.locator("#delete-ws-id")).to_have_text(ws_id)
    expect(page.locator("#delete-ws")).to_be_checked()
    page.click("#delete-dialog button[value=ok]")
    expect(page.locator("#conv-list .conv-name", has_text="Name three colours.")).to_have_count(0)
    for _ in range(50):
        if api_get(server, f"/v1/kvmem/workspaces/{ws_id}")[0] == 404:
            return
        page.wait_for_timeout(100)
    pytest.fail(f"workspace {ws_id} still on the server after the delete")


def test_stopping_a_new_conversations_first_answer_still_links_its_workspace(page, server) -> None:
    page.click("#new-chat")
    page.evaluate(STOP_AT_FIRST_TEXT)
    assert ask(page, "Tell me a long story about a castle.").endswith("stopped")
    ws_id = current_workspace(page)
    assert ws_id and api_get(server, f"/v1/kvmem/workspaces/{ws_id}")[0] == 200
