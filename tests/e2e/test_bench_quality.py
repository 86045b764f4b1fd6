"""``kvmem bench quality`` against live ``kvmem serve`` processes on the small model: a bounded view from the first
prefill, every method on one stored workspace, the command's contract, and a run that stops and resumes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvmem_bench.api import Api
from kvmem_bench.quality import Journal, RunOptions, gold_blocks, run_queue, run_session
from kvmem_bench.quality_plan import Cell, Queue, View, fit_kinds, make_any_session
from kvmem.tools_format import render_plain
from serving import ROOT, LiveServer

pytestmark = [pytest.mark.llamacpp]
CONTRACT = {"view", "budget", "method", "workspace_tokens", "kind", "n", "accuracy", "errors", "gold_block_recall"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = LiveServer(
        tmp_path_factory.mktemp("serve"),
        "--no-ui",
        "--ctx",
        "8192",
        "--kvmem-budget",
        "1024",
        "--kvmem-block-tokens",
        "128",
    ).start()  # the assertions below count 128-token blocks
    yield live
    live.stop()


def chatml(messages: list[dict]) -> str:
    """SmolLM2's template for a transcript without tools, up to the generation prompt."""
    turns = render_plain(messages, None)
    return "".join(f"<|im_start|>{t['role']}\n{t['content']}<|im_end|>\n" for t in turns) + "<|im_start|>assistant\n"


@pytest.mark.slow
def test_methods_share_one_bounded_prefill_and_leave_nothing_behind(server: LiveServer) -> None:
    api = Api(server.url)
    fits = fit_kinds(api.count_tokens, ("passkey", "record"))
    for kind in ("passkey", "record"):
        session = make_any_session(kind, 2000, 0.2, "tuning", 1, fits[kind])
        heads, recent, oracle = run_session(api, session, View("default", None))
        n = heads.prompt_tokens
        assert heads.method == "retrieval" and heads.cached_tokens < 128  # the first request prefills the workspace
        assert recent.cached_tokens >= n // 128 * 128 - 128 and oracle.cached_tokens >= n // 128 * 128 - 128
        for o in (heads, recent, oracle):
            assert o.error is None and 1700 <= o.prompt_tokens == n <= 2400 and o.view == "default" and o.budget is None
            assert o.gold_blocks and max(o.gold_blocks) < n // 128
            assert o.selected_blocks is not None and len(o.selected_blocks) * 128 <= 1024  # the server's view
            assert o.gold_selected == set(o.gold_blocks).issubset(o.selected_blocks)
        assert oracle.gold_selected is True
        assert recent.selected_blocks[-1] == n // 128 - 1
    assert api.call("GET", "/v1/kvmem/workspaces")["data"] == []


@pytest.mark.slow
def test_gold_blocks_match_the_exactly_tokenized_prompt(server: LiveServer) -> None:
    api = Api(server.url)
    session = make_any_session("chain", 1500, 0.6, "tuning", 2)
    text = chatml(list(session.messages))
    exact = set()
    for line in session.fact.statements:
        start = api.count_tokens(text[: text.index(line)])
        end = api.count_tokens(text[: text.index(line) + len(line)])
        exact.update(range(start // 128, (end - 1) // 128 + 1))
    assert gold_blocks(api, session, api.count_tokens(text), 128) == tuple(sorted(exact))


def quality(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvmem", "bench", "quality", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        check=False,
    )


@pytest.mark.slow
def test_the_command_prints_the_contract_and_resumes_what_it_did_not_finish(server: LiveServer, tmp_path: Path) -> None:
    base = ["--url", server.url, "--quick", "--json", "--out", str(tmp_path)]
    stopped = quality(*base, "--limit", "2", "--deadline", "0")
    assert stopped.returncode == 130, stopped.stderr[-2000:]  # nothing started: the run says it is incomplete
    assert json.loads((tmp_path / "quality.json").read_text())["complete"] is False
    first = quality(*base, "--limit", "1", "--resume")
    assert first.returncode == 0, first.stderr[-2000:]
    result = json.loads(first.stdout.strip().splitlines()[-1])
    assert [(r["view"], r["method"], r["n"]) for r in result["results"]] == [
        ("default", "oracle", 1),
        ("default", "recent", 1),
        ("default", "retrieval", 1),
    ]
    assert all(set(r) >= CONTRACT and r["workspace_tokens"] == 8192 for r in result["results"])
    meta = result["meta"]
    assert meta["plan"] == "quick" and meta["split"] == "tuning" and meta["commit"] and meta["machine"]
    assert meta["command"].startswith("kvmem bench quality --url")
    assert re.search(r"\| retrieval @ default +\| \d+% \(1\)", first.stdout), first.stdout
    assert "| 8192 @ default" in first.stdout
    second = quality(*base, "--limit", "2", "--resume")  # runs only the session the journal lacks
    assert second.returncode == 0, second.stderr[-2000:]
    lines = (tmp_path / "outcomes.jsonl").read_text().splitlines()
    assert len(lines) == 6 and len({json.loads(line)["session"] for line in lines}) == 2
    assert {p.name for p in tmp_path.iterdir()} >= {"quality.json", "outcomes.jsonl", "accuracy_vs_size.png"}


def test_a_server_that_cannot_start_turns_its_sessions_into_counted_errors(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "outcomes.jsonl", resume=False)
    sessions = tuple(make_any_session(k, 1000, 0.5, "tuning", 0) for k in ("kv", "port"))
    queue = Queue(Cell(1000), View("default", None), 0, sessions)
    opts = RunOptions(tmp_path, model=str(tmp_path / "missing.gguf"))
    run_queue(queue, opts, journal, threading.Event(), lambda line: None)
    assert len(journal.outcomes) == 6 and all(o["error"].startswith("server:") for o in journal.outcomes)
    assert not any(o["correct"] for o in journal.outcomes)
