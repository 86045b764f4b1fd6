"""The self-describing block file of the NVMe tier.

Layout (little-endian)::

    prefix   magic b"KVMEMBLK" | u32 version | u32 header_len | u64 arrays_len | u64 payload_len
    header   JSON: layout hash, KV dtype, chain/parent hash, start, checksum, tags, array directory
    arrays   token ids then every summary array, raw bytes in C order
    u32      CRC32 of prefix + header + arrays
    payload  K bytes then V bytes; their CRC32 is the block checksum kept in the header

A scan reads everything but the payload, so the index is rebuilt without touching KV;
a load checks the payload against the header's checksum. Any mismatch (magic, version,
layout, size, CRC) raises ``CorruptBlockError``: the block is missing, never garbage. A file whose KV
dtype is not the layout's (``float16`` blocks read by an ``fp8_e4m3`` store, say) raises
``BlockDtypeError`` naming both, before its bytes are looked at: 8-bit codes are never read as 16-bit
values or the other way round.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from kvmem_core.errors import BlockDtypeError, CorruptBlockError
from kvmem_core.layout import BlockKV, BlockLayout, BlockMeta, kv_checksum

MAGIC = b"KVMEMBLK"
VERSION = 1
SUFFIX = ".kvb"
_PREFIX = struct.Struct("<8sIIQQ")
_CRC = struct.Struct("<I")


@dataclass(frozen=True)
class EncodedHeader:
    """Everything before the payload, ready to write; ``file_size`` is the whole file's size."""

    data: bytes
    payload_len: int

    @property
    def file_size(self) -> int:
        return len(self.data) + self.payload_len


def encode_header(meta: BlockMeta, layout: BlockLayout) -> EncodedHeader:
    """Serialize a block's meta (summary arrays bit-exact) for a file holding its KV."""
    arrays = {"token_ids": np.asarray(meta.token_ids), **{"summary." + k: v for k, v in meta.summary.items()}}
    directory, chunks, offset = {}, [], 0
    for name, arr in arrays.items():
        arr = np.asarray(arr)
        assert arr.dtype.kind in "biufc", f"summary {name!r} has non-numeric dtype {arr.dtype}"
        directory[name] = {"dtype": arr.dtype.str, "shape": list(arr.shape), "offset": offset}
        chunks.append(arr.tobytes())
        offset += arr.nbytes
    header = json.dumps(
        {
            "layout": layout.layout_hash(),
            "dtype": layout.dtype,
            "chain_hash": meta.chain_hash,
            "parent_hash": meta.parent_hash,
            "start_pos": meta.start_pos,
            "checksum": meta.checksum,
            "tags": sorted(meta.tags),
            "arrays": directory,
        }
    ).encode()
    payload_len = layout.kv_bytes_per_block
    head = _PREFIX.pack(MAGIC, VERSION, len(header), offset, payload_len) + header + b"".join(chunks)
    return EncodedHeader(head + _CRC.pack(zlib.crc32(head)), payload_len)


def write_block(f: BinaryIO, header: EncodedHeader, kv: BlockKV) -> None:
    """Write header then K and V straight from their buffers (no copy when contiguous)."""
    f.write(header.data)
    f.write(np.ascontiguousarray(kv.k).data)
    f.write(np.ascontiguousarray(kv.v).data)


def read_meta(path: Path, layout: BlockLayout) -> tuple[BlockMeta, int]:
    """Read and verify a file's header; return the meta and the file's size."""
    with open(path, "rb") as f:
        meta, _, size = _read_header(f, path, layout)
    return meta, size


def read_block(path: Path, layout: BlockLayout) -> tuple[BlockMeta, BlockKV]:
    """Read a whole block; CorruptBlockError unless every check passes."""
    with open(path, "rb", buffering=0) as f:
        meta, head_len, size = _read_header(f, path, layout)
        payload = np.empty(size - head_len, dtype=np.uint8)
        if f.readinto(payload.data) != payload.nbytes:
            raise CorruptBlockError(f"{path.name}: payload truncated")
    half = payload.nbytes // 2
    dtype = layout.storage_dtype
    k = payload[:half].view(dtype).reshape(layout.kv_shape)
    v = payload[half:].view(dtype).reshape(layout.kv_shape)
    if kv_checksum(k, v) != meta.checksum:
        raise CorruptBlockError(f"{path.name}: payload checksum mismatch")
    return meta, BlockKV(k, v)


def _read_header(f: BinaryIO, path: Path, layout: BlockLayout) -> tuple[BlockMeta, int, int]:
    size = os.fstat(f.fileno()).st_size
    prefix = f.read(_PREFIX.size)
    if len(prefix) != _PREFIX.size:
        raise CorruptBlockError(f"{path.name}: truncated prefix")
    magic, version, header_len, arrays_len, payload_len = _PREFIX.unpack(prefix)
    if magic != MAGIC or version != VERSION:
        raise CorruptBlockError(f"{path.name}: bad magic or version {version}")
    head_len = _PREFIX.size + header_len + arrays_len + _CRC.size
    rest = f.read(head_len - _PREFIX.size)
    if len(rest) != head_len - _PREFIX.size or size < head_len:
        raise CorruptBlockError(f"{path.name}: size {size} does not match its header")
    if zlib.crc32(rest[: -_CRC.size], zlib.crc32(prefix)) != _CRC.unpack(rest[-_CRC.size :])[0]:
        raise CorruptBlockError(f"{path.name}: header checksum mismatch")
    info = json.loads(rest[:header_len])
    stored = info.get("dtype", layout.dtype)  # files written before the dtype was recorded: the layout hash decides
    if stored != layout.dtype:
        raise BlockDtypeError(f"{path.name}: its KV is {stored}, this store's is {layout.dtype}; refusing to read it")
    if size != head_len + payload_len or payload_len != layout.kv_bytes_per_block:
        raise CorruptBlockError(f"{path.name}: size {size} does not match its header")
    return _parse_meta(info, rest[header_len : -_CRC.size], path, layout), head_len, size


def _parse_meta(info: dict, arrays: bytes, path: Path, layout: BlockLayout) -> BlockMeta:
    if info["layout"] != layout.layout_hash():
        raise CorruptBlockError(f"{path.name}: layout {info['layout']} is not {layout.layout_hash()}")
    loaded = {}
    for name, d in info["arrays"].items():
        dtype = np.dtype(d["dtype"])
        count = int(np.prod(d["shape"], dtype=np.int64))
        flat = np.frombuffer(arrays, dtype=dtype, count=count, offset=d["offset"])
        loaded[name] = flat.reshape(tuple(d["shape"])).copy()
    summary = {k.removeprefix("summary."): v for k, v in loaded.items() if k.startswith("summary.")}
    return BlockMeta(
        chain_hash=info["chain_hash"],
        parent_hash=info["parent_hash"],
        token_ids=loaded["token_ids"],
        start_pos=info["start_pos"],
        checksum=info["checksum"],
        summary=summary,
        tags=frozenset(info["tags"]),
    )
