"""A tiny random qwen35 (Gated DeltaNet + gated attention) through KVMemEngine.

Inside the budget every step equals HF transformers on the whole transcript (≤ 1e-4,
fp32): one shot, a next turn that reuses the stored prefix (from the live state or a
checkpoint), a fork that restarts from the nearest earlier checkpoint, and a restart over
the NVMe tier (blocks and recurrent checkpoints are read back from disk; a checkpoint file
that fails to load is recomputed). Over the budget,
``--kvmem-recurrent keep`` restores the checkpoint taken at the replay start and
``recompute`` rebuilds the state over exactly the selected view.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from unittest.mock import patch

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from kvmem_core.config import KVMemConfig  # noqa: E402
from kvmem_core.contract import SamplingParams, StepRequest, StepResult  # noqa: E402
from kvmem_core.engine import KVMemEngine  # noqa: E402
from kvmem_core.retrieval import BlockIndex  # noqa: E402
from kvmem_core.step import view_sequence  # noqa: E402
from kvmem_torch.adapter import TorchAdapter  # noqa: E402
from gguf_writer import write_gguf  # noqa: E402
from kvmem_torch.runner import Runner  # noqa: E402
from torch_tiny import tiny_hf_config, tiny_hf_model  # noqa: E402

B = 16
FITS = KVMemConfig(
    ctx=2048,
    budget=256,
    gen_budget=64,
    block_tokens=B,
    sink_tokens=16,
    recent_tokens=32,
    method="sink-recent",
    cpu_gb=0.01,
    positions="original",  # the references below keep each token at its position
)
OVER = FITS.replace(budget=64, gen_budget=96)  # 150-token prompts exceed the budget but fit the view
STEPS = 5


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Path]:
    torch.set_num_threads(1)
    hf = tiny_hf_model("qwen35", seed=7)
    path = tmp_path_factory.mktemp("hybrid") / "qwen35.gguf"
    write_gguf(path, tiny_hf_config("qwen35"), hf.state_dict())
    return hf, path


def make_engine(path: Path, cfg: KVMemConfig, adapter: TorchAdapter | None = None) -> KVMemEngine:
    adapter = adapter or TorchAdapter(path, view_tokens=cfg.view_tokens, block_tokens=B, device="cpu", progress=False)
    return KVMemEngine(adapter, cfg, heads=((0, 0),))


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 160, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def step(engine: KVMemEngine, ids: list[int], **overrides: object) -> StepResult:
    request = StepRequest(
        prompt=" ".join(map(str, ids)), sampling=SamplingParams(temperature=0.0, max_tokens=STEPS), overrides=overrides
    )
    return engine.step(request, lambda _: True)


def hf_greedy(hf: object, ids: list[int], positions: list[int] | None = None) -> tuple[np.ndarray, list[int]]:
    """Logits of the last prompt token and the greedy continuation, full recompute each token."""
    seq, pos, out, first = list(ids), list(positions or range(len(ids))), [], None
    with torch.no_grad():
        for _ in range(STEPS):
            logits = hf(torch.tensor([seq]), position_ids=torch.tensor([pos])).logits[0, -1].numpy()
            first = logits if first is None else first
            out.append(int(logits.argmax()))
            seq, pos = seq + out[-1:], pos + [pos[-1] + 1]
    return first, out


def assert_matches_hf(hf: object, engine: KVMemEngine, result: StepResult, ids: list[int]) -> None:
    first, out = hf_greedy(hf, ids)
    assert np.abs(engine.last_logits - first).max() <= 1e-4
    assert list(result.token_ids) == out


def test_turns_and_fork_equal_hf(model) -> None:
    hf, path = model
    engine = make_engine(path, FITS)
    turn1 = tokens(40, seed=1)
    r1 = step(engine, turn1)
    assert r1.cached_tokens == 0 and r1.selection["method"] == "full"
    assert_matches_hf(hf, engine, r1, turn1)
    # the next turn continues the live state: only the new tokens (and the last answer token) are prefilled
    turn2 = turn1 + list(r1.token_ids) + tokens(20, seed=2)
    r2 = step(engine, turn2)
    assert r2.cached_tokens == len(turn1) + STEPS - 1 and r2.timings["prefill_tokens"] == 21
    assert_matches_hf(hf, engine, r2, turn2)
    # a fork diverging after turn 1's answer: back to turn 1's end-of-step checkpoint, then forward
    fork = turn1 + list(r1.token_ids) + tokens(12, seed=3)
    r3 = step(engine, fork)
    assert r3.cached_tokens == len(turn1) + STEPS - 1 and r3.workspace_id != r2.workspace_id
    assert_matches_hf(hf, engine, r3, fork)
    # back to the first branch after another conversation held the view: its stored blocks load from the
    # tiers and its last block-boundary checkpoint restores the state there
    other = step(engine, tokens(30, seed=4))
    turn3 = turn2 + list(r2.token_ids) + tokens(9, seed=5)
    r4 = step(engine, turn3)
    assert other.workspace_id not in (r2.workspace_id, r4.workspace_id)
    assert r4.cached_tokens == len(turn2) // B * B and engine.metrics()["blocks_loaded"] > 0
    assert_matches_hf(hf, engine, r4, turn3)


def test_a_scoring_step_finds_its_new_blocks_indexed_as_they_were_archived(model) -> None:
    """Turn after turn over the budget with retrieval: the blocks stored since the last scoring step were indexed
    while they were archived (``BlockIndex.follow``), so the step's index sync appends none; the index equals one
    built from the workspace's blocks."""
    _, path = model
    engine = make_engine(path, OVER.replace(method="retrieval", recurrent="keep"))
    appended, sync = [], BlockIndex.sync

    def recording(index: BlockIndex, metas: list) -> None:
        appended.append(len(metas) - index.n_blocks)
        sync(index, metas)

    ids = tokens(150, seed=11)
    with patch.object(BlockIndex, "sync", recording):
        for turn in range(3):
            result = step(engine, ids)
            assert result.selection["method"] == "retrieval"
            ids = ids + list(result.token_ids) + tokens(60, seed=12 + turn)
    assert appended[0] >= 150 // B - 1 and appended[1:] == [0, 0]
    index = engine._indexes[result.workspace_id]
    fresh = BlockIndex.build(engine.store.workspace_blocks(result.workspace_id), B)
    assert index.hashes == fresh.hashes and index.n_blocks > appended[0]
    for name in ("head_keys", "head_scale", "mean_k"):
        np.testing.assert_array_equal(index.get(name), fresh.get(name))


def compact_session(path: Path, moves: bool) -> tuple[list, int]:
    """Each turn's (last logits, answer, selection) of a compact-mode retrieval session, with the adapter moving
    resident cells or (``moves`` False) dropping and reloading them; and the blocks it moved."""
    engine = make_engine(path, OVER.replace(method="retrieval", positions="compact"))
    engine.adapter.caps = dataclasses.replace(engine.adapter.caps, moves_cells=moves)
    assert engine.metrics()["blocks_moved"] == 0  # listed before the first step
    ids, out = tokens(150, seed=21), []
    for turn in range(4):
        result = step(engine, ids)
        out.append((engine.last_logits.copy(), list(result.token_ids), result.selection))
        ids = ids + list(result.token_ids) + tokens(50, seed=22 + turn)
    moved = engine.metrics()["blocks_moved"]
    engine.close()
    return out, moved


def test_resident_blocks_moved_in_place_answer_as_blocks_reloaded(model) -> None:
    _, path = model
    (moved_run, moved), (reloaded_run, none) = (compact_session(path, m) for m in (True, False))
    assert moved > 0 and none == 0
    for (logits, answer, sel), (want_logits, want_answer, want_sel) in zip(moved_run, reloaded_run):
        assert sel == want_sel and answer == want_answer
        np.testing.assert_array_equal(logits, want_logits)


def test_an_adapter_asking_for_longer_forwards_prefills_in_them(model) -> None:
    """A GPU adapter asks for 4096-token forwards: the engine prefills in up to a quarter of the view (whole
    blocks), 576 tokens of a 2,304-token view here, and the step still equals HF."""
    hf, path = model
    cfg = FITS.replace(budget=2048, gen_budget=256)
    adapter = TorchAdapter(
        path, view_tokens=cfg.view_tokens, block_tokens=B, device="cpu", progress=False, prefill_chunk=4096
    )
    engine, sizes, forward = make_engine(path, cfg, adapter), [], adapter.forward
    adapter.forward = lambda ids, positions, **kw: sizes.append(len(ids)) or forward(ids, positions, **kw)
    ids = tokens(1500, seed=8)
    result = step(engine, ids)
    assert max(sizes) == 576 and sum(sizes) >= len(ids)
    assert_matches_hf(hf, engine, result, ids)


def turn_then_restart(model, tmp_path: Path, seed: int) -> tuple[KVMemEngine, list[int]]:
    """One 50-token turn on an engine with an NVMe tier, then a fresh engine over the same directory and
    weights (a restart). -> (the new engine, the second turn's prompt)."""
    _, path = model
    cfg = FITS.replace(nvme_dir=tmp_path / "nvme")
    engine = make_engine(path, cfg)
    turn1 = tokens(50, seed=seed)
    r1 = step(engine, turn1)
    engine.checkpoints.close()
    engine.store.close()
    engine = make_engine(path, cfg, engine.adapter)
    assert engine.store.metrics()["nvme_blocks"] == (len(turn1) + STEPS - 1) // B
    return engine, turn1 + list(r1.token_ids) + tokens(10, seed=seed + 1)


def test_restart_resumes_from_the_checkpoints_on_disk(model, tmp_path: Path) -> None:
    engine, turn2 = turn_then_restart(model, tmp_path, seed=6)
    assert len(engine.checkpoints.files.index) >= 2
    r2 = step(engine, turn2)
    assert r2.cached_tokens >= 48  # resumed at a stored block edge, not prefilled from the start
    assert_matches_hf(model[0], engine, r2, turn2)
    engine.close()


def test_a_damaged_checkpoint_file_is_recomputed(model, tmp_path: Path) -> None:
    engine, turn2 = turn_then_restart(model, tmp_path, seed=8)
    for f in engine.checkpoints.files.dir.glob("*.npz"):
        f.write_bytes(f.read_bytes()[:-40])  # truncated: the zip directory is gone
    r2 = step(engine, turn2)  # the step starts over past each damaged checkpoint
    assert r2.cached_tokens == 0  # every checkpoint was dropped: recomputed from the start
    assert_matches_hf(model[0], engine, r2, turn2)
    engine.close()


def bare_keep(adapter: TorchAdapter, ids: list[int], view: list[int], r0: int) -> tuple[np.ndarray, np.ndarray]:
    """Our engine without KVMem: dense prefill to ``r0`` (its state), drop the history outside ``view``
    positions, replay ``ids[r0:]``. Returns (logits with the r0 state, logits with the full prompt's state)."""
    out = []
    for restore in (True, False):
        runner = Runner(adapter.model, 24, B, cuda_graphs=False)
        _, snaps = runner.prefill(ids, list(range(len(ids))), chunk=512, snapshot_at=[r0])
        runner.drop(r0, 1 << 30)
        for a, b in _gaps(view, r0):
            runner.drop(a, b)
        if restore:
            runner.state.restore(snaps[r0])
        logits, _ = runner.forward(ids[r0:], list(range(r0, len(ids))))
        out.append(logits[-1].numpy())
    return out[0], out[1]


def _gaps(view: list[int], end: int) -> list[tuple[int, int]]:
    kept = set(view)
    return [(p, p + 1) for p in range(end) if p not in kept]


@pytest.mark.parametrize("mode", ("keep", "recompute"))
def test_over_budget_recurrent_modes(model, mode: str) -> None:
    hf, path = model
    engine = make_engine(path, OVER)
    ids = tokens(150, seed=8)
    result = step(engine, ids, recurrent=mode)
    sel = result.selection
    assert sel["recurrent"] == mode and sel["blocks"] == [0, 7, 8] and engine.view.tokens[:150] == ids
    r0 = 150 - OVER.recent_tokens
    if mode == "keep":
        assert sel["replayed_tokens"] == 150 - r0
        view = [p for b in sel["blocks"] for p in range(b * B, (b + 1) * B)]
        assert view_sequence(engine.view)[1][: len(view)] == view
        expected, double_counted = bare_keep(engine.adapter, ids, view, r0)
        assert np.abs(engine.last_logits - expected).max() <= 1e-4
        assert np.abs(engine.last_logits - double_counted).max() > 1e-2  # replay over the end state is wrong
    else:
        # the view (sink block, recent blocks, tail) is a shorter transcript at its original positions: HF on it
        view_ids, positions = view_sequence(engine.view)
        view_ids, positions = view_ids[: -(STEPS - 1)], positions[: -(STEPS - 1)]  # before the answer
        assert sel["replayed_tokens"] == len(view_ids) and positions[:B] == list(range(B))
        want = [*range(0, B), *range(7 * B, 150)]  # blocks 0, 7, 8 and the tail, derived from the selection
        assert positions == want and view_ids == [ids[p] for p in want]
        first, out = hf_greedy(hf, view_ids, positions)
        assert np.abs(engine.last_logits - first).max() <= 1e-4 and list(result.token_ids) == out
        full, _ = hf_greedy(hf, ids)
        assert np.abs(engine.last_logits - full).max() > 1e-2
