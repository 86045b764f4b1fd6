"""The Triton decode kernels, run by Triton's interpreter on the CPU, against float64 math and the eager path.

Triton decides at import time whether kernels run compiled or interpreted, so each check runs in
a fresh interpreter with ``TRITON_INTERPRET=1``. The same kernels run compiled on CUDA
(``tests/gpu``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")
pytest.importorskip("transformers")

ATTENTION_VS_FLOAT64 = """
import torch
from attention_reference import decode_attention_f64, rope_angles
from kvmem_torch.paged import PagedKV
from kvmem_torch.attention_kernels import decode_attention
torch.manual_seed(0)
out = {}
for heads, kv, hd, rd, S, n_keys in ((6, 2, 64, 16, 150, 131), (4, 2, 16, 16, 700, 131), (20, 1, 16, 16, 700, 690)):
    cache = PagedKV(2, 48, 16, kv, hd, torch.float32, "cpu", torch.ones(rd // 2))
    cache.kv.normal_()
    slots = torch.randperm(48 * 16)[:S]
    rows = cache.base_rows(slots)
    angles = rope_angles(torch.randint(0, 5000, (S,)), rd)
    cache.cos[slots], cache.sin[slots] = angles.cos().float(), angles.sin().float()  # the float64 angles' rows
    q, layer = torch.randn(heads, hd), 1
    got = decode_attention(q, cache, layer, slots, torch.tensor([n_keys]))
    k, v = cache.rows[rows + cache.k_offset(layer)][:n_keys], cache.rows[rows + cache.v_offset(layer)][:n_keys]
    out[f"{heads}x{kv}x{hd}"] = (got.double() - decode_attention_f64(q, k, v, angles[:n_keys])).abs().max().item()
print(__import__("json").dumps(out))
"""

DECODE_FUSED_VS_EAGER = """
import torch
from attention_reference import gated_heads_model
from kvmem_torch.model import Model
from kvmem_torch.runner import Runner
from torch_tiny import tiny_hf_model, tiny_spec_weights
out = {}
for arch in ("llama", "qwen35", "qwen35-27b-heads"):
    if arch == "qwen35-27b-heads":
        model = gated_heads_model(torch.float32)
    else:
        model = Model(*tiny_spec_weights(tiny_hf_model(arch, seed=3)))
    toks = torch.randint(0, 160, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    logits, states = {}, {}
    for fused in (False, True):
        model.use_kernels(fused)
        r = Runner(model, 12, 16)
        r.prefill(toks[:60], list(range(60)), chunk=25)
        r.drop(16, 32)  # a hole: the view is not contiguous in positions or slots
        steps = [r.forward([t], [60 + i])[0] for i, t in enumerate(toks[60:])]
        logits[fused] = torch.cat(steps)
        states[fused] = r.state.snapshot()
    out[arch] = (logits[True] - logits[False]).abs().max().item()
    out[arch + "_kernel_layers"] = [kind for kind, mixer, _ in model.layers if mixer.fused]
    if arch == "qwen35":
        out["rec_state"] = (states[True].rec - states[False].rec).abs().max().item()
        out["conv_state"] = (states[True].conv - states[False].conv).abs().max().item()
print(__import__("json").dumps(out))
"""

FOLDED_PROJECTIONS_VS_FLOAT64 = """
import torch
import torch.nn.functional as F
from kvmem_torch.gemv import NormedSum, output_projection, project
from kvmem_torch.layers import interleave_rows
torch.manual_seed(0)
out = {}
for n, k in ((300, 96), (33, 1030)):  # rows not a multiple of a program's (several programs), columns not of a load's
    x, delta, w = torch.randn(1, k), torch.randn(1, k), torch.randn(n, k) / k ** 0.5
    norm, bias = torch.rand(k) + 0.5, torch.randn(n)
    s = NormedSum(x, delta, norm, 1e-6)
    got = s.linear(w, bias)
    total = (x + delta).double()
    normed = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.double()
    out[f"norm {n}x{k}"] = (got.double() - (normed @ w.double().T + bias.double())).abs().max().item()
    out[f"total {n}x{k}"] = (s.total - (x + delta)).abs().max().item()
    w_up = torch.randn(n, k) / k ** 0.5
    act = NormedSum(x, delta, norm, 1e-6).linear(interleave_rows(w, w_up), swiglu=True).double()
    out[f"swiglu {n}x{k}"] = (act - F.silu(normed @ w.double().T) * (normed @ w_up.double().T)).abs().max().item()
    projected = project(NormedSum(x, delta, norm, 1e-6), w).double()  # a NormedSum through the dispatch
    out[f"project {n}x{k}"] = (projected - normed @ w.double().T).abs().max().item()
    out[f"plain {n}x{k}"] = (output_projection(x, w).double() - x.double() @ w.double().T).abs().max().item()
print(__import__("json").dumps(out))
"""


def interpreted(script: str) -> dict[str, float]:
    """Run ``script`` with Triton's interpreter; -> the JSON object it prints."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([os.path.join(root, "adapters"), root, os.path.join(root, "tests")]),
    )
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_paged_decode_attention_matches_float64_over_a_scattered_masked_view() -> None:
    errors = interpreted(ATTENTION_VS_FLOAT64)
    assert set(errors) == {"6x2x64", "4x2x16", "20x1x16"}
    assert max(errors.values()) <= 1e-5, errors


@pytest.mark.slow  # ~2 minutes in Triton's interpreter on 2 vCPUs; the GPU suite runs the same kernels natively
@pytest.mark.timeout(600)
def test_fused_decode_equals_the_eager_decode_on_tiny_models() -> None:
    errors = interpreted(DECODE_FUSED_VS_EAGER)
    assert max(errors[a] for a in ("llama", "qwen35", "qwen35-27b-heads")) <= 1e-4, errors
    # every llama attention layer and every qwen35 DeltaNet layer ran a kernel (the tiny qwen35's rotary dim 8 is
    # too narrow for the attention kernel's matmul, so those layers keep the torch ops; at 27B heads they fuse)
    assert errors["llama_kernel_layers"] == ["attention"] * 3 and errors["qwen35_kernel_layers"] == ["deltanet"] * 2
    assert errors["qwen35-27b-heads_kernel_layers"] == ["deltanet"] * 3 + ["attention"]
    assert errors["rec_state"] <= 1e-6 and errors["conv_state"] <= 1e-5, errors  # inputs differ by rounding


def test_folded_projections_match_float64() -> None:
    """A projection of rms_norm(x + delta) * w (writing x + delta), one storing silu(gate) * up of its
    interleaved rows, and one of a plain input, each one kernel."""
    errors = interpreted(FOLDED_PROJECTIONS_VS_FLOAT64)
    assert len(errors) == 10 and max(errors.values()) <= 1e-5, errors


def test_dependent_launch_only_on_nvidia_gpus_of_hopper_or_later(monkeypatch: pytest.MonkeyPatch) -> None:
    """Programmatic dependent launch is an NVIDIA sm_90+ feature; ROCm reports gfx9xx as capability 9.x. No such
    GPU here: the capability and the HIP version are stand-ins."""
    import torch

    from kvmem_torch import kernels

    assert not kernels.dependent_launch(torch.device("cpu"))
    for hip, capability, wanted in ((None, (9, 0), True), (None, (8, 9), False), ("6.2", (9, 4), False)):
        kernels._hopper_or_later.cache_clear()
        monkeypatch.setattr(torch.version, "hip", hip)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index, c=capability: c)
        assert kernels.dependent_launch(torch.device("cuda", 0)) is wanted
    kernels._hopper_or_later.cache_clear()
