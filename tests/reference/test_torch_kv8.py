"""8-bit KV on the torch engine: the decode kernel and the eager path over fp8 rows against float64 attention over
the dequantized keys, the kernel's quantizer against ``fp8.quantize``, and blocks that leave and re-enter the view
as the same bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_torch_fused_kernels import interpreted

from kvmem_core.adapter import Placement
from kvmem_core.config import KVMemConfig
from kvmem_core.errors import ConfigError

pytest.importorskip("triton")

FP8_DECODE_VS_FLOAT64 = """
import torch
from attention_reference import decode_attention_f64, rope_angles
from kvmem_torch import attention_kernels, fp8
from kvmem_torch.layers import Attention
from kvmem_torch.paged import PagedKV
torch.manual_seed(0)
out = {}
for heads, kv, hd, rd, S, n_keys in ((6, 2, 64, 16, 150, 131), (20, 1, 16, 16, 700, 690)):
    cache = PagedKV(2, 48, 16, kv, hd, torch.float32, "cpu", torch.ones(rd // 2), kv_fp8=True)
    cache.write_rows(torch.arange(cache.rows.shape[0]), torch.randn(cache.rows.shape[0], kv, hd) * 3)
    slots = torch.randperm(48 * 16)[:S]
    rows = cache.base_rows(slots)
    angles = rope_angles(torch.randint(0, 5000, (S,)), rd)
    cache.cos[slots], cache.sin[slots] = angles.cos().float(), angles.sin().float()
    q, layer = torch.randn(heads, hd), 1
    k = fp8.dequantize(cache.rows[rows + cache.k_offset(layer)][:n_keys], torch.float64)
    v = fp8.dequantize(cache.rows[rows + cache.v_offset(layer)][:n_keys], torch.float64)
    want = decode_attention_f64(q, k, v, angles[:n_keys])
    got = attention_kernels.decode_attention(q, cache, layer, slots, torch.tensor([n_keys]))
    out[f"kernel {heads}x{kv}x{hd}"] = (got.double() - want).abs().max().item()
    eager = cache.read_rows(rows[:n_keys] + cache.k_offset(layer)).double()
    out[f"eager keys {heads}x{kv}x{hd}"] = (eager - k).abs().max().item()
qkv = torch.randn((4 + 2 * 2) * 64) * 5
cache = PagedKV(2, 4, 16, 2, 64, torch.float32, "cpu", torch.ones(8), kv_fp8=True)
norms, cos, sin, slot = None, torch.ones(16), torch.zeros(16), torch.tensor([5])
attention_kernels.attention_prologue(qkv, norms, norms, cos, sin, cache, 1, slot, 1e-6, 4, False)
row = cache.base_rows(slot)
k_codes, v_codes = cache.rows[row + cache.k_offset(1)][0], cache.rows[row + cache.v_offset(1)][0]
out["prologue codes differing"] = int((k_codes != fp8.quantize(qkv[256:384].view(2, 64))).sum()
                                      + (v_codes != fp8.quantize(qkv[384:].view(2, 64))).sum())
print(__import__("json").dumps(out))
"""


def test_fp8_decode_attention_matches_float64_over_dequantized_keys() -> None:
    errors = interpreted(FP8_DECODE_VS_FLOAT64)
    assert errors.pop("prologue codes differing") == 0  # the kernel's quantizer stores fp8.quantize's bytes
    assert len(errors) == 4 and max(errors.values()) <= 1e-5, errors


def test_fp8_rows_keep_every_value_within_e4m3_precision() -> None:
    from kvmem_torch import fp8

    x = torch.randn(64, 4, 128) * torch.logspace(-3, 3, 64)[:, None, None]
    packed = fp8.quantize(x)
    assert packed.dtype == torch.uint8 and packed.shape == (64, 4, 132)
    back = fp8.dequantize(packed, torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    assert ((back - x).abs() <= 2**-4 * x.abs() + amax * 2**-9 / 448 * 8).all()  # half an ulp, or subnormal step
    assert fp8.dequantize(fp8.quantize(torch.zeros(2, 8)), torch.float32).abs().max() == 0


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory):
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    from kvmem_torch import create_adapter
    from gguf_writer import write_gguf
    from torch_tiny import tiny_hf_config, tiny_hf_model

    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("gguf") / "llama.gguf"
    write_gguf(path, tiny_hf_config("llama"), tiny_hf_model("llama", seed=4).state_dict())
    cfg = KVMemConfig(budget=64, gen_budget=32, block_tokens=16, sink_tokens=16, recent_tokens=16)
    return [create_adapter(str(path), cfg.replace(kv_dtype=d), device="cpu", progress=False) for d in ("auto", "fp8")]


def test_fp8_blocks_leave_and_reenter_the_view_as_the_same_bytes_at_half_the_size(pair) -> None:
    wide, narrow = pair
    assert narrow.layout.dtype == "fp8_e4m3" and narrow.layout.kv_shape == (3, 16, 2, 16 + 4)
    ids = torch.randint(0, 160, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    logits = {}
    for a in pair:
        a.clear_view()
        logits[a.layout.dtype] = a.forward(ids, list(range(40))).logits
    assert np.abs(logits["fp8_e4m3"] - logits["float32"]).max() <= 0.1 * np.abs(logits["float32"]).max()
    block = narrow.read_block(16, 16)
    assert block.k.dtype == np.uint8 and block.k.shape == narrow.layout.kv_shape
    keys = narrow.content_keys(block.k, 16)
    assert np.abs(keys - wide.content_keys(wide.read_block(16, 16).k, 16)).max() <= 0.15 * np.abs(keys).max()
    narrow.drop(16, 32)
    narrow.write_blocks([Placement(kv=block, src_pos=16, dst_pos=16)])
    again = narrow.read_block(16, 16)
    assert again.k.tobytes() == block.k.tobytes() and again.v.tobytes() == block.v.tobytes()
    # float32 KV here takes 4 * 16 bytes per head row, fp8 16 codes and a 4-byte scale
    assert narrow.layout.kv_bytes_per_block * 4 * 16 == wide.layout.kv_bytes_per_block * 20


@pytest.mark.parametrize(
    ("kv_dtype", "dtype", "message"),
    [
        ("q8_0", None, "--kv-dtype q8_0 is the llama.cpp engine's"),
        ("bf16", "float16", "--kv-dtype bf16 keeps KV in the run dtype, but --dtype is float16"),
    ],
)
def test_kv_dtypes_the_torch_engine_lacks_are_refused_by_name(kv_dtype, dtype, message) -> None:
    from kvmem_torch import kv_opts

    with pytest.raises(ConfigError, match=message):
        kv_opts(kv_dtype, dtype)
    assert kv_opts("bf16", None) == {"dtype": "bfloat16"} and kv_opts("fp8", "float32") == {"kv_fp8": True}
