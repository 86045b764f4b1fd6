"""``layers.cudnn_prefill``'s split and merge on the CPU: cuDNN's fused attention (no CPU kernel; its GPU test is
tests/gpu/test_torch_prefill_graphs_cuda.py) stands in as float64 attention with cuDNN's contract (causal masks
aligned top-left, GQA, natural-log sum-exp per row), and the split's answer is held against float64 causal
attention aligned to the last key."""

from __future__ import annotations

import pytest
import torch

from kvmem_core.config import KVMemConfig
from kvmem_core.engine import KVMemEngine
from kvmem_torch import layers
from torch_tiny import causal_reference, random_qwen35_adapter


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


@pytest.mark.parametrize("n_keys", [40, 41, 300, 2101])
def test_the_split_at_the_diagonal_is_causal_attention_to_the_last_key(
    n_keys: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """40 new tokens as the whole view, after one key, after 260 (a remainder alone) and after 2,061 (a bucket of
    2,048 and a remainder; 8 query heads over 2 key heads of 32)."""
    monkeypatch.setattr(layers, "_cudnn_attention", cudnn_stand_in)
    monkeypatch.setattr(layers, "CUDNN_KEY_BUCKET", 2048)
    gen = torch.Generator().manual_seed(n_keys)
    q = torch.randn(40, 8, 32, generator=gen)
    k, v = (torch.randn(n_keys, 2, 32, generator=gen) * 2 for _ in range(2))
    got = layers.cudnn_prefill(q, k, v)
    assert got.shape == q.shape
    assert torch.allclose(got.double(), causal_reference(q, k, v), atol=1e-5, rtol=0)


def test_the_shapes_cudnn_plans_for_come_in_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the forward's length and key count, every call's rows are a multiple of the row bucket, a causal
    call is square, and a call without a mask reads whole key buckets: cuDNN keeps a plan per shape for good."""
    shapes: list[tuple[int, int, bool]] = []

    def recording(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, ...]:
        shapes.append((q.shape[2], k.shape[2], causal))
        return cudnn_stand_in(q, k, v, causal)

    monkeypatch.setattr(layers, "_cudnn_attention", recording)
    monkeypatch.setattr(layers, "CUDNN_ROW_BUCKET", 16)
    monkeypatch.setattr(layers, "CUDNN_KEY_BUCKET", 64)
    gen = torch.Generator().manual_seed(0)
    for n_new, n_keys in [(1, 1), (5, 70), (16, 16), (17, 200), (33, 129), (40, 300)]:
        q = torch.randn(n_new, 4, 8, generator=gen)
        k, v = (torch.randn(n_keys, 2, 8, generator=gen) for _ in range(2))
        assert torch.allclose(layers.cudnn_prefill(q, k, v).double(), causal_reference(q, k, v), atol=1e-5, rtol=0)
    assert all(rows % 16 == 0 and (keys == rows if causal else keys % 64 == 0) for rows, keys, causal in shapes)
    assert {(rows, keys) for rows, keys, causal in shapes if not causal} == {(16, 64), (32, 128), (48, 64), (48, 256)}


def test_cudnn_prefill_is_unavailable_on_the_cpu_and_pays_from_its_pair_count_and_length() -> None:
    assert not layers.cudnn_prefill_usable(torch.float32, 32, torch.device("cpu"))
    assert not layers.cudnn_pays(2048, 2047) and layers.cudnn_pays(2048, 4096)  # long forwards from 2^23 pairs
    assert not layers.cudnn_pays(640, 17_536) and layers.cudnn_pays(640, 67_648)  # short ones from 2^25


def test_a_turn_at_the_default_knobs_keeps_flash_attention_and_its_graphs() -> None:
    """A GPU's prefill forwards (4,096 tokens asked) through the default view are a quarter of it, over at most the
    view's keys: below both of ``cudnn_pays``'s bars, so only the baselines and larger views reach cuDNN."""
    cfg = KVMemConfig()
    adapter = random_qwen35_adapter(
        "cpu", view_tokens=cfg.view_tokens, block_tokens=cfg.block_tokens, prefill_chunk=4096
    )
    engine = KVMemEngine(adapter, cfg, heads=((0, 0),))
    try:
        chunk, view = engine._prefill_chunk(engine.config), engine.config.view_tokens
        assert (chunk, view) == (640, 2560) and not layers.cudnn_pays(chunk, view)
        assert layers.cudnn_pays(4 * chunk, 4 * view)  # a view four times the default
    finally:
        engine.close()
