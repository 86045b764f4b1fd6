"""On the default model (Qwen2.5-Coder-0.5B), a view of 1/8 of an agent session answers like the whole
workspace: its shipped retrieval heads select the evidence among same-form look-alikes, and an update later
in the workspace beats the stale value (the selection keeps chronology). ``recent`` misses both."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Iterator

import pytest

from kvmem_bench.sessions import Session, make_session
from kvmem_core.config import KVMemConfig
from kvmem_core.contract import SamplingParams, StepRequest
from kvmem_core.engine import KVMemEngine

pytestmark = pytest.mark.llamacpp
CFG = KVMemConfig(ctx=8192, budget=6144, gen_budget=256, sink_tokens=64, recent_tokens=64)
VIEW = {"budget": 512, "sink_tokens": 64, "recent_tokens": 64}  # 1/8 of the session's 4.1K tokens


@pytest.fixture(scope="module")
def engine() -> Iterator[KVMemEngine]:
    pytest.importorskip("llama_cpp")
    from kvmem.models import resolve_model
    from kvmem.profiles import find_profile
    from kvmem_core.errors import ModelNotFoundError
    from kvmem_llamacpp import create_adapter

    try:
        path = resolve_model("qwen2.5-coder-0.5b")
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))
    adapter = create_adapter(str(path), CFG, n_threads=1)
    profile = find_profile(adapter)
    assert profile is not None and profile.block_tokens == CFG.block_tokens, "the default model ships its profile"
    e = KVMemEngine(adapter, CFG, heads=profile.heads)
    yield e
    e.close()


@pytest.fixture(scope="module")
def update_session() -> Session:
    return make_session("update", "update", 4096, 0.15, random.Random(1))


def ask(engine: KVMemEngine, session: Session, **kvmem: object) -> tuple[str, dict]:
    request = StepRequest(
        messages=session.messages, sampling=SamplingParams(temperature=0.0, max_tokens=12), overrides={**VIEW, **kvmem}
    )
    result = engine.step(request, lambda piece: True)
    return result.text, result.selection


def evidence_blocks(engine: KVMemEngine, session: Session) -> set[int]:
    """Blocks holding the answer's evidence lines, located in the rendered transcript."""
    text = engine.adapter.render_chat(list(session.messages), add_generation_prompt=True)
    out: set[int] = set()
    for index in session.fact.evidence:
        line = session.fact.statements[index]
        start = text.index(line)
        t0, t1 = (len(engine.adapter.tokenize(text[:c])) for c in (start, start + len(line)))
        out.update(range(t0 // CFG.block_tokens, (t1 - 1) // CFG.block_tokens + 1))
    return out


@pytest.mark.slow  # ~2-4 minutes of CPU prefill on 2 vCPUs
@pytest.mark.timeout(900)
def test_an_update_later_in_the_workspace_beats_the_stale_value(engine: KVMemEngine, update_session: Session) -> None:
    old = update_session.fact.statements[0].split()[-1]
    answer, selection = ask(engine, update_session)
    assert selection["history_tokens"] + selection["tail_tokens"] <= VIEW["budget"]
    assert evidence_blocks(engine, update_session) <= set(selection["blocks"])
    assert list(selection["blocks"]) == sorted(selection["blocks"])
    stale = evidence_blocks(engine, replace(update_session, fact=replace(update_session.fact, evidence=(0,))))
    assert stale <= set(selection["blocks"])  # both values in view: chronology, not selection, decides
    full, _ = ask(engine, update_session, method="full", budget=CFG.budget)
    assert update_session.fact.answer in full and answer == full and old not in answer


@pytest.mark.slow  # 30-100 s on a 2-vCPU machine: ./kvmem test --slow runs it
def test_recent_misses_what_retrieval_finds(engine: KVMemEngine, update_session: Session) -> None:
    answer, selection = ask(engine, update_session, method="recent")
    assert not evidence_blocks(engine, update_session) <= set(selection["blocks"])
    assert update_session.fact.answer not in answer
