"""The Triton decode kernels compiled on CUDA: against float64 at the 27B attention and projection shapes
(with the launch shapes the GPU runs), and the fused decode (graphs on) against the eager torch decode on the
tiny HF models."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")
pytest.importorskip("transformers")

from attention_reference import decode_attention_f64, gated_heads_model, rope_angles  # noqa: E402
from kvmem_torch.gemv import NormedSum, output_projection  # noqa: E402
from kvmem_torch.layers import interleave_rows  # noqa: E402
from kvmem_torch.attention_kernels import decode_attention  # noqa: E402
from kvmem_torch.model import Model  # noqa: E402
from kvmem_torch.paged import PagedKV  # noqa: E402
from kvmem_torch.runner import Runner  # noqa: E402
from torch_tiny import tiny_hf_model, tiny_spec_weights  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False


@pytest.mark.parametrize("n_slots,n_keys", ((5000, 4999), (70_000, 66_000)))
def test_paged_attention_at_the_27b_shape_matches_float64(n_slots: int, n_keys: int) -> None:
    torch.manual_seed(0)
    cache = PagedKV(2, n_slots // 128 + 8, 128, 4, 256, torch.bfloat16, "cuda", torch.ones(32))
    cache.kv.normal_()
    slots = torch.randperm(cache.num_blocks * 128, device="cuda")[:n_slots]
    rows = cache.base_rows(slots)
    angles = rope_angles(torch.randint(0, 1 << 20, (n_slots,), device="cuda"), 64, 1e7)
    cache.cos[slots], cache.sin[slots] = angles.cos().bfloat16(), angles.sin().bfloat16()  # the float64 angles' rows
    q = torch.randn(24, 256, device="cuda").bfloat16()
    got = decode_attention(q, cache, 1, slots, torch.tensor([n_keys], device="cuda"))
    k, v = cache.rows[rows + cache.k_offset(1)][:n_keys], cache.rows[rows + cache.v_offset(1)][:n_keys]
    ref = decode_attention_f64(q, k, v, angles[:n_keys])
    assert (got.double() - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()


# a DeltaNet input projection; the MLP's gate/up (SwiGLU stored) and down; a DeltaNet output projection
@pytest.mark.parametrize(
    "n,k,kind", ((16480, 5120, "norm"), (17408, 5120, "swiglu"), (5120, 17408, "plain"), (5120, 6144, "plain"))
)
def test_folded_projections_at_the_27b_shape_match_float64(n: int, k: int, kind: str) -> None:
    torch.manual_seed(0)
    w = (torch.randn(n, k, device="cuda") / k**0.5).bfloat16()
    if kind == "plain":
        x = torch.randn(1, k, device="cuda").bfloat16()
        got, ref = output_projection(x, w), x.double() @ w.double().T
    else:
        x, delta, norm = (
            torch.randn(1, k, device="cuda").bfloat16(),
            torch.randn(1, k, device="cuda").bfloat16(),
            torch.rand(k, device="cuda") + 0.5,
        )
        s = NormedSum(x, delta, norm, 1e-6)
        total = (x + delta).double()
        normed = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.double()
        if kind == "norm":
            got, ref = s.linear(w), normed @ w.double().T
        else:
            w_up = (torch.randn(n, k, device="cuda") / k**0.5).bfloat16()
            got = s.linear(interleave_rows(w, w_up), swiglu=True)
            ref = torch.nn.functional.silu(normed @ w.double().T) * (normed @ w_up.double().T)
        assert torch.equal(s.total, x + delta)
    assert (got.double() - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()  # bf16 inputs and output


@pytest.mark.parametrize("arch", ("llama", "qwen35", "qwen35-27b-heads"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("kv_fp8", (False, True))
def test_fused_graph_decode_equals_eager_torch_decode(arch: str, dtype: torch.dtype, kv_fp8: bool) -> None:
    if arch == "qwen35-27b-heads":  # gated attention with q/k norms through the fused kernels
        model = gated_heads_model(dtype, "cuda")
    else:
        model = Model(*tiny_spec_weights(tiny_hf_model(arch, seed=3).cuda(), dtype, "cuda"))
    ids = torch.randint(0, 160, (90,), generator=torch.Generator().manual_seed(4)).tolist()
    outs = {}
    for fused in (False, True):
        model.use_kernels(fused)
        r = Runner(model, 16, 16, cuda_graphs=fused, kv_fp8=kv_fp8)
        r.prefill(ids[:60], list(range(60)), chunk=25)
        r.drop(16, 32)
        outs[fused] = torch.cat([r.forward([t], [60 + i])[0].float().clone() for i, t in enumerate(ids[60:])])
    eager, fused = outs[False], outs[True]
    exact = dtype == torch.float32 and not kv_fp8  # bf16 roundings differ, and so may an fp8 code they flip
    tol = 1e-4 if exact else 6e-2 * eager.abs().max().item()
    assert (eager - fused).abs().max().item() <= tol
    assert (eager.argmax(-1) == fused.argmax(-1)).float().mean().item() >= (1.0 if exact else 0.9)


def test_fp8_paged_attention_at_the_27b_shape_matches_float64_over_dequantized_keys() -> None:
    from kvmem_torch import fp8

    torch.manual_seed(0)
    n_slots, n_keys = 33_000, 32_768
    cache = PagedKV(2, n_slots // 128 + 8, 128, 4, 256, torch.bfloat16, "cuda", torch.ones(32), kv_fp8=True)
    cache.write_rows(
        torch.arange(cache.rows.shape[0], device="cuda"),
        torch.randn(cache.rows.shape[0], 4, 256, device="cuda").bfloat16(),
    )
    slots = torch.randperm(cache.num_blocks * 128, device="cuda")[:n_slots]
    rows = cache.base_rows(slots)
    angles = rope_angles(torch.randint(0, 1 << 20, (n_slots,), device="cuda"), 64, 1e7)
    cache.cos[slots], cache.sin[slots] = angles.cos().bfloat16(), angles.sin().bfloat16()
    q = torch.randn(24, 256, device="cuda").bfloat16()
    got = decode_attention(q, cache, 1, slots, torch.tensor([n_keys], device="cuda"))
    k = fp8.dequantize(cache.rows[rows + cache.k_offset(1)][:n_keys], torch.float64)
    v = fp8.dequantize(cache.rows[rows + cache.v_offset(1)][:n_keys], torch.float64)
    ref = decode_attention_f64(q, k, v, angles[:n_keys])
    assert (got.double() - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()
