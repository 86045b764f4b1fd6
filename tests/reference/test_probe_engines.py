"""The query window's probe (``kvmem_core.archive``) on a real model: llama.cpp's probe forward against a full
forward (same queries, same K and V up to the probe's layer, the same logits once recomputed); and one agent
session through two engines on the same model, one probing and one not, turn by turn: the same block scores,
the same blocks selected, the same stored retrieval keys, the same first token. The scorer's float64 reference
is in tests/unit/test_probe.py."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from model_support import small_model

from kvmem_core.config import KVMemConfig
from kvmem_core.contract import SamplingParams, StepRequest
from kvmem_core.retrieval import BlockIndex, QueryFeatures


@pytest.mark.llamacpp
def test_a_llamacpp_probe_captures_the_full_forwards_queries_and_keys_up_to_its_layer():
    pytest.importorskip("llama_cpp")
    from kvmem_llamacpp.adapter import LlamaCppAdapter

    a = LlamaCppAdapter(str(small_model()), view_tokens=512, n_threads=1, n_threads_batch=1)
    try:
        ids = a.tokenize("The survey team logged soil samples and wind speed at each camp. " * 16)[:260]
        stop = 5

        def run(**probe):
            a.clear_view()
            a.forward(ids[:100], list(range(100)), want_logits=False)
            out = a.forward(ids[100:], list(range(100, len(ids))), capture_from=60, **probe)
            logits = None if out.logits is None else out.logits.copy()
            return out.queries, logits, a.read_block(128, 64)

        q_full, logits_full, kv_full = run()
        q_probe, logits_probe, kv_probe = run(stop_after=stop)
        assert logits_probe is None and q_probe.shape == q_full.shape
        assert np.array_equal(q_probe[: stop + 1], q_full[: stop + 1]) and not q_probe[stop + 1 :].any()
        assert np.array_equal(kv_probe.k[: stop + 1], kv_full.k[: stop + 1])
        assert np.array_equal(kv_probe.v[: stop + 1], kv_full.v[: stop + 1])
        assert not np.array_equal(kv_probe.k[stop + 1 :], kv_full.k[stop + 1 :]), "the probe stopped early"
        a.drop(100, -1)
        out = a.forward(ids[100:], list(range(100, len(ids))))
        assert np.array_equal(out.logits, logits_full)
    finally:
        a.close()


def tool_turn(i: int) -> str:
    lines = "\n".join(
        f"{i:02d}.{j:02d} worker-{(7 * i + j) % 13} batch {1000 + 37 * i + j} status="
        f"{'FAIL' if (i + j) % 5 == 0 else 'ok'}"
        for j in range(9)
    )
    return f"Tool result of run {i}:\n{lines}\nWhich batches failed so far?"


@dataclasses.dataclass
class RecordingScorer:
    """The engine's own scorer, keeping every ``BlockScores`` it returns."""

    scorer: Any
    kept: list

    def score(self, features: QueryFeatures, index: BlockIndex) -> Any:
        self.kept.append(self.scorer.score(features, index))
        return self.kept[-1]


def run_session(
    probe: bool, turns: int, positions: str
) -> tuple[list[tuple[list[int], int, dict, list[np.ndarray]]], list]:
    """Each turn's (selected blocks, first token, selection, stored head keys) from an engine that probes or not,
    and every block score it computed."""
    from kvmem.engines import load_engine

    config = KVMemConfig(
        ctx=4096, budget=512, gen_budget=128, recent_tokens=128, sink_tokens=64, cpu_gb=1.0, positions=positions
    )
    engine = load_engine("llama.cpp", str(small_model()), config, n_threads=1, n_threads_batch=1)
    if not probe:
        engine.adapter.caps = dataclasses.replace(engine.adapter.caps, probe=False)
    scores, make_scorer = [], engine._scorer

    engine._scorer = lambda name, heads: RecordingScorer(make_scorer(name, heads), scores)
    messages, out = [{"role": "system", "content": "Track the failed batches."}], []
    try:
        for i in range(turns):
            messages.append({"role": "user", "content": tool_turn(i)})
            r = engine.step(
                StepRequest(messages=tuple(messages), sampling=SamplingParams(temperature=0.0, max_tokens=1)),
                lambda piece: True,
            )
            keys = [m.summary["head_keys"] for m in engine.store.workspace_blocks(r.workspace_id)]
            out.append((list(r.selection.get("blocks", ())), r.token_ids[0], r.selection, keys))
            messages.append({"role": "assistant", "content": f"Noted run {i}."})
    finally:
        engine.close()
    return out, [s.scores.copy() for s in scores]


@pytest.mark.llamacpp
@pytest.mark.slow
@pytest.mark.parametrize("positions", ["original", "compact"])
def test_an_engine_that_probes_selects_stores_and_answers_as_one_that_replays(positions):
    """In compact mode the selected view moves the held blocks: they load from the probe, not the store."""
    pytest.importorskip("llama_cpp")
    turns = 7
    (probed, probed_scores), (replayed, replayed_scores) = (run_session(p, turns, positions) for p in (True, False))
    assert all(sel["position_mode"] == positions for _, _, sel, _ in probed)
    assert any(sel.get("probed_tokens") for _, _, sel, _ in probed), "the session never probed"
    assert not any(sel.get("probed_tokens") for _, _, sel, _ in replayed)
    assert sum(len(blocks) > 0 for blocks, _, _, _ in probed) >= 3, "too few turns selected to compare"
    assert len(probed_scores) == len(replayed_scores) >= 3
    for turn, (a, b) in enumerate(zip(probed_scores, replayed_scores)):  # the same query scored the same blocks
        assert np.array_equal(a, b), f"scoring {turn}: block scores differ with the probe"
    for turn, (a, b) in enumerate(zip(probed, replayed)):
        assert a[0] == b[0], f"turn {turn}: selected {a[0]} with the probe, {b[0]} without"
        assert a[1] == b[1], f"turn {turn}: first token {a[1]} with the probe, {b[1]} without"
        assert len(a[3]) == len(b[3])
        for i, (ka, kb) in enumerate(zip(a[3], b[3])):
            assert np.array_equal(ka, kb), f"turn {turn}: stored block {i}'s retrieval keys differ"


@pytest.mark.llamacpp
def test_a_compact_probe_stores_held_blocks_at_the_positions_they_were_probed_at():
    """Compaction moves the held blocks before the full forward; each is stored as computed where it was probed:
    moved to where the view now holds it, its deeper layers are the view's (a block stored at the wrong positions
    would differ by a rotation)."""
    pytest.importorskip("llama_cpp")
    from kvmem.engines import load_engine

    config = KVMemConfig(
        ctx=4096, budget=512, gen_budget=128, recent_tokens=128, sink_tokens=64, cpu_gb=1.0, positions="compact"
    )
    engine = load_engine("llama.cpp", str(small_model()), config, n_threads=1, n_threads_batch=1)
    held, store_held = [], engine._store_held

    def recording(ws, probe, blocks):
        store_held(ws, probe, blocks)
        held.extend((meta, probe.stop_after) for meta, _ in blocks.values())

    engine._store_held = recording
    messages, checked = [{"role": "system", "content": "Track the failed batches."}], 0
    try:
        for i in range(3):
            messages.append({"role": "user", "content": tool_turn(i)})
            engine.step(
                StepRequest(messages=tuple(messages), sampling=SamplingParams(temperature=0.0, max_tokens=1)),
                lambda piece: True,
            )
            messages.append({"role": "assistant", "content": f"Noted run {i}."})
            hashes = engine.store.workspaces[engine._view_ws].hashes
            for meta, stop in held:
                b = hashes.index(meta.chain_hash)
                pos = engine.view.blocks.get(b, meta.start_pos)
                if pos == meta.start_pos:
                    continue
                here = engine.adapter.read_block(pos, engine.layout.block_tokens)
                moved = engine.adapter.moved(engine.stored_kv(meta.chain_hash), meta.start_pos, pos)
                deep_k, want = moved.k[stop + 1 :].astype(np.float32), here.k[stop + 1 :].astype(np.float32)
                assert np.linalg.norm(deep_k - want) < 0.01 * np.linalg.norm(want), f"block {b} stored elsewhere"
                assert np.array_equal(moved.v[stop + 1 :], here.v[stop + 1 :])
                checked += 1
            held.clear()
    finally:
        engine.close()
    assert checked, "no held block moved"
