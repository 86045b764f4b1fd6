"""Block layout, block values and the content-addressing chain hash.

A block holds ``block_tokens`` consecutive tokens of one workspace: per attention layer
K and V, the token ids, the original start position, scoring summaries and span tags.
Blocks are content-addressed: the chain hash covers (namespace, parent hash, token ids),
so equal prefixes give equal hashes and can be shared between workspaces.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from dataclasses import dataclass, field
from typing import Mapping, Sequence, overload

import numpy as np

ROOT_HASH = "0" * 32
_STORAGE_DTYPES = {
    "float16": np.float16,
    "float32": np.float32,
    "bfloat16": np.uint16,
    "fp8_e4m3": np.uint8,
    "q8_0": np.uint8,
}
FP8_SCALE_BYTES = 4  # fp8_e4m3: each token's head row ends with its float32 scale
Q8_0_GROUP, Q8_0_GROUP_BYTES = 32, 34  # q8_0 (ggml): a float16 scale then 32 int8 values per 32 values
# what a dtype's stored rows hold, where it changed: q8_0 rows come from a llama.cpp cache made with its attention
# rotation off (kvmem_llamacpp.lowlevel.unrotated_kv); rows stored from a rotated cache before hash apart, so their
# files and workspaces are never read into an unrotated view (they stay on disk, unread)
_ROW_FRAMES = {"q8_0": "unrotated"}


@dataclass(frozen=True)
class BlockLayout:
    """Shape of one block's KV: attention layers only (recurrent layers keep their own state)."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    n_heads: int
    block_tokens: int = 128
    dtype: str = "float16"

    def __post_init__(self) -> None:
        assert self.dtype in _STORAGE_DTYPES, f"unsupported KV dtype {self.dtype}"
        assert self.n_heads % self.n_kv_heads == 0, "query heads must group evenly over kv heads"
        assert self.dtype != "q8_0" or self.head_dim % Q8_0_GROUP == 0, "q8_0 needs head dims in groups of 32"

    @property
    def quantized(self) -> bool:
        """Whether K/V are stored as 8-bit codes with scales (raw bytes to every tier)."""
        return self.dtype in ("fp8_e4m3", "q8_0")

    @property
    def head_row(self) -> int:
        """Storage elements of one token's one kv head: ``head_dim`` values, or an 8-bit row with its scales."""
        if self.dtype == "fp8_e4m3":
            return self.head_dim + FP8_SCALE_BYTES
        if self.dtype == "q8_0":
            return self.head_dim // Q8_0_GROUP * Q8_0_GROUP_BYTES
        return self.head_dim

    @property
    def storage_dtype(self) -> np.dtype:
        """numpy dtype of stored K/V (bfloat16 is kept as raw uint16 bits)."""
        return np.dtype(_STORAGE_DTYPES[self.dtype])

    @property
    def kv_shape(self) -> tuple[int, int, int, int]:
        """Shape of one block's K (and V): [layers, tokens, kv heads, ``head_row``]."""
        return (self.n_layers, self.block_tokens, self.n_kv_heads, self.head_row)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.n_layers * self.n_kv_heads * self.head_row * self.storage_dtype.itemsize

    @property
    def kv_bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_tokens

    @property
    def group_size(self) -> int:
        """Query heads per kv head (GQA)."""
        return self.n_heads // self.n_kv_heads

    def layout_hash(self) -> str:
        """Stable 16-hex digest of the layout (and of what its rows hold, ``_ROW_FRAMES``); stored in every block
        file, and naming the NVMe tier's folder."""
        frame = {"rows": _ROW_FRAMES[self.dtype]} if self.dtype in _ROW_FRAMES else {}
        text = json.dumps({**self.__dict__, **frame}, sort_keys=True).encode()
        return hashlib.blake2b(text, digest_size=8).hexdigest()


def chain_hash(namespace: str, parent_hash: str, token_ids: np.ndarray | list[int]) -> str:
    """Hash of (namespace, parent hash, token ids): a block's content address."""
    ids = np.asarray(token_ids, dtype=np.int32)
    h = hashlib.blake2b(digest_size=16)
    h.update(namespace.encode())
    h.update(bytes.fromhex(parent_hash))
    h.update(ids.tobytes())
    return h.hexdigest()


class MetaView(Sequence["BlockMeta"]):
    """The metas of the blocks ``hashes[:n]`` names, then of ``extra``, each looked up when read: a step that reads
    only the blocks new since its last (the index, the spans) leaves the thousands of others of a 1M-token workspace
    untouched, where a list of them walks every one cold in memory. Valid while ``hashes`` keeps its first ``n``."""

    def __init__(
        self, hashes: Sequence[str], n: int, metas: Mapping[str, BlockMeta], extra: Sequence[BlockMeta] = ()
    ) -> None:
        self._hashes, self._n, self._metas, self._extra = hashes, n, metas, extra

    def plus(self, extra: Sequence[BlockMeta]) -> MetaView:
        """These metas, then ``extra``."""
        return MetaView(self._hashes, self._n, self._metas, [*self._extra, *extra])

    def __len__(self) -> int:
        return self._n + len(self._extra)

    @overload
    def __getitem__(self, i: int) -> BlockMeta: ...
    @overload
    def __getitem__(self, i: slice) -> list[BlockMeta]: ...
    def __getitem__(self, i: int | slice) -> BlockMeta | list[BlockMeta]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        j = i + len(self) if i < 0 else i
        if not 0 <= j < len(self):
            raise IndexError(i)
        return self._metas[self._hashes[j]] if j < self._n else self._extra[j - self._n]


def starts_with(metas: Sequence[BlockMeta], hashes: Sequence[str]) -> bool:
    """Whether ``metas`` begin with the blocks whose chain hashes are ``hashes``: a chain hash names every block
    before it, so the last one tells."""
    return len(metas) >= len(hashes) and (not hashes or metas[len(hashes) - 1].chain_hash == hashes[-1])


def kv_checksum(k: np.ndarray, v: np.ndarray) -> int:
    """CRC32 over a block's K then V bytes."""
    return zlib.crc32(np.ascontiguousarray(v).data, zlib.crc32(np.ascontiguousarray(k).data))


@dataclass(frozen=True, eq=False)
class BlockKV:
    """A block's payload: K and V, each [layers, tokens, kv heads, head dim] in engine frame."""

    k: np.ndarray
    v: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def checksum(self) -> int:
        return kv_checksum(self.k, self.v)


@dataclass(frozen=True, eq=False)
class BlockMeta:
    """Everything about a block except its KV; kept in RAM for every stored block.

    ``summary`` maps names to arrays the scorers read (mean pre-RoPE K, sub-block means,
    prototypes, the retrieval-heads index keys), so scoring never loads KV.
    """

    chain_hash: str
    parent_hash: str
    token_ids: np.ndarray
    start_pos: int
    checksum: int
    summary: dict[str, np.ndarray] = field(default_factory=dict)
    tags: frozenset[str] = frozenset()

    @property
    def n_tokens(self) -> int:
        return int(len(self.token_ids))

    @property
    def end_pos(self) -> int:
        return self.start_pos + self.n_tokens
