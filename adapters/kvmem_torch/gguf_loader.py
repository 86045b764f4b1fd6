"""GGUF files to the internal layout: one fast header pass, tensors dequantized lazily.

The header (key/values, vocabulary included, and tensor infos) is parsed once with
``struct`` over a memory map; tensor bytes are read only when a tensor is loaded and
dequantized with the ``gguf`` package (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K ...).
llama.cpp's converter quirks are undone here: Llama Q/K rows are un-permuted, qwen35
DeltaNet V heads go from tiled back to grouped order. Its ``+1`` on norms and
``ssm_a = -exp(A_log)`` already match the internal layout. MTP layers are skipped.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from kvmem_core.errors import ModelNotFoundError, UnsupportedModelError
from kvmem_torch.spec import ModelSpec, spec_from_gguf

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_GLOBAL = {"token_embd.weight": "embed", "output_norm.weight": "norm", "output.weight": "lm_head"}
_LAYER = {
    "attn_norm": "attn_norm", "ffn_norm": "mlp_norm", "post_attention_norm": "mlp_norm",
    "attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o", "attn_q_norm": "q_norm", "attn_k_norm": "k_norm",
    "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down", "attn_qkv": "qkv", "attn_gate": "z",
    "ssm_beta": "b", "ssm_alpha": "a", "ssm_out": "out", "ssm_conv1d": "conv", "ssm_dt": "dt_bias",
    "ssm_a": "ssm_a", "ssm_norm": "ssm_norm",
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (rows first), i.e. GGUF dims reversed
    qtype: int
    offset: int  # absolute byte offset in the file


class GGUFFile:
    """A GGUF file's metadata and tensor directory; ``tensor(name)`` dequantizes to float32."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file not found: {path}")
        self.path = path
        with open(path, "rb") as f:
            self.buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if self.buf[:4] != b"GGUF":
            raise UnsupportedModelError(f"{path} is not a GGUF file")
        self.pos = 4
        version, n_tensors, n_kv = self._read("<I"), self._read("<Q"), self._read("<Q")
        if version < 2:
            raise UnsupportedModelError(f"GGUF version {version} is too old")
        self.meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.meta[key] = self._value(self._read("<I"))
        infos = [self._tensor_info() for _ in range(n_tensors)]
        align = self.meta.get("general.alignment", 32)
        data_start = -(-self.pos // align) * align
        self.tensors = {n: TensorInfo(n, s, q, data_start + o) for n, s, q, o in infos}

    def _read(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._read("<Q")
        s = self.buf[self.pos:self.pos + n].decode("utf-8", errors="replace")
        self.pos += n
        return s

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            etype, n = self._read("<I"), self._read("<Q")
            if etype == _STRING:
                return [self._string() for _ in range(n)]
            fmt = _SCALARS[etype]
            arr = np.frombuffer(self.buf, dtype=np.dtype(fmt), count=n, offset=self.pos).tolist()
            self.pos += n * struct.calcsize(fmt)
            return arr
        return self._read(_SCALARS[vtype])

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        dims = [self._read("<Q") for _ in range(self._read("<I"))]
        return name, tuple(reversed(dims)), self._read("<I"), self._read("<Q")

    def tensor(self, name: str) -> np.ndarray:
        """Dequantized float32 copy of one tensor, numpy order."""
        from gguf import GGMLQuantizationType, dequantize
        from gguf.constants import GGML_QUANT_SIZES

        info = self.tensors[name]
        qtype = GGMLQuantizationType(info.qtype)
        block, type_size = GGML_QUANT_SIZES[qtype]
        row_bytes = info.shape[-1] // block * type_size
        n_rows = int(np.prod(info.shape[:-1], dtype=np.int64))
        raw = np.frombuffer(self.buf, dtype=np.uint8, count=n_rows * row_bytes, offset=info.offset)
        raw = raw.reshape(*info.shape[:-1], row_bytes)
        return np.array(dequantize(raw, qtype), dtype=np.float32).reshape(info.shape)  # a copy: the map may close

    def close(self) -> None:
        self.buf.close()


def internal_name(gguf_name: str, n_layers: int) -> str | None:
    """Internal name for a GGUF tensor, None for tensors not used (MTP layers, unknown extras)."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    parts = gguf_name.split(".")
    if parts[0] != "blk" or int(parts[1]) >= n_layers or parts[2] not in _LAYER:
        return None
    return f"layers.{parts[1]}.{_LAYER[parts[2]]}"


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
    t = t.reshape(*shape[:dim], per_k, n_k, head_dim, *shape[dim + 1:])
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


def load_gguf(path: str | Path, dtype: torch.dtype, device: torch.device | str = "cpu",
              progress: bool = True) -> tuple[ModelSpec, dict[str, torch.Tensor], dict[str, Any]]:
    """Spec, internal weights (``dtype`` on ``device``; DeltaNet scalars fp32) and the file's metadata."""
    f = GGUFFile(path)
    vocab = len(f.meta.get("tokenizer.ggml.tokens", [])) or f.tensors["token_embd.weight"].shape[0]
    freqs = f.tensor("rope_freqs.weight").tolist() if "rope_freqs.weight" in f.tensors else None
    spec = spec_from_gguf(f.meta, vocab, has_output="output.weight" in f.tensors, rope_freqs=freqs)
    weights = {}
    names = [(n, internal_name(n, spec.n_layers)) for n in f.tensors]
    for gguf_name, name in tqdm([x for x in names if x[1]], desc=f"loading {f.path.name}", disable=not progress,
                                unit="tensor"):
        t = convert_tensor(spec, name, torch.from_numpy(f.tensor(gguf_name)))
        keep_fp32 = name.endswith(("ssm_a", "dt_bias"))
        weights[name] = t.to(device=device, dtype=torch.float32 if keep_fp32 else dtype).contiguous()
    f.close()
    return spec, weights, f.meta
