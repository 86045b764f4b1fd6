"""One retrieval-heads block score for calibration, the selector's scorer and the torch scorer.

Calibration scores every head on dense float keys; the selector's scorer reads the index's int8
keys; the torch scorer mirrors those keys on a device. Fed the same keys (the calibration
document carries the index's dequantized keys), the three rank the blocks alike and score them
within float32 tolerance, and their scores equal the ones recorded in ``data/heads_score.npz``
(from the three separate implementations that preceded the shared one).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from kvmem_core.layout import BlockMeta
from kvmem_core.retrieval import (
    BlockIndex,
    CalibrationDoc,
    QueryFeatures,
    SummaryOptions,
    block_scores,
    make_scorer,
    summarize_block,
)
from kvmem_core.retrieval.heads_score import CHUNK_TOKENS, HeadKeys, head_block_mass, head_rows
from kvmem_torch.scoring import TorchRetrievalHeads

RECORDED = Path(__file__).parent / "data" / "heads_score.npz"


@dataclass(frozen=True)
class Case:
    seed: int
    layers: int
    heads: int  # query heads
    kv: int
    dim: int
    block: int
    query_tokens: int
    blocks: int
    picked: tuple[tuple[int, int], ...]  # (layer, query head)

    @property
    def name(self) -> str:
        return f"seed{self.seed}"


CASES = (
    Case(0, 2, 4, 2, 32, 16, 9, 40, ((0, 1), (1, 2), (1, 3))),
    Case(1, 3, 6, 2, 16, 8, 1, 140, ((2, 0), (0, 5))),
    Case(2, 1, 2, 2, 64, 32, 4, 7, ((0, 0), (0, 1))),  # one query head per kv head
    Case(3, 2, 8, 1, 8, 4, 6, 300, ((1, 7), (1, 2), (0, 4), (0, 0))),  # many chunks at a small chunk size
)


def index_and_query(case: Case) -> tuple[BlockIndex, QueryFeatures]:
    rng = np.random.default_rng(case.seed)
    opts = SummaryOptions(group_size=case.heads // case.kv, prototypes=False)
    metas = []
    for i in range(case.blocks):
        k = rng.standard_normal((case.layers, case.block, case.kv, case.dim)).astype(np.float32) * 2
        summary = summarize_block(k, case.picked, opts)
        metas.append(
            BlockMeta(f"{case.seed}-{i}", "", np.arange(case.block, dtype=np.int32), i * case.block, 0, summary)
        )
    q = rng.standard_normal((case.layers, case.query_tokens, case.heads, case.dim)).astype(np.float32) * 2
    return BlockIndex.build(metas, case.block), QueryFeatures(q, case.kv)


def calibration_doc(case: Case, index: BlockIndex, query: QueryFeatures) -> CalibrationDoc:
    """The index's keys, dequantized, as a calibration capture (other kv heads: zeros)."""
    keys = index.get("head_keys").astype(np.float32) * index.get("head_scale")[..., None]  # [pairs, N, B, D]
    k = np.zeros((case.layers, case.blocks * case.block + case.query_tokens, case.kv, case.dim), np.float32)
    for slot, (layer, kv) in enumerate(index.head_pairs):
        k[layer, : case.blocks * case.block, kv] = keys[slot].reshape(-1, case.dim)
    return CalibrationDoc(query.q, k, (case.block, case.block + 1))


def three_scores(case: Case) -> dict[str, np.ndarray]:
    """Block scores (summed over the picked heads) of calibration, the numpy scorer and the torch scorer."""
    index, query = index_and_query(case)
    per_head = block_scores(calibration_doc(case, index, query), case.block)
    assert per_head is not None
    numpy_ = make_scorer("retrieval-heads", case.picked).score(query, index)
    torch_ = TorchRetrievalHeads(case.picked, "cpu").score(query, index)
    np.testing.assert_array_equal(torch_.peaks, numpy_.peaks)
    return {
        "calibration": sum(per_head.scores[layer, head].astype(np.float64) for layer, head in case.picked),
        "numpy": numpy_.scores,
        "torch": torch_.scores,
        "peaks": numpy_.peaks,
    }


def ranking(scores: np.ndarray) -> np.ndarray:
    return np.argsort(-scores, kind="stable")


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of a few blocks, so the streaming softmax crosses chunk boundaries."""
    torch.set_num_threads(1)
    monkeypatch.setitem(CHUNK_TOKENS, "numpy", 64)
    monkeypatch.setitem(CHUNK_TOKENS, "torch", 96)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_three_give_the_same_ranking_on_the_same_keys(case: Case) -> None:
    got = three_scores(case)
    for name in ("calibration", "torch"):
        np.testing.assert_array_equal(ranking(got[name]), ranking(got["numpy"]), err_msg=name)
        np.testing.assert_allclose(got[name], got["numpy"], rtol=1e-4, atol=1e-9, err_msg=name)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_scores_equal_the_recorded_ones(case: Case) -> None:
    got, recorded = three_scores(case), np.load(RECORDED)
    for name in ("calibration", "numpy", "torch"):
        want = recorded[f"{case.name}/{name}"]
        np.testing.assert_array_equal(ranking(got[name]), ranking(want), err_msg=name)
        np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-10, err_msg=name)
    np.testing.assert_array_equal(got["peaks"], recorded[f"{case.name}/peaks"])


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_dense_torch_keys_score_as_the_same_numpy_keys(dtype: torch.dtype) -> None:
    """Calibration's dense keys as tensors (bf16 as a model captures them) score as their float32 values."""
    rng = np.random.default_rng(7)
    keys = torch.from_numpy(rng.standard_normal((30, 16, 32)).astype(np.float32) * 2).to(dtype)
    rows = head_rows(rng.standard_normal((5, 3, 32)).astype(np.float32) * 2, [0, 2])
    n_tokens = np.full(30, 16)
    n_tokens[-1] = 9
    want = head_block_mass(rows, HeadKeys(keys.float().numpy(), n_tokens), 5)
    got = head_block_mass(rows, HeadKeys(keys, torch.from_numpy(n_tokens)), 5)
    for head in range(2):
        np.testing.assert_array_equal(ranking(got.mass[head]), ranking(want.mass[head]))
    np.testing.assert_allclose(got.mass, want.mass, rtol=1e-5, atol=1e-12)
    np.testing.assert_array_equal(got.peak_at, want.peak_at)


def test_chunks_scored_on_several_threads_give_the_same_scores_bit_for_bit() -> None:
    rng = np.random.default_rng(11)
    n_blocks, width, dim = 7 * CHUNK_TOKENS["numpy"] // 16 + 3, 16, 32  # 8 chunks, the last one short
    keys = rng.integers(-127, 128, size=(n_blocks, width, dim), dtype=np.int8)
    scales = rng.uniform(0.01, 0.05, size=(n_blocks, width)).astype(np.float32)
    n_tokens = np.full(n_blocks, width)
    n_tokens[-1] = 5
    rows = head_rows(rng.standard_normal((6, 4, dim)).astype(np.float32) * 2, [1, 3])
    one = head_block_mass(rows, HeadKeys(keys, n_tokens, scales), 6)
    for workers in (2, 3):
        many = head_block_mass(rows, HeadKeys(keys, n_tokens, scales), 6, workers=workers)
        for name in ("mass", "peak_log", "peak_at"):
            np.testing.assert_array_equal(getattr(many, name), getattr(one, name), err_msg=f"{workers}: {name}")


def test_other_array_types_are_refused() -> None:
    with pytest.raises(TypeError, match="numpy arrays or torch tensors"):
        head_block_mass(np.zeros((1, 4), np.float32), HeadKeys([[[0.0] * 4]], [1]), 1)
