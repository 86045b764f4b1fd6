"""Parse and synthesize llama.cpp sequence-state blobs (``llama_state_seq_get_data``).

Format (llama-kv-cache.cpp ``state_write``), all little-endian:
u32 magic 0xAF143CD8, i32 seq id, u32 n_stream; per stream: u32 cell_count;
per cell {i32 pos, u32 n_seq_id = 1, i32 seq_id};
u32 v_trans, u32 n_layer; K per layer {i32 type, u64 row_bytes, cell_count rows};
V per layer {i32 type, u64 row_bytes, rows} (v_trans 0) or
{i32 type, u32 el_bytes, u32 n_embd_v, n_embd_v x cell_count elements} (v_trans 1).
Cells come in cell-slot order; ``parse`` sorts them by position. A q8_0 cache's rows are kept as their raw
bytes (uint8, ``q8_0``): 34 bytes per 32 values; its V is never transposed (llama.cpp quantizes V only
under flash attention).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kvmem_core.errors import UnsupportedModelError
from kvmem_core.layout import Q8_0_GROUP, Q8_0_GROUP_BYTES

MAGIC = 0xAF143CD8
GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_Q8_0 = 0, 1, 8  # ggml's tensor type ids, as the blobs and contexts name them
_DTYPES = {GGML_TYPE_F32: np.dtype("<f4"), GGML_TYPE_F16: np.dtype("<f2"), GGML_TYPE_Q8_0: np.dtype("u1")}
_CELL = np.dtype([("pos", "<i4"), ("n_seq", "<u4"), ("seq", "<i4")])


@dataclass(frozen=True, eq=False)
class SeqKV:
    """Cells of one sequence sorted by position: K and V ``[layers, cells, n_embd_kv]`` (q8_0: ``[layers, cells,
    row bytes]`` uint8)."""

    positions: np.ndarray  # int32 [cells]
    k: np.ndarray
    v: np.ndarray


def _dtype(type_id: int) -> np.dtype:
    if type_id not in _DTYPES:
        raise UnsupportedModelError(
            f"KV cache type {type_id} is not supported by this adapter yet (f16, f32 and q8_0 are)"
        )
    return _DTYPES[type_id]


class _Reader:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.off = buf, 0

    def scalar(self, fmt: str) -> int:
        dt = np.dtype(fmt)
        value = np.frombuffer(self.buf, dtype=dt, count=1, offset=self.off)[0]
        self.off += dt.itemsize
        return int(value)

    def array(self, dtype: np.dtype, count: int) -> np.ndarray:
        out = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.off)
        self.off += out.nbytes
        return out


def parse(buf: memoryview, n_layer: int, n_embd_kv: int) -> tuple[SeqKV, int]:
    """Cells of a one-stream blob sorted by position, and the blob's v_trans flag. Copies out of ``buf``."""
    r = _Reader(buf)
    assert r.scalar("<u4") == MAGIC, "not a llama.cpp sequence-state blob"
    r.scalar("<i4")
    assert r.scalar("<u4") == 1, "unified KV cache expected (one stream)"
    n = r.scalar("<u4")
    cells = r.array(_CELL, n)
    assert n == 0 or (cells["n_seq"] == 1).all()
    v_trans, layers = r.scalar("<u4"), r.scalar("<u4")
    assert layers == n_layer, (layers, n_layer)
    order = np.argsort(cells["pos"], kind="stable")
    k = _layers(r, n_layer, n, n_embd_kv, transposed=False)
    v = _layers(r, n_layer, n, n_embd_kv, transposed=bool(v_trans))
    assert r.off == len(buf), "trailing bytes in sequence blob"
    if (np.diff(order) == 1).all():  # cells already in position order: one plain copy each
        return SeqKV(cells["pos"].copy(), np.ascontiguousarray(k), np.ascontiguousarray(v)), v_trans
    return SeqKV(cells["pos"][order].copy(), k[:, order], v[:, order]), v_trans


def _layers(r: _Reader, n_layer: int, n: int, width: int, transposed: bool) -> np.ndarray:
    """A strided [layers, cells, width] view over every layer's rows (each layer has a 12-byte header)."""
    type_id = int(np.frombuffer(r.buf, "<i4", 1, r.off)[0])
    dt = _dtype(type_id)
    if type_id == GGML_TYPE_Q8_0:
        assert not transposed, "a q8_0 V cache is never transposed"
        width = width // Q8_0_GROUP * Q8_0_GROUP_BYTES
    header = np.frombuffer(r.buf, "<u4", 2, r.off + 4)
    if transposed:
        assert header[0] == dt.itemsize and header[1] == width, "unexpected V layout"
    else:
        assert int(np.frombuffer(r.buf, "<u8", 1, r.off + 4)[0]) == width * dt.itemsize, "unexpected row size"
    item, stride = dt.itemsize, 12 + n * width * dt.itemsize
    inner = (item, n * item) if transposed else (width * item, item)
    view = np.ndarray((n_layer, n, width), dtype=dt, buffer=r.buf, offset=r.off + 12, strides=(stride, *inner))
    r.off += n_layer * stride
    return view


def dims(buf: memoryview) -> tuple[int, int]:
    """(layers, K values per cell) of a one-stream blob holding at least one cell: what ``parse`` is told."""
    r = _Reader(buf)
    r.off = 12  # magic, sequence id, stream count
    n_cells = r.scalar("<u4")
    r.off += n_cells * _CELL.itemsize + 4  # the cells, v_trans
    n_layer, type_id, row_bytes = r.scalar("<u4"), r.scalar("<i4"), r.scalar("<u8")
    if type_id == GGML_TYPE_Q8_0:
        return n_layer, row_bytes // Q8_0_GROUP_BYTES * Q8_0_GROUP
    return n_layer, row_bytes // _dtype(type_id).itemsize


def tiled(seed: SeqKV, n_cells: int) -> list[SeqKV]:
    """Runs for ``synthesize`` that repeat ``seed``'s rows at positions 0..n_cells-1."""
    step = seed.positions.size
    return [
        SeqKV(np.arange(a, a + n, dtype=np.int32), seed.k[:, :n], seed.v[:, :n])
        for a, n in ((a, min(step, n_cells - a)) for a in range(0, n_cells, step))
    ]


def blob_size(n_cells: int, n_layer: int, row_bytes: int) -> int:
    """Bytes of a blob holding ``n_cells`` cells of ``row_bytes`` per layer for K and for V (K and V layer headers
    are 12 bytes either way)."""
    return 24 + n_cells * _CELL.itemsize + n_layer * (24 + 2 * n_cells * row_bytes)


def synthesize(out: np.ndarray, seq: int, runs: Sequence[SeqKV], v_trans: int) -> int:
    """Write the cells of ``runs`` (one after another, in position order) as a blob for sequence ``seq`` into
    ``out`` (uint8, large enough); return its size. Each run's rows are copied once, straight into ``out``."""
    n_layer, _, width = runs[0].k.shape
    dt = runs[0].k.dtype
    type_id = next(t for t, d in _DTYPES.items() if d == dt)
    n = sum(run.positions.size for run in runs)
    w = _Writer(out)
    w.put(np.array([MAGIC, seq, 1, n], dtype="<u4"))
    cells = np.empty(n, dtype=_CELL)
    cells["pos"], cells["n_seq"], cells["seq"] = np.concatenate([run.positions for run in runs]), 1, seq
    w.put(cells)
    w.put(np.array([v_trans, n_layer], dtype="<u4"))
    row_hdr = np.array([type_id], "<i4").tobytes() + np.array([width * dt.itemsize], "<u8").tobytes()
    for il in range(n_layer):
        w.put(row_hdr)
        w.rows([run.k[il] for run in runs])
    vt_hdr = np.array([type_id], "<i4").tobytes() + np.array([dt.itemsize, width], "<u4").tobytes()
    for il in range(n_layer):
        w.put(vt_hdr if v_trans else row_hdr)
        w.rows([run.v[il] for run in runs], transposed=bool(v_trans))
    return w.off


class _Writer:
    """Appends to a uint8 buffer: raw parts, and the rows of [cells, width] arrays."""

    def __init__(self, out: np.ndarray) -> None:
        self.out, self.off = out, 0

    def put(self, part: bytes | np.ndarray) -> None:
        raw = np.frombuffer(part, dtype=np.uint8) if isinstance(part, bytes) else part.view(np.uint8).reshape(-1)
        self.out[self.off : self.off + raw.size] = raw
        self.off += raw.size

    def rows(self, parts: Sequence[np.ndarray], transposed: bool = False) -> None:
        """The parts' rows one after another, each copied once; ``transposed``: as the columns of one [width,
        cells] array (llama.cpp's transposed V)."""
        dtype, cells, width = parts[0].dtype, sum(len(p) for p in parts), parts[0].shape[1]
        size = cells * width * dtype.itemsize
        region = self.out[self.off : self.off + size].view(dtype)
        region = region.reshape(width, cells).T if transposed else region.reshape(cells, width)
        self.off += size
        row = 0
        for part in parts:
            region[row : row + len(part)] = part
            row += len(part)
