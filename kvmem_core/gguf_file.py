"""A GGUF file's header (key/values, vocabulary included, tensor directory) in one fast pass.

``struct`` over a memory map, numpy only, so both engines' adapters can read metadata and
small tensors without torch; larger tensors are dequantized with the ``gguf`` package. The RoPE
divisors a GGUF file implies live here too, so no adapter needs another adapter to compute them.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from kvmem_core.errors import ModelNotFoundError, UnsupportedModelError

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_F32 = 0


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
        s = self.buf[self.pos : self.pos + n].decode("utf-8", errors="replace")
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
        n = int(np.prod(info.shape, dtype=np.int64))
        if info.qtype == _F32:  # no dequantization (and no ``gguf`` package) needed
            return np.frombuffer(self.buf, dtype="<f4", count=n, offset=info.offset).reshape(info.shape).copy()
        qtype = GGMLQuantizationType(info.qtype)
        block, type_size = GGML_QUANT_SIZES[qtype]
        row_bytes = info.shape[-1] // block * type_size
        n_rows = int(np.prod(info.shape[:-1], dtype=np.int64))
        raw = np.frombuffer(self.buf, dtype=np.uint8, count=n_rows * row_bytes, offset=info.offset)
        raw = raw.reshape(*info.shape[:-1], row_bytes)
        return np.array(dequantize(raw, qtype), dtype=np.float32).reshape(info.shape)  # a copy: the map may close

    def close(self) -> None:
        self.buf.close()


def gguf_rope_factors(
    meta: Mapping[str, Any], arch: str, rotary_dim: int, freqs: list[float] | None
) -> tuple[float, ...]:
    """Divisors from GGUF metadata (``rope.scaling.type`` none/linear) and the ``rope_freqs`` tensor, as
    llama.cpp combines them: theta = pos * base^(-2i/d) * freq_scale / freq_factor_i."""
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind not in ("none", "linear"):
        raise UnsupportedModelError(f"GGUF rope scaling {kind!r} is not supported (have: none, linear, rope_freqs)")
    scale = float(meta.get(f"{arch}.rope.scaling.factor", 1.0)) if kind == "linear" else 1.0
    if freqs is None and scale == 1.0:
        return ()
    return tuple(float(f) * scale for f in (freqs or [1.0] * (rotary_dim // 2)))
