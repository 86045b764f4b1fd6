"""The variable-length batch a DeltaNet layer hands flash-linear-attention when a forward takes snapshots
(``kvmem_torch.deltanet.Prefixes``): the forward's tokens, then each snapshot's prefix of them, described as fla
reads a batch (sequence boundaries, and each 64-token chunk as [sequence, chunk within it])."""

from __future__ import annotations

import torch

from kvmem_torch.deltanet import CHUNK, prefixes


def test_the_batch_is_the_tokens_then_each_prefix_with_fla_s_chunk_description() -> None:
    batch = prefixes(130, (5, 64), torch.device("cpu"))
    assert batch.lengths == (130, 5, 64)
    x = torch.arange(1000, 1130)
    assert torch.equal(x[batch.rows.long()], torch.cat([x, x[:5], x[:64]]))
    assert batch.cu_seqlens.tolist() == [0, 130, 135, 199]
    assert batch.chunk_indices.tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [2, 0]]
    assert CHUNK == 64 and batch.chunk_indices.dtype == batch.cu_seqlens.dtype == torch.int32


def test_a_forward_s_layers_share_one_batch() -> None:
    cpu = torch.device("cpu")
    assert prefixes(640, (5, 130, 512), cpu) is prefixes(640, (5, 130, 512), cpu)
    assert prefixes(640, (5, 130), cpu) is not prefixes(640, (5, 130, 512), cpu)
