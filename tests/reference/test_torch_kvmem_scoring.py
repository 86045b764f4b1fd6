"""The retrieval-heads scorer on torch tensors equals the numpy scorer over the same index.

CPU here (device memory and pinned mirrors); the ``gpu`` test repeats it on CUDA.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvmem_core.layout import BlockMeta
from kvmem_core.retrieval import BlockIndex, QueryFeatures, SummaryOptions, make_scorer, summarize_block
from kvmem_core.retrieval.heads_score import CHUNK_TOKENS
from kvmem_torch.scoring import TorchRetrievalHeads

HEADS = ((0, 1), (1, 2), (1, 3))  # (layer, query head); two query heads per kv head
N_LAYERS, N_HEADS, N_KV, DIM, B = 2, 4, 2, 32, 16


def metas(n: int, seed: int, first: int = 0) -> list[BlockMeta]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(first, first + n):
        tokens = B if i % 7 else B - 5  # some short blocks: padding must not count
        k = rng.standard_normal((N_LAYERS, tokens, N_KV, DIM)).astype(np.float32) * 2
        out.append(
            BlockMeta(
                f"{seed}-{i}",
                "",
                np.arange(tokens, dtype=np.int32),
                i * B,
                0,
                summarize_block(k, HEADS, SummaryOptions(group_size=2, prototypes=False)),
            )
        )
    return out


def query(seed: int) -> QueryFeatures:
    q = np.random.default_rng(seed).standard_normal((N_LAYERS, 9, N_HEADS, DIM)).astype(np.float32) * 2
    return QueryFeatures(q, N_KV)


def assert_same(scorer: TorchRetrievalHeads, index: BlockIndex, q: QueryFeatures) -> None:
    want = make_scorer("retrieval-heads", HEADS).score(q, index)
    got = scorer.score(q, index)
    np.testing.assert_allclose(got.scores, want.scores, rtol=1e-4, atol=1e-9)
    np.testing.assert_array_equal(got.peaks, want.peaks)


def check(device: str, pinned: bool, chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(CHUNK_TOKENS, "torch", chunk)
    scorer = TorchRetrievalHeads(HEADS, device, pinned)
    stored = metas(40, seed=1)
    index = BlockIndex.build(stored, B)
    assert_same(scorer, index, query(2))
    index.sync(stored + metas(100, seed=1, first=40))  # appended: the mirror grows past its 64 blocks
    assert_same(scorer, index, query(3))
    assert scorer.mirrors[index].n_blocks == 140
    index.sync(stored[:10] + metas(150, seed=4, first=10))  # a fork, longer: the mirror is rebuilt
    assert_same(scorer, index, query(5))
    index.sync(stored[:10] + metas(5, seed=5, first=10))  # a fork, shorter
    assert_same(scorer, index, query(6))


@pytest.mark.parametrize("chunk", (64, 1 << 16))
def test_torch_scorer_equals_numpy_on_cpu(chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)
    check("cpu", False, chunk, monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pinned", (False, True))
def test_torch_scorer_equals_numpy_on_cuda(pinned: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    check("cuda", pinned, 64, monkeypatch)


FUSED_UNDER_INTERPRETER = """
import pytest, torch
from kvmem_torch import score_kernel
import test_torch_kvmem_scoring as t
calls = []
block_stats = score_kernel.block_stats
score_kernel.block_stats = lambda rows, keys: calls.append(keys.keys.shape) or block_stats(rows, keys)
t.check("cpu", False, 64, pytest.MonkeyPatch())
print(len(calls))
"""


@pytest.mark.timeout(300)
def test_the_fused_kernel_scores_as_numpy_does_under_tritons_interpreter() -> None:
    """The scorer through ``kvmem_torch.score_kernel`` (Triton's interpreter on the CPU; compiled on CUDA in the
    ``gpu`` test above): the same scores and peaks over appends and forks as the numpy scorer."""
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[2]
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(str(p) for p in (root / "adapters", root, root / "tests", Path(__file__).parent)),
    )
    done = subprocess.run([sys.executable, "-c", FUSED_UNDER_INTERPRETER], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) >= 8  # every (layer, kv head) of the four scorings went through the kernel
