"""``layers.cudnn_prefill``'s split and merge on the CPU: cuDNN's fused attention (no CPU kernel; its GPU test is
tests/gpu/test_torch_prefill_graphs_cuda.py) stands in as float64 attention with cuDNN's contract (causal masks
aligned top-left, GQA, natural-log sum-exp per row), and the split's answer is held against float64 causal
attention aligned to the last key."""

from __future__ import annotations

import pytest
import torch

from kvmem_torch import layers
from torch_tiny import causal_reference


def cudnn_stand_in(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, ...]:
    """[1, heads, T, hd] over [1, kv, S, hd] -> (out in q's dtype, log-sum-exp [1, heads, T, 1] fp32); causal: row i
    sees keys 0..i (top-left), as cuDNN's mask."""
    group = q.shape[1] // k.shape[1]
    k, v = (x.double().repeat_interleave(group, 1) for x in (k, v))
    scores = q.double() @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        rows, cols = torch.arange(q.shape[2])[:, None], torch.arange(k.shape[2])[None, :]
        scores = scores.masked_fill(cols > rows, float("-inf"))
    lse = torch.logsumexp(scores, -1, keepdim=True)
    return (torch.exp(scores - lse) @ v).to(q.dtype), lse.float()


@pytest.mark.parametrize("n_keys", [40, 41, 300])
def test_the_split_at_the_diagonal_is_causal_attention_to_the_last_key(
    n_keys: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """40 new tokens as the whole view, after one key and after 260 (8 query heads over 2 key heads of 32)."""
    monkeypatch.setattr(layers, "_cudnn_attention", cudnn_stand_in)
    gen = torch.Generator().manual_seed(n_keys)
    q = torch.randn(40, 8, 32, generator=gen)
    k, v = (torch.randn(n_keys, 2, 32, generator=gen) * 2 for _ in range(2))
    got = layers.cudnn_prefill(q, k, v)
    assert got.shape == q.shape
    assert torch.allclose(got.double(), causal_reference(q, k, v), atol=1e-5, rtol=0)


def test_cudnn_prefill_is_unavailable_on_the_cpu_and_pays_from_its_pair_count() -> None:
    assert not layers.cudnn_prefill_usable(torch.float32, 32, torch.device("cpu"))
    assert not layers.cudnn_pays(64, 1 << 16) and layers.cudnn_pays(128, 1 << 16)
