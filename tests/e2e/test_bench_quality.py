"""``kvmem bench quality`` against a live ``kvmem serve`` on the embedded model: two sessions, two methods."""
from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvmem.bench.api import Api
from kvmem.bench.quality import Method, Plan, gold_blocks, run_all
from kvmem.bench.sessions import make_sessions
from kvmem.tools_format import render_plain
from serving import ROOT, LiveServer

pytestmark = [pytest.mark.llamacpp, pytest.mark.slow]
CONTRACT = {"method", "scorer", "workspace_tokens", "budget", "depth", "n", "accuracy", "gold_block_recall"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = LiveServer(tmp_path_factory.mktemp("serve"), "--no-ui", "--ctx", "4096", "--kvmem-budget", "2048").start()
    yield live
    live.stop()


def test_two_methods_share_one_workspace_and_leave_nothing_behind(server: LiveServer) -> None:
    api = Api(server.url)
    sessions = make_sessions([1000], [0.2], ["passkey", "kv"], seed=1)
    plan = Plan(grid=(), kinds=())
    outs = run_all(api, sessions, plan, (Method("retrieval", "retrieval-heads"), Method("recent")), full_budget=0)
    assert [(o.session, o.method) for o in outs] == [(s.id, m) for s in sessions for m in ("retrieval", "recent")]
    for o in outs:
        assert o.error is None and 800 <= o.prompt_tokens <= 1250
        n_blocks = o.prompt_tokens // 128
        assert o.gold_blocks and max(o.gold_blocks) < n_blocks
        assert o.selected_blocks is not None and len(o.selected_blocks) * 128 <= plan.budget
        assert o.gold_selected == set(o.gold_blocks).issubset(o.selected_blocks)
        assert o.correct == (o.expected in o.answer.replace(".", " ").split())
    recent = outs[1].selected_blocks
    assert recent[-1] == outs[1].prompt_tokens // 128 - 1 and list(recent[1:]) == list(range(recent[1], recent[-1] + 1))
    assert api.call("GET", "/v1/kvmem/workspaces")["data"] == []


def test_gold_blocks_match_the_exactly_tokenized_prompt(server: LiveServer) -> None:
    api = Api(server.url)
    session = make_sessions([1500], [0.6], ["chain"], seed=2)[0]
    turns = render_plain(list(session.messages[:-1]) + [{"role": "user", "content": "Continue."}], None)
    text = "".join(f"<|im_start|>{t['role']}\n{t['content']}<|im_end|>\n" for t in turns) + "<|im_start|>assistant\n"
    exact = set()
    for line in session.fact.statements:
        start = api.count_tokens(text[:text.index(line)])
        end = api.count_tokens(text[:text.index(line) + len(line)])
        exact.update(range(start // 128, (end - 1) // 128 + 1))
    assert gold_blocks(api, session, api.count_tokens(text), 128) == tuple(sorted(exact))


def test_the_command_prints_the_contract_as_its_last_line(server: LiveServer, tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "kvmem", "bench", "quality", "--url", server.url, "--quick", "--json",
                          "--limit", "1", "--methods", "retrieval/retrieval-heads,recent", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["model"].startswith("SmolLM2")
    assert [(r["method"], r["scorer"], r["n"]) for r in result["results"]] == [("recent", None, 1),
                                                                              ("retrieval", "retrieval-heads", 1)]
    assert all(set(r) >= CONTRACT and r["workspace_tokens"] == 400 and r["depth"] == 0.5 for r in result["results"])
    assert "| retrieval/retrieval-heads |" in out.stdout
    assert {p.name for p in tmp_path.iterdir()} == {"quality.json", "accuracy_vs_ratio.png"}
    assert len(json.loads((tmp_path / "quality.json").read_text())["outcomes"]) == 2
