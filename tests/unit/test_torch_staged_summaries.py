"""Scoring summaries computed where a view's KV is (``kvmem_torch.staged``) against ``summarize_block``'s numpy, and
a torch engine storing them: the same summaries the host computes from the stored blocks."""

from __future__ import annotations

import pytest
import torch

from kvmem_core.retrieval.summaries import SummaryOptions, index_pairs, summarize_block
from kvmem_torch.staged import block_summaries, queued_summaries
from summary_support import assert_same_summaries, stored_and_recomputed

HEADS = ((0, 1), (1, 0), (1, 3))
OPTS = SummaryOptions(group_size=2, prototypes=False)


@pytest.mark.parametrize("n_blocks, tokens", [(1, 16), (3, 16), (2, 7)])
def test_a_batch_of_blocks_summarizes_as_each_block_alone(n_blocks, tokens):
    keys = torch.randn(3, n_blocks * tokens, 4, 8, generator=torch.Generator().manual_seed(n_blocks))
    summary = queued_summaries(keys, n_blocks, index_pairs(HEADS, OPTS.group_size), OPTS.sub_blocks)
    for i in range(n_blocks):
        block = keys[:, i * tokens : (i + 1) * tokens].numpy()
        assert_same_summaries(summary(i), summarize_block(block, HEADS, OPTS))


def test_without_index_heads_there_are_no_head_keys():
    keys = torch.randn(2, 3, 16, 4, 8)
    assert sorted(block_summaries(keys, (), 4)) == ["mean_k", "sub_mean_k"]


def test_a_torch_engine_stores_the_summaries_the_host_would_compute():
    stored = stored_and_recomputed("cpu")
    assert len(stored) >= 8
    for got, want in stored:
        assert_same_summaries(got, want)
