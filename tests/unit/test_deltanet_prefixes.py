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


def test_a_tiled_batch_stops_each_snapshot_at_its_device_offset() -> None:
    """Inside a graph the limits are device tensors (``tiled``): every sequence runs all the tokens, and past its
    end (the forward's own rows, then each snapshot's offset) its tokens get gate 0 and beta 0, which leave the
    delta rule's state as it was (float64, token by token: the state after all the tokens equals the state after
    the end's)."""
    from kvmem_torch.deltanet import _stopped_at, recurrent_delta_rule, tiled

    T, cpu = 130, torch.device("cpu")
    batch = tiled(T, 3, cpu)
    assert batch.lengths == (T, T, T) and tiled(T, 3, cpu) is batch
    g, beta = torch.rand(3 * T, 4) - 1, torch.rand(3 * T, 4)
    g2, beta2 = _stopped_at(g, beta, batch, [T, torch.tensor(5), torch.tensor(64)])
    kept = (g2 != 0).all(1)
    assert kept.tolist() == [True] * T + [True] * 5 + [False] * (T - 5) + [True] * 64 + [False] * (T - 64)
    padded = (_stopped_at(g, beta, batch, [torch.tensor([100]), 5, 64])[0] != 0).all(1)  # a forward's own 100 rows
    assert padded.tolist() == [True] * 100 + [False] * (T - 100) + kept[T:].tolist()
    assert torch.equal(beta2[kept], beta[kept]) and not beta2[~kept].any()
    torch.manual_seed(0)
    h, d, o = 2, 8, 37
    q, k, v = (torch.randn(h, T, d, dtype=torch.float64) for _ in range(3))
    k = k / k.norm(dim=-1, keepdim=True)
    gate, b = -torch.rand(h, T, dtype=torch.float64), torch.rand(h, T, dtype=torch.float64)
    start = torch.randn(h, d, d, dtype=torch.float64)
    cut = start.clone()
    recurrent_delta_rule(q[:, :o], k[:, :o], v[:, :o], gate[:, :o], b[:, :o], cut)
    stopped = start.clone()
    keep = torch.arange(T) < o
    recurrent_delta_rule(q, k, v, gate * keep, b * keep, stopped)
    assert torch.allclose(stopped, cut, rtol=0, atol=1e-12)


def test_the_conv_tail_after_an_offset_is_the_inputs_just_before_it() -> None:
    """``_tail_after`` (what the fla conv path keeps as each snapshot's and the layer's conv tail) against the
    columns of the tail with the inputs appended, as the torch form slices them; offsets as ints and device
    tensors (a graph's), inside the old tail (offset < width) and past it."""
    from kvmem_torch.deltanet import _tail_after

    width, T = 3, 9
    tail, x = torch.randn(6, width), torch.randn(T, 6)
    joined = torch.cat([tail, x.T], dim=1)
    for offset in range(T + 1):
        want = joined[:, offset : offset + width]
        assert torch.equal(_tail_after(tail, x, offset), want)
        assert torch.equal(_tail_after(tail, x, torch.tensor([offset])), want)
        assert torch.equal(_tail_after(tail, x, torch.tensor(offset)), want)
