"""The prefill archives a chunk's blocks while the next chunk computes (``caps.staged_reads``): the torch adapter
takes the blocks' reads after their chunk, the engine stores them after the next forward is issued, and the store
ends up with the same blocks, KV and answers as when each chunk is archived before the next (tiny random qwen35
with SmolLM2's tokenizer, CPU), also when a small view drops staged blocks before they are stored."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from model_support import small_model

from kvmem_core.config import KVMemConfig
from kvmem_core.contract import SamplingParams, StepRequest
from kvmem_core.engine import KVMemEngine
from kvmem_bench.torch_device import random_adapter

B = 16
FITS = KVMemConfig(ctx=4096, budget=2048, gen_budget=64, block_tokens=B, sink_tokens=16, recent_tokens=32, cpu_gb=0.05)
STREAMS = FITS.replace(budget=256, method="sink-recent")  # 320-token view: each chunk drops the one before
PROMPT = " ".join(f"line {i}: worker-{i % 7} batch {1000 + 37 * i} status ok" for i in range(120))


def make_engine(cfg: KVMemConfig, staged: bool) -> KVMemEngine:
    torch.set_num_threads(1)
    adapter = random_adapter("tiny", small_model(), device="cpu", view_tokens=cfg.view_tokens, block_tokens=B)
    if not staged:
        adapter.caps = dataclasses.replace(adapter.caps, staged_reads=False)
    return KVMemEngine(adapter, cfg, heads=((0, 0),))


def run(engine: KVMemEngine) -> tuple[tuple[int, ...], list[str], list[np.ndarray]]:
    request = StepRequest(prompt=PROMPT, sampling=SamplingParams(temperature=0.0, max_tokens=4))
    result = engine.step(request, lambda _: True)
    hashes = [m.chain_hash for m in engine.store.workspace_blocks(result.workspace_id)]
    loaded = engine.store.complete_load(engine.store.prepare_load(hashes)).blocks
    return result.token_ids, hashes, [np.concatenate([loaded[h].k.ravel(), loaded[h].v.ravel()]) for h in hashes]


def test_a_chunk_is_stored_after_the_next_chunk_is_issued() -> None:
    engine = make_engine(FITS, staged=True)
    events: list[str] = []
    forward, append = engine.adapter.forward, engine.store.append
    engine.adapter.forward = lambda tokens, *a, **k: events.append(f"forward {len(tokens)}") or forward(tokens, *a, **k)
    engine.store.append = lambda ws, meta, kv: events.append("store") or append(ws, meta, kv)
    try:
        run(engine)
    finally:
        engine.close()
    prefill = events[: events.index("forward 1")] if "forward 1" in events else events
    forwards = [i for i, e in enumerate(prefill) if e.startswith("forward")]
    assert len(forwards) >= 3, "the prompt must take several chunks"
    assert "store" not in prefill[: forwards[1]]  # nothing is stored before the second chunk is issued
    assert prefill[forwards[1] + 1] == "store"  # then the first chunk's blocks, while the second computes


@pytest.mark.parametrize("cfg", (FITS, STREAMS), ids=("fits", "streams"))
def test_staged_archiving_stores_what_archiving_in_line_stores(cfg: KVMemConfig) -> None:
    outs = []
    for staged in (True, False):
        engine = make_engine(cfg, staged)
        try:
            outs.append(run(engine))
        finally:
            engine.close()
    (ids, hashes, kvs), (ids_ref, hashes_ref, kvs_ref) = outs
    assert len(hashes) > 20 and hashes == hashes_ref and ids == ids_ref
    assert all(np.array_equal(a, b) for a, b in zip(kvs, kvs_ref))


def test_blocks_digested_on_threads_are_stored_as_in_line() -> None:
    """On a device engine (``caps.async_copies``) the host checksums and summarizes a chunk's blocks on threads:
    the store gets the same metas (checksums, summaries), in the same order, as one block after another."""
    metas = []
    for threads in (True, False):
        engine = make_engine(FITS, staged=True)
        engine.adapter.caps = dataclasses.replace(engine.adapter.caps, async_copies=threads)
        try:
            result = engine.step(StepRequest(prompt=PROMPT, sampling=SamplingParams(max_tokens=1)), lambda _: True)
            assert (engine._archive_pool is not None) == threads
            metas.append(engine.store.workspace_blocks(result.workspace_id))
        finally:
            engine.close()
    assert len(metas[0]) > 20 and [m.chain_hash for m in metas[0]] == [m.chain_hash for m in metas[1]]
    for a, b in zip(*metas):
        assert a.checksum == b.checksum and a.summary.keys() == b.summary.keys()
        assert all(np.array_equal(a.summary[k], b.summary[k]) for k in a.summary)
