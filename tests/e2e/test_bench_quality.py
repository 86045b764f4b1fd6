"""``kvmem bench quality`` against a live ``kvmem serve`` on the embedded model: two sessions, three methods."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvmem.bench.api import Api
from kvmem.bench.quality import gold_blocks, run_all
from kvmem.bench.quality_plan import ORACLE, Method, Plan
from kvmem.bench.sessions import fit_chars_per_token, make_sessions
from kvmem.tools_format import render_plain
from serving import ROOT, LiveServer

pytestmark = [pytest.mark.llamacpp, pytest.mark.slow]
CONTRACT = {"method", "scorer", "workspace_tokens", "budget", "depth", "n", "accuracy", "gold_block_recall"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = LiveServer(tmp_path_factory.mktemp("serve"), "--no-ui", "--ctx", "8192", "--kvmem-budget", "2048",
                      "--kvmem-block-tokens", "128").start()  # the assertions below count 128-token blocks
    yield live
    live.stop()


def chatml(messages: list[dict]) -> str:
    """SmolLM2's template for a transcript without tools, up to the generation prompt."""
    turns = render_plain(messages, None)
    return "".join(f"<|im_start|>{t['role']}\n{t['content']}<|im_end|>\n" for t in turns) + "<|im_start|>assistant\n"


def test_methods_share_one_prefill_and_leave_nothing_behind(server: LiveServer) -> None:
    api = Api(server.url)
    sessions = make_sessions([1000], [0.2], ["passkey", "owner"], seed=1,
                             chars_per_token=fit_chars_per_token(api.count_tokens))
    plan = Plan(grid=())
    finished: list[list] = []
    outs = run_all(api, sessions, plan, (ORACLE, Method("recent"), Method("retrieval", "retrieval-heads")), full_budget=0,
                   on_session=finished.append)
    assert [o for got in finished for o in got] == outs and len(finished) == len(sessions)  # kept as each ends
    assert [(o.session, o.method) for o in outs] == [(s.id, m) for s in sessions for m in ("recent", "retrieval", "oracle")]
    for session, (recent, heads, oracle) in zip(sessions, zip(outs[0::3], outs[1::3], outs[2::3]), strict=True):
        n = recent.prompt_tokens
        question = api.count_tokens(chatml(list(session.messages[:-1]))[:-len("<|im_start|>assistant\n")])
        assert recent.cached_tokens < 128  # the first request prefills the workspace
        assert question // 128 * 128 <= heads.cached_tokens <= question  # scoring recomputes only the question
        assert oracle.cached_tokens == n - 1  # a step that does not score reuses all but the last token
        for o in (recent, heads, oracle):
            assert o.error is None and 800 <= o.prompt_tokens == n <= 1250
            assert o.gold_blocks and max(o.gold_blocks) < n // 128
            assert o.selected_blocks is not None and len(o.selected_blocks) * 128 <= plan.budget(1000) == o.budget
            assert o.gold_selected == set(o.gold_blocks).issubset(o.selected_blocks)
            assert not o.correct or o.expected.lower() in o.answer.lower()
        assert oracle.gold_selected is True
        assert recent.selected_blocks[-1] == n // 128 - 1
        assert list(recent.selected_blocks[1:]) == list(range(recent.selected_blocks[1], n // 128))
    assert api.call("GET", "/v1/kvmem/workspaces")["data"] == []


def test_gold_blocks_match_the_exactly_tokenized_prompt(server: LiveServer) -> None:
    api = Api(server.url)
    session = make_sessions([1500], [0.6], ["chain"], seed=2)[0]
    text = chatml(list(session.messages))
    exact = set()
    for line in session.fact.statements:
        start = api.count_tokens(text[:text.index(line)])
        end = api.count_tokens(text[:text.index(line) + len(line)])
        exact.update(range(start // 128, (end - 1) // 128 + 1))
    assert gold_blocks(api, session, api.count_tokens(text), 128) == tuple(sorted(exact))


def test_the_command_prints_the_contract_as_its_last_line(server: LiveServer, tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "kvmem", "bench", "quality", "--url", server.url, "--quick", "--json",
                          "--limit", "1", "--methods", "retrieval/retrieval-heads,recent,oracle", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["model"].startswith("SmolLM2")
    assert [(r["method"], r["scorer"], r["n"]) for r in result["results"]] == [
        ("oracle", None, 1), ("recent", None, 1), ("retrieval", "retrieval-heads", 1)]
    assert all(set(r) >= CONTRACT and r["workspace_tokens"] == 4096 and r["budget"] == 512 and r["depth"] == 0.1
               for r in result["results"])
    assert 3700 <= result["results"][0]["prompt_tokens"] <= 4500  # sized in SmolLM2's tokens, fitted on the server
    goals = result["summary"]["goals"]
    assert goals["sizes"]["4096"]["budget"] == 512 and goals["sizes"]["4096"]["vs_full"] is None
    assert goals["sizes"]["4096"]["early_vs_recent"]["sessions"] == 1 and goals["beyond_trained_context"] is None
    assert "| retrieval/retrieval-heads |" in out.stdout and "| oracle " in out.stdout and "4096 tok, view 512" in out.stdout
    assert re.search(r"\| goals of retrieval/retrieval-heads +\| 4096 tok +\|", out.stdout), out.stdout
    assert {p.name for p in tmp_path.iterdir()} == {"quality.json", "accuracy_vs_size.png", "gold_recall_vs_size.png",
                                                   "accuracy_vs_depth.png"}
    detail = json.loads((tmp_path / "quality.json").read_text())
    assert len(detail["outcomes"]) == 3 and detail["plan"]["grid"][0][0] == 4096 and detail["chars_per_token"] > 2


def test_an_interrupted_run_writes_the_sessions_it_finished(server: LiveServer, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from kvmem.bench import quality

    def stop_after_the_first(line: str) -> None:
        if line.startswith("[1/"):
            raise KeyboardInterrupt  # as Ctrl-C (or SIGTERM, sigterm_as_interrupt) would, mid-run

    parser = argparse.ArgumentParser()
    quality.add_arguments(parser)
    args = parser.parse_args(["--url", server.url, "--quick", "--limit", "2", "--methods", "recent",
                              "--out", str(tmp_path)])
    monkeypatch.setattr(quality, "_log", stop_after_the_first)
    assert quality.run(args) == 130
    detail = json.loads((tmp_path / "quality.json").read_text())
    assert detail["complete"] is False and detail["model"].startswith("SmolLM2") and detail["chars_per_token"] > 2
    assert len(detail["outcomes"]) == 1 and detail["outcomes"][0]["method"] == "recent"
