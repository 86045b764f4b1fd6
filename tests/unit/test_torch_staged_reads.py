"""``TorchAdapter.stage_reads``: a block read taken after its chunk is handed out as it was, with its scoring
summaries, after the cells are dropped and later forwards write over their slots (on CUDA the copies are queued,
not waited for); a chunk's
blocks are one gather, and a forward's captured queries and states are copied out only when first read."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvmem_core.retrieval.summaries import SummaryOptions, summarize_block
from kvmem_torch.adapter import TorchAdapter
from summary_support import assert_same_summaries
from torch_tiny import random_qwen35_adapter

B = 16
HEADS = ((0, 0), (0, 3))
CUDA = pytest.param(
    "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")]
)


def adapter_on(device: str) -> TorchAdapter:
    return random_qwen35_adapter(device, view_tokens=256, block_tokens=B)


@pytest.mark.parametrize("device", ("cpu", CUDA))
def test_a_staged_read_survives_the_drop_and_the_forwards_after_it(device: str) -> None:
    adapter = adapter_on(device)
    ids = torch.randint(0, 4000, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    adapter.forward(ids[:64], list(range(64)), want_logits=False)
    starts = [0, 16, 32, 48]
    expected = [adapter.read_block(p, B) for p in starts]
    opts = SummaryOptions.for_layout(adapter.layout, prototypes=False)
    adapter.summarize_staged(HEADS, opts)
    adapter.stage_reads(starts, B)
    adapter.drop(0, 64)  # the freed slots go to the next tokens first
    adapter.forward(ids[64:], list(range(64, 128)), want_logits=False)
    assert not np.array_equal(adapter.read_block(64, B).k, expected[0].k)  # the slots now hold other keys
    for p, want in zip(starts, expected):
        summary = adapter.staged_summary(p, B)
        got = adapter.read_block(p, B)
        assert np.array_equal(got.k, want.k) and np.array_equal(got.v, want.v)
        assert_same_summaries(summary, summarize_block(adapter.content_keys(want.k, p), HEADS, opts))
    adapter.stage_reads([64], B)
    adapter.clear_view()  # a fresh sequence forgets what was staged
    assert not adapter.staged.reads and adapter.staged_summary(64, B) is None


@pytest.mark.parametrize("device", ("cpu", CUDA))
def test_staging_a_chunk_of_blocks_is_one_gather_and_queries_and_states_wait_for_their_first_read(device) -> None:
    adapter = adapter_on(device)
    ids = torch.randint(0, 4000, (96,), generator=torch.Generator().manual_seed(1)).tolist()
    out = adapter.forward(ids[:64], list(range(64)), capture_from=40, snapshot_at=[16, 50])
    gathers, read_runs = [], adapter.runner.read_runs
    adapter.runner.read_runs = lambda starts, n: gathers.append(list(starts)) or read_runs(starts, n)
    adapter.stage_reads([0, 16, 32, 48], B)
    assert gathers == [[0, 16, 32, 48]]  # one gather (and on a GPU one copy) for the chunk's blocks
    assert all(out._reads.get(k) is not None for k in ("queries", "states"))  # nothing copied out yet
    queries, states = out.queries, out.states
    assert queries.shape[:2] == (adapter.layout.n_layers, 24) and len(states) == 2
    assert set(out._reads) == {"logits"} and out.queries is queries  # each read once, the logits not yet
