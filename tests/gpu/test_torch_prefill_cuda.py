"""The prefill kernels on CUDA at the 27B shape, against float64: causal attention over a view that already
holds keys (flash / memory-efficient, aligned to the last key) and flash-linear-attention's chunked delta rule."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from kvmem_torch.deltanet import DeltaNet, chunked_delta_rule, fla_chunked_rule, fla_delta_rule, l2norm  # noqa: E402
from kvmem_torch.layers import causal_attention  # noqa: E402


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return (got.double() - ref).abs().max().item() / ref.abs().max().item()


@pytest.mark.parametrize("prefix,new", ((0, 4096), (6000, 2048)))
def test_causal_attention_after_a_prefix_matches_float64(prefix: int, new: int) -> None:
    torch.manual_seed(0)
    S = prefix + new
    q = torch.randn(1, 24, new, 256, device="cuda").bfloat16()
    k, v = (torch.randn(1, 4, S, 256, device="cuda").bfloat16() for _ in range(2))
    got = causal_attention(q, k, v)
    mask = torch.arange(S, device="cuda")[None, :] <= torch.arange(prefix, S, device="cuda")[:, None]
    ref = F.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(6, 1), v.double().repeat_interleave(6, 1), attn_mask=mask
    )
    assert relative_error(got, ref) <= 2e-2


def test_fla_delta_rule_matches_the_float64_chunked_rule() -> None:
    """Qwen3.6-27B's DeltaNet heads (16 key / 48 value heads of 128), 1,000 tokens from a non-zero state."""
    if fla_chunked_rule() is None:
        pytest.skip("flash-linear-attention is not installed")
    torch.manual_seed(0)
    T, nk, nv, d = 1000, 16, 48, 128
    q, k = (torch.randn(T, nk, d, device="cuda").bfloat16() for _ in range(2))
    v = torch.randn(T, nv, d, device="cuda").bfloat16()
    g = -F.softplus(torch.randn(T, nv, device="cuda"))
    beta = torch.rand(T, nv, device="cuda")
    state = 0.1 * torch.randn(nv, d, d, device="cuda")
    ref_state = state.double()
    qr = l2norm(q.double()).repeat_interleave(3, 1) * d**-0.5
    kr = l2norm(k.double()).repeat_interleave(3, 1)
    ref = chunked_delta_rule(
        qr.transpose(0, 1), kr.transpose(0, 1), v.double().transpose(0, 1), g.double().T, beta.double().T, ref_state
    ).transpose(0, 1)
    got = fla_delta_rule(q, k, v, g, beta, state)
    assert relative_error(got, ref) <= 2e-2
    assert relative_error(state, ref_state) <= 1e-2


@pytest.fixture
def layer(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, DeltaNet, list[int]]:
    """A bf16 DeltaNet layer of the small qwen35 shape (skips without fla), and a list its fla calls append to."""
    from kvmem_torch import deltanet
    from kvmem_bench.torch_device import qwen35_spec
    from kvmem_bench.torch_weights import random_weights

    spec = qwen35_spec("small")
    weights = random_weights(spec, torch.bfloat16, "cuda", 0, std=0.1)
    at = f"layers.{spec.deltanet_layers[0]}."
    net = DeltaNet(spec, {n[len(at) :]: t for n, t in weights.items() if n.startswith(at)})
    assert net.fla == (fla_chunked_rule() is not None)
    if not net.fla:
        pytest.skip("flash-linear-attention is not installed")
    calls: list[int] = []
    monkeypatch.setattr(deltanet, "fla_delta_rule", lambda *a: calls.append(1) or fla_delta_rule(*a))
    return spec, net, calls


def fresh_state(spec: Any, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A non-zero (conv tail, recurrent matrix) pair of the layer's shapes."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    conv = torch.randn(spec.conv_dim, spec.conv_kernel - 1, device="cuda", generator=g).bfloat16()
    rec = 0.05 * torch.randn(spec.linear_v_heads, spec.linear_k_dim, spec.linear_v_dim, device="cuda", generator=g)
    return conv, rec


def test_bf16_deltanet_prefill_runs_through_fla(layer: tuple[Any, DeltaNet, list[int]]) -> None:
    """A bf16 layer's prefill goes through fla (when installed) and answers as the layer's torch form does."""
    from kvmem_torch import deltanet

    spec, net, calls = layer
    net(torch.randn(deltanet.FLA_MIN_TOKENS - 1, spec.hidden_size, device="cuda").bfloat16(), *fresh_state(spec))
    assert not calls  # a piece shorter than a chunk keeps the torch form (fla's host cost is the larger)
    x = torch.randn(300, spec.hidden_size, device="cuda").bfloat16()
    outs, states = [], []
    for fla in (True, False):
        net.fla = fla
        conv, rec = fresh_state(spec)
        outs.append(net(x, conv, rec).float())
        states.append(rec)
    assert len(calls) == 1
    assert relative_error(outs[0], outs[1].double()) <= 5e-2
    assert relative_error(states[0], states[1].double()) <= 2e-2


def test_snapshots_come_from_one_fla_call_as_cut_forwards_leave_them(
    layer: tuple[Any, DeltaNet, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With snapshots a layer makes one fla call: the output is an uncut call's, each snapshot (conv tail and
    recurrent matrix) the state that the same rows up to it leave through fla, and the torch form's split agrees
    in bf16."""
    from kvmem_torch import deltanet

    spec, net, calls = layer
    x = torch.randn(640, spec.hidden_size, device="cuda").bfloat16()
    offsets = (5, 130, 512)  # a query's start, a block edge, a replay start: inside a chunk, on its edge, past one
    conv, rec = fresh_state(spec)
    snaps = [(o, torch.empty_like(conv), torch.empty_like(rec)) for o in offsets]
    got = net(x, conv, rec, snaps).float()
    assert len(calls) == 1
    whole_conv, whole_rec = fresh_state(spec)
    assert torch.allclose(got, net(x, whole_conv, whole_rec).float(), rtol=0, atol=1e-2)
    assert torch.equal(conv, whole_conv) and relative_error(rec, whole_rec.double()) <= 1e-4
    monkeypatch.setattr(deltanet, "FLA_MIN_TOKENS", 1)  # the references: fla on the rows up to each offset
    mixed, _, b, a = deltanet.project(x, net.w["in_fused"]).split(net.sizes, dim=-1)
    for o, snap_conv, snap_rec in snaps:
        cut_conv, cut_rec = fresh_state(spec)
        net.mix(mixed[:o], a[:o], b[:o], cut_conv, cut_rec)
        assert torch.equal(snap_conv, cut_conv)
        assert relative_error(snap_rec, cut_rec.double()) <= 1e-4
    net.fla = False  # the torch form, split at the offsets: the same states within bf16
    split_snaps = [(o, torch.empty_like(conv), torch.empty_like(rec)) for o in offsets]
    net(x, *fresh_state(spec), split_snaps)
    for (_, _, fla_rec), (_, _, torch_rec) in zip(snaps, split_snaps):
        assert relative_error(fla_rec, torch_rec.double()) <= 2e-2


def test_snapshot_offsets_on_the_device_give_the_same_states(layer: tuple[Any, DeltaNet, list[int]]) -> None:
    """A forward replayed from a graph reads its snapshot offsets from device tensors (``deltanet.tiled``): the
    output, the conv tails and the recurrent matrices agree with the same offsets as ints (one fla call either way)."""
    spec, net, calls = layer
    x = torch.randn(640, spec.hidden_size, device="cuda").bfloat16()
    results = []
    for offsets in ((5, 130, 512), tuple(torch.tensor(o, device="cuda") for o in (5, 130, 512))):
        conv, rec = fresh_state(spec)
        snaps = [(o, torch.empty_like(conv), torch.empty_like(rec)) for o in offsets]
        results.append((net(x, conv, rec, snaps).float(), conv, rec, snaps))
    assert len(calls) == 2
    (out, conv, rec, snaps), (dev_out, dev_conv, dev_rec, dev_snaps) = results
    assert torch.allclose(out, dev_out, rtol=0, atol=1e-2)
    assert torch.equal(conv, dev_conv) and relative_error(dev_rec, rec.double()) <= 1e-4
    for (_, a_conv, a_rec), (_, b_conv, b_rec) in zip(snaps, dev_snaps):
        assert torch.equal(a_conv, b_conv) and relative_error(b_rec, a_rec.double()) <= 1e-4
