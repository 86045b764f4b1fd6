"""Scoring summaries computed on the GPU for staged blocks (``kvmem_torch.staged``) equal the host's
(``summarize_block`` on the copied blocks), for a batch of blocks and through a torch engine on CUDA."""

from __future__ import annotations

import pytest
import torch

from kvmem_core.retrieval.summaries import SummaryOptions, index_pairs, summarize_block
from kvmem_torch.staged import queued_summaries
from summary_support import assert_same_summaries, stored_and_recomputed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")]
HEADS = ((0, 1), (1, 0), (1, 3))
OPTS = SummaryOptions(group_size=2, prototypes=False)


def test_a_batch_of_bf16_blocks_summarizes_on_the_gpu_as_on_the_host() -> None:
    keys = torch.randn(4, 3 * 128, 4, 256, generator=torch.Generator().manual_seed(1)).to("cuda", torch.bfloat16)
    summary = queued_summaries(keys, 3, index_pairs(HEADS, OPTS.group_size), OPTS.sub_blocks)
    for i in range(3):
        block = keys[:, i * 128 : (i + 1) * 128].float().cpu().numpy()
        assert_same_summaries(summary(i), summarize_block(block, HEADS, OPTS))


def test_a_torch_engine_on_cuda_stores_the_summaries_the_host_would_compute() -> None:
    stored = stored_and_recomputed("cuda")
    assert len(stored) >= 8
    for got, want in stored:
        assert_same_summaries(got, want)
