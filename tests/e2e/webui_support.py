"""Shared by the web UI tests: the installed Chromium driven by Playwright, waiting for HTTP
servers, and a screenshot of every failed test's page."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WEBUI_DIR = ROOT / "webui"
ARTIFACTS = Path(os.environ.get("KVMEM_TEST_ARTIFACTS", ROOT / "test-artifacts")) / "webui"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium_or_skip() -> str:
    """The Debian chromium binary; skips the test when it is not installed."""
    path = shutil.which("chromium")
    if path is None:
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return path


def wait_http(url: str, proc: subprocess.Popen, timeout: float, headers: dict[str, str] | None = None) -> None:
    """Poll `url` until it answers 2xx; fail with the process's output if it exits or times out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            pytest.fail(f"server exited with {proc.returncode} before {url} answered:\n{out}")
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=2):
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.2)
    pytest.fail(f"{url} did not answer within {timeout} s")


def stop(proc: subprocess.Popen) -> None:
    """Terminate a server this test started and wait for it."""
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def static_server(port: int, directory: Path = WEBUI_DIR) -> subprocess.Popen:
    """`python -m http.server` on `directory` (an index.html in it), by default webui/: the page without
    any API behind it."""
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(directory)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_http(f"http://127.0.0.1:{port}/index.html", proc, timeout=15)
    return proc


@contextlib.contextmanager
def chromium(*extra_args: str) -> Iterator[object]:
    """A headless Chromium with `extra_args` on its command line; skips the test when it is not installed."""
    executable = chromium_or_skip()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        instance = pw.chromium.launch(executable_path=executable, args=[*CHROMIUM_ARGS, *extra_args])
        yield instance
        instance.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    """One headless Chromium for the whole module."""
    with chromium() as instance:
        yield instance


def screenshot_on_failure(request: pytest.FixtureRequest, page: object) -> None:
    """At the end of the requesting test, save `page` as <artifacts>/webui/<test>.png if it failed."""
    failed_before = request.session.testsfailed

    def shoot() -> None:
        if request.session.testsfailed > failed_before:
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / f"{request.node.name}.png"), full_page=True)

    request.addfinalizer(shoot)


def open_page(browser: object, width: int = 1280, height: int = 800) -> object:
    """A page in a fresh context (empty localStorage); page errors collect in `page.errors`."""
    context = browser.new_context(viewport={"width": width, "height": height}, accept_downloads=True)
    page = context.new_page()
    page.errors = []
    page.on("pageerror", lambda exc: page.errors.append(str(exc)))
    return page


def new_page(browser: object, request: pytest.FixtureRequest, width: int = 1280, height: int = 800) -> object:
    """open_page() for one test: screenshot if it fails, context closed after it."""
    page = open_page(browser, width, height)
    request.addfinalizer(page.context.close)
    screenshot_on_failure(request, page)
    return page
