"""GGUF files (``llama``, ``qwen2``, ``qwen35``) to the internal layout: one fast header pass, tensors dequantized
lazily.

The header (key/values, vocabulary included, and tensor infos) is parsed once with
``struct`` over a memory map; tensor bytes are read only when a tensor is loaded and
dequantized with the ``gguf`` package (F32, F16, BF16, Q8_0, Q5_0, Q4_0, Q4_1, Q4_K, Q6_K ...).
llama.cpp's converter quirks are undone here: Llama Q/K rows are un-permuted, qwen35
DeltaNet V heads go from tiled back to grouped order. Its ``+1`` on norms and
``ssm_a = -exp(A_log)`` already match the internal layout. The first MTP layer (block N = the main layers' count,
its ``nextn.*`` tensors beside the layer's own; ``{arch}.nextn_predict_layers`` counts them) loads as ``mtp.*``
(``kvmem_torch.mtp``); later ones are skipped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kvmem_core.errors import UnsupportedModelError
from kvmem_core.gguf_file import GGUFFile
from kvmem_torch.spec import ModelSpec, spec_from_gguf

_GLOBAL = {"token_embd.weight": "embed", "output_norm.weight": "norm", "output.weight": "lm_head"}
_LAYER = {
    "attn_norm": "attn_norm",
    "ffn_norm": "mlp_norm",
    "post_attention_norm": "mlp_norm",
    "attn_q": "q",
    "attn_k": "k",
    "attn_v": "v",
    "attn_output": "o",
    "attn_q_norm": "q_norm",
    "attn_k_norm": "k_norm",
    "ffn_gate": "gate",
    "ffn_up": "up",
    "ffn_down": "down",
    "attn_qkv": "qkv",
    "attn_gate": "z",
    "ssm_beta": "b",
    "ssm_alpha": "a",
    "ssm_out": "out",
    "ssm_conv1d": "conv",
    "ssm_dt": "dt_bias",
    "ssm_a": "ssm_a",
    "ssm_norm": "ssm_norm",
}
_BIAS = {"attn_q": "q_bias", "attn_k": "k_bias", "attn_v": "v_bias"}  # qwen2; ssm_dt.bias is dt_bias above
_NEXTN = {"eh_proj": "fc", "enorm": "enorm", "hnorm": "hnorm", "shared_head_norm": "norm"}  # embed, head: shared


def internal_name(gguf_name: str, n_layers: int) -> str | None:
    """Internal name for a GGUF tensor, None for tensors not used (MTP layers past the first, unknown extras)."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    parts = gguf_name.split(".")
    if parts[0] != "blk" or int(parts[1]) > n_layers:
        return None
    mtp = int(parts[1]) == n_layers
    if mtp and parts[2] == "nextn":
        return f"mtp.{_NEXTN[parts[3]]}" if parts[3] in _NEXTN else None
    if parts[2] not in _LAYER:
        return None
    leaf = _BIAS[parts[2]] if parts[-1] == "bias" and parts[2] in _BIAS else _LAYER[parts[2]]
    return f"mtp.layers.0.{leaf}" if mtp else f"layers.{parts[1]}.{leaf}"


def convert_tensor(spec: ModelSpec, name: str, t: torch.Tensor) -> torch.Tensor:
    """Undo the converter's reorderings so ``t`` matches the HF-ordered internal layout."""
    leaf = name.rsplit(".", 1)[-1]
    if spec.arch == "llama" and leaf in ("q", "k"):
        return unpermute_qk(t, spec.n_heads if leaf == "q" else spec.n_kv_heads)
    if spec.arch == "qwen35" and spec.linear_v_heads != spec.linear_k_heads:
        return _untile_deltanet(spec, leaf, t)
    return t


def unpermute_qk(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of the converter's Q/K row permutation (interleaved RoPE pairs back to rotate-half)."""
    rows = t.shape[0]
    return t.reshape(n_heads, rows // n_heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def untile(t: torch.Tensor, dim: int, n_k: int, per_k: int, head_dim: int) -> torch.Tensor:
    """V heads along ``dim`` from tiled [v0 of every k, v1 of every k, ...] to grouped-by-k order."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], per_k, n_k, head_dim, *shape[dim + 1 :])
    return t.transpose(dim, dim + 1).reshape(shape)


def _untile_deltanet(spec: ModelSpec, leaf: str, t: torch.Tensor) -> torch.Tensor:
    nk, r, dv = spec.linear_k_heads, spec.linear_v_heads // spec.linear_k_heads, spec.linear_v_dim
    qk = 2 * spec.linear_k_heads * spec.linear_k_dim
    if leaf in ("qkv", "conv"):
        return torch.cat([t[:qk], untile(t[qk:], 0, nk, r, dv)])
    if leaf == "z":
        return untile(t, 0, nk, r, dv)
    if leaf in ("b", "a", "dt_bias", "ssm_a"):
        return untile(t, 0, nk, r, 1)
    if leaf == "out":
        return untile(t, 1, nk, r, dv)
    return t


def load_gguf(
    path: str | Path, dtype: torch.dtype, device: torch.device | str = "cpu", progress: bool = True
) -> tuple[ModelSpec, dict[str, torch.Tensor], dict[str, Any]]:
    """Spec, internal weights (``dtype`` on ``device``; DeltaNet scalars fp32) and the file's metadata."""
    f = GGUFFile(path)
    if "token_embd.weight" not in f.tensors:
        f.close()
        raise UnsupportedModelError(f"{f.path.name} holds no weights (a tokenizer-only GGUF)")
    vocab = len(f.meta.get("tokenizer.ggml.tokens", [])) or f.tensors["token_embd.weight"].shape[0]
    freqs = f.tensor("rope_freqs.weight").tolist() if "rope_freqs.weight" in f.tensors else None
    spec = spec_from_gguf(f.meta, vocab, has_output="output.weight" in f.tensors, rope_freqs=freqs)
    weights = {}
    names = [(n, internal_name(n, spec.n_layers)) for n in f.tensors]
    for gguf_name, name in tqdm(
        [x for x in names if x[1]], desc=f"loading {f.path.name}", disable=not progress, unit="tensor"
    ):
        t = convert_tensor(spec, name, torch.from_numpy(f.tensor(gguf_name)))
        keep_fp32 = name.endswith(("ssm_a", "dt_bias"))
        weights[name] = t.to(device=device, dtype=torch.float32 if keep_fp32 else dtype).contiguous()
    f.close()
    return spec, weights, f.meta
