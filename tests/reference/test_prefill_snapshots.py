"""A hybrid model's checkpoints inside a prefill chunk (``kvmem_core.prefill``): where the adapter hands out the
recurrent state after given tokens of a forward (``caps.snapshots``), the query's start, the replay start and the
last block edge do not cut the suffix into small forwards. The step then prefills a turn's new tokens in one
forward and keeps the same checkpoints, blocks, selection and answer as an adapter that cuts at each (tiny random
qwen35 with SmolLM2's tokenizer, CPU, fp32)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from model_support import small_model

from kvmem_core.config import KVMemConfig
from kvmem_core.contract import SamplingParams, StepRequest, StepResult
from kvmem_core.engine import KVMemEngine
from kvmem_bench.torch_device import random_adapter
from kvmem_torch.runner import Runner

B = 16
CFG = KVMemConfig(ctx=4096, budget=256, gen_budget=64, block_tokens=B, sink_tokens=16, recent_tokens=32, cpu_gb=0.05)
LINES = [f"line {i}: worker-{i % 7} batch {1000 + 37 * i} status ok" for i in range(50)]
TOL = 1e-4  # fp32: the same sums grouped into other forwards (attention of a few rows takes another path)


def make_engine(snapshots: bool) -> KVMemEngine:
    torch.set_num_threads(1)
    adapter = random_adapter("tiny", small_model(), device="cpu", view_tokens=CFG.view_tokens, block_tokens=B)
    adapter.caps = dataclasses.replace(adapter.caps, snapshots=snapshots)
    return KVMemEngine(adapter, CFG, heads=((0, 0),))


def two_turns(engine: KVMemEngine) -> tuple[StepResult, list[int], np.ndarray]:
    """A turn past the budget, then the next one adding ~150 tokens. -> (the second step, its prefill forwards'
    sizes, its first token's logits)"""
    sizes, forward = [], engine.adapter.forward
    engine.adapter.forward = lambda ids, pos, **kw: sizes.append(len(ids)) or forward(ids, pos, **kw)
    sampling = SamplingParams(temperature=0.0, max_tokens=4)
    engine.step(StepRequest(prompt="\n".join(LINES[:40]), sampling=sampling), lambda _: True)
    sizes.clear()
    result = engine.step(StepRequest(prompt="\n".join(LINES), sampling=sampling), lambda _: True)
    prefill = sizes[: sizes.index(1)] if 1 in sizes else sizes
    return result, prefill, engine.last_logits.copy()


def stored(engine: KVMemEngine, result: StepResult) -> tuple[list[str], list[np.ndarray]]:
    hashes = [m.chain_hash for m in engine.store.workspace_blocks(result.workspace_id)]
    blocks = engine.store.complete_load(engine.store.prepare_load(hashes)).blocks
    return hashes, [np.concatenate([blocks[h].k.ravel(), blocks[h].v.ravel()]) for h in hashes]


def checkpoints(engine: KVMemEngine) -> dict[int, dict[str, np.ndarray]]:
    return {c.n_tokens: engine.adapter.state_arrays(c.state) for c in engine.checkpoints._items.values()}


@pytest.fixture(scope="module")
def runs() -> dict[bool, tuple]:
    out = {}
    for snapshots in (True, False):
        engine = make_engine(snapshots)
        try:
            result, sizes, logits = two_turns(engine)
            out[snapshots] = (result, sizes, logits, stored(engine, result), checkpoints(engine))
        finally:
            engine.close()
    return out


def test_a_turn_prefills_its_new_tokens_in_one_forward(runs) -> None:
    (result, sizes, *_), (ref, ref_sizes, *_) = runs[True], runs[False]
    new = int(result.timings["prefill_tokens"])
    assert ref.timings["prefill_tokens"] == new
    assert result.selection["method"] == "retrieval" and 0 < new < 288  # one chunk of this view, past the budget
    first_pass = ref_sizes[: next(i for i in range(len(ref_sizes) + 1) if sum(ref_sizes[:i]) >= new)]
    assert len(first_pass) == 4  # cut at the query's start, the replay start and the last block edge
    assert sizes[0] == new and sum(first_pass) == new
    assert len(sizes) == len(ref_sizes) - 3  # the replay after it is the same


def test_checkpoints_blocks_selection_and_answer_are_those_of_cut_forwards(runs) -> None:
    (result, _, logits, (hashes, kvs), states), (ref, _, ref_logits, (ref_hashes, ref_kvs), ref_states) = (
        runs[True],
        runs[False],
    )
    assert result.token_ids == ref.token_ids and result.selection == ref.selection
    assert np.abs(logits - ref_logits).max() <= TOL
    assert hashes == ref_hashes and all(np.abs(a - b).max() <= TOL for a, b in zip(kvs, ref_kvs))
    assert sorted(states) == sorted(ref_states) and len(states) >= 4
    for n, arrays in states.items():
        assert all(np.abs(arrays[k] - ref_states[n][k]).max() <= TOL for k in arrays), n


def test_a_runner_snapshot_is_the_state_a_forward_cut_there_leaves() -> None:
    torch.set_num_threads(1)
    adapter = random_adapter("tiny", small_model(), device="cpu", view_tokens=256, block_tokens=B)
    ids = list(range(100, 190))
    whole, cut = (Runner(adapter.model, 20, B, cuda_graphs=False) for _ in range(2))
    snaps = [(o, adapter.model.new_state()) for o in (17, 64, 89)]
    logits, _ = whole.forward(ids, list(range(90)), snapshots=snaps)
    for a, b in zip((0, 17, 64, 89), (17, 64, 89, 90)):
        ref_logits, _ = cut.forward(ids[a:b], list(range(a, b)))
        if b < 90:
            state = dict(snaps)[b]
            assert torch.allclose(state.conv, cut.state.conv, atol=TOL) and torch.allclose(
                state.rec, cut.state.rec, atol=TOL
            )
    assert torch.allclose(logits, ref_logits, atol=TOL)
    assert torch.allclose(whole.state.rec, cut.state.rec, atol=TOL)
