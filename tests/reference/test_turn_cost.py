"""A turn's host work follows its new tokens, not the workspace: an agent session on the tiny random qwen35 (a
hybrid model: recurrent checkpoints are taken and restored every turn) through ``KVMemEngine``, over the budget,
grows turn by turn; the bytes hashed (checkpoint keys, chain hashes), the stored blocks the prefix match checks and
the block metas the selector's spans convert stay flat while the workspace grows fourfold, and the block index never
copies itself to grow. The engine's caches
behind that (``PrefixKeys``, the registry's last match, ``StoredSpans``, the view's token array) change no result:
an engine whose caches are dropped before every step selects, answers and stores the same."""

from __future__ import annotations

import hashlib
from collections import Counter
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")

import kvmem_core.checkpoints as checkpoints_module  # noqa: E402
import kvmem_core.layout as layout_module  # noqa: E402
import kvmem_core.retrieval.selector as selector_module  # noqa: E402
from kvmem_core.checkpoints import PrefixKeys  # noqa: E402
from kvmem_core.config import KVMemConfig  # noqa: E402
from kvmem_core.contract import SamplingParams, StepRequest, StepResult  # noqa: E402
from kvmem_core.engine import KVMemEngine  # noqa: E402
from kvmem_core.retrieval import BlockIndex  # noqa: E402
from kvmem_core.workspace import WorkspaceRegistry  # noqa: E402
from torch_tiny import random_qwen35_adapter  # noqa: E402

B = 16
CFG = KVMemConfig(
    ctx=8192, budget=256, gen_budget=64, block_tokens=B, sink_tokens=16, recent_tokens=64, cpu_gb=0.05, relevance=0.0
)
TURN = 256  # new tokens a turn
ANSWER = 4


class CountingHash:
    """A hashlib object that adds the bytes it is fed to ``counts["hashed"]``."""

    def __init__(self, h: Any, counts: Counter[str]) -> None:
        self._h, self._counts = h, counts

    def update(self, data: bytes) -> None:
        self._counts["hashed"] += len(data)
        self._h.update(data)

    def copy(self) -> CountingHash:
        return CountingHash(self._h.copy(), self._counts)

    def digest(self) -> bytes:
        return self._h.digest()

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def counted(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Count bytes hashed, stored blocks checked by the prefix match, and block metas converted to spans."""
    counts: Counter[str] = Counter()

    def blake2b(data: bytes = b"", **kwargs: Any) -> CountingHash:
        counts["hashed"] += len(data)
        return CountingHash(hashlib.blake2b(data, **kwargs), counts)

    fake = SimpleNamespace(blake2b=blake2b)
    monkeypatch.setattr(checkpoints_module, "hashlib", fake)
    monkeypatch.setattr(layout_module, "hashlib", fake)
    verified, group_of, grow = WorkspaceRegistry._verified, selector_module._group_of, BlockIndex._grow

    def counted_verified(self: WorkspaceRegistry, *args: Any) -> bool:
        counts["verified"] += 1
        return verified(self, *args)

    def counted_group_of(*args: Any) -> int:
        counts["spans"] += 1
        return group_of(*args)

    def counted_grow(self: BlockIndex, capacity: int) -> None:
        counts["index_copies"] += bool(self._arrays)  # stacked summaries copied into larger arrays
        grow(self, capacity)

    monkeypatch.setattr(WorkspaceRegistry, "_verified", counted_verified)
    monkeypatch.setattr(selector_module, "_group_of", counted_group_of)
    monkeypatch.setattr(BlockIndex, "_grow", counted_grow)
    return counts


def make_engine() -> KVMemEngine:
    adapter = random_qwen35_adapter("cpu", view_tokens=CFG.view_tokens, block_tokens=B)
    return KVMemEngine(adapter, CFG, heads=((0, 0),))


def step(engine: KVMemEngine, ids: list[int]) -> StepResult:
    request = StepRequest(prompt=" ".join(map(str, ids)), sampling=SamplingParams(temperature=0.0, max_tokens=ANSWER))
    return engine.step(request, lambda _: True)


def session(engine: KVMemEngine, turns: int, before_step: Any = None) -> list[StepResult]:
    """Each turn sends the transcript so far (the earlier answers included) and ``TURN`` new tokens."""
    rng, ids, results = np.random.default_rng(3), [], []
    for _ in range(turns):
        ids += rng.integers(0, 200, TURN).tolist()
        if before_step is not None:
            before_step()
        results.append(step(engine, ids))
        ids += list(results[-1].token_ids)
    return results


def test_a_turns_hashing_and_block_work_do_not_grow_with_the_workspace(monkeypatch: pytest.MonkeyPatch):
    engine = make_engine()
    counts = counted(monkeypatch)
    per_turn: list[Counter[str]] = []
    try:
        for _ in session(engine, 16, lambda: per_turn.append(Counter(counts))):
            pass
    finally:
        engine.close()
    per_turn.append(Counter(counts))
    spent = [b - a for a, b in zip(per_turn, per_turn[1:])]
    early, late = spent[3], spent[-1]  # the workspace grew from ~1K to ~4K tokens between them
    assert late["hashed"] <= 1.25 * early["hashed"] + 1024, (early, late)
    assert late["verified"] <= early["verified"] + 2, (early, late)
    assert late["spans"] <= early["spans"] + 2, (early, late)
    assert late["hashed"] < 4 * 8 * (TURN + ANSWER), "the checkpoint keys hash the new tokens about once each"
    assert counts["index_copies"] == 0, "the index is made for a whole --ctx workspace: it never copies itself"


def test_the_engine_caches_change_no_selection_answer_or_stored_block():
    def forget(engine: KVMemEngine) -> None:
        engine.store.workspaces._last = None
        engine._stored_spans.clear()
        engine.checkpoints.keys = PrefixKeys()
        engine.view._array = None

    cached, fresh = make_engine(), make_engine()
    try:
        a = session(cached, 8)
        b = session(fresh, 8, lambda: forget(fresh))
        assert [(r.token_ids, r.selection, r.cached_tokens) for r in a] == [
            (r.token_ids, r.selection, r.cached_tokens) for r in b
        ]
        assert a[-1].selection["method"] == "retrieval" and a[-1].selection["replayed_tokens"] > 0
        assert cached.store.workspaces[a[-1].workspace_id].hashes == fresh.store.workspaces[b[-1].workspace_id].hashes
    finally:
        cached.close()
        fresh.close()
