"""A workspace as one file a user can move to another server: its blocks' token ids, metadata and KV.

The file is an uncompressed tar::

    workspace.json      {"format": "kvmem-workspace", "version": 1, "model_id", "namespace", "layout",
                         "workspace": {"id", "key", "pinned", "created", "last_used", "last_selection"},
                         "tokens", "blocks": [{"file", "hash", "tokens"}]}
    blocks/000000.kvb   one file per block, in order, in the NVMe tier's self-describing format
    blocks/000001.kvb   (``kvmem_core.blockfile``: token ids, start position, tags, summaries,
    ...                 K and V; CRC32 over the header and over the payload)

Reading checks before any block is used: the format and version, the namespace (model
fingerprint and KV layout: a file from another model is a ``ModelMismatchError``), then per
block its file's checks and the chain (block i's hash is ``chain_hash(namespace, hash of
block i-1, its token ids)``), so a damaged or edited file is refused, never half-trusted.
"""

from __future__ import annotations

import io
import json
import re
import tarfile
import tempfile
from pathlib import Path
from types import TracebackType
from typing import Any, Callable, Iterator, Sequence

from kvmem_core.blockfile import encode_header, read_block, write_block
from kvmem_core.errors import CorruptBlockError, KVMemError, ModelMismatchError, WorkspaceFileError
from kvmem_core.layout import ROOT_HASH, BlockKV, BlockLayout, BlockMeta, chain_hash

FORMAT, VERSION = "kvmem-workspace", 1
HEADER = "workspace.json"
MAX_HEADER_BYTES = 64 << 20
_BLOCK_NAME = re.compile(r"blocks/\d{6}\.kvb")


def block_name(index: int) -> str:
    return f"blocks/{index:06d}.kvb"


def write_workspace(
    path: Path,
    header: dict[str, Any],
    metas: Sequence[BlockMeta],
    load: Callable[[BlockMeta], BlockKV],
    layout: BlockLayout,
) -> None:
    """Write ``header`` (the model and workspace fields) and the blocks ``metas`` name, each loaded in turn."""
    entries = [{"file": block_name(i), "hash": m.chain_hash, "tokens": m.n_tokens} for i, m in enumerate(metas)]
    header = {
        "format": FORMAT,
        "version": VERSION,
        **header,
        "tokens": sum(m.n_tokens for m in metas),
        "blocks": entries,
    }
    try:
        with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
            _add(tar, HEADER, json.dumps(header, indent=1).encode())
            for i, meta in enumerate(metas):
                buf = io.BytesIO()
                write_block(buf, encode_header(meta, layout), load(meta))
                _add(tar, block_name(i), buf.getvalue())
    except OSError as exc:
        raise KVMemError(f"cannot write the workspace file: {exc}") from None


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


class WorkspaceReader:
    """An exported workspace file, opened and checked (see the module docstring); ``header`` is its
    ``workspace.json``, ``blocks()`` yields each block once it passed its checks."""

    def __init__(self, path: Path, layout: BlockLayout, namespace: str) -> None:
        self.layout, self.namespace = layout, namespace
        try:
            self.tar = tarfile.open(path, "r:")
        except (OSError, tarfile.TarError) as exc:
            raise WorkspaceFileError(f"not a KVMem workspace file (a tar archive): {exc}") from None
        try:
            self.header = self._header()
        except BaseException:
            self.tar.close()
            raise

    def __enter__(self) -> WorkspaceReader:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.tar.close()

    def _header(self) -> dict[str, Any]:
        try:
            header = json.loads(self._member(HEADER, MAX_HEADER_BYTES))
        except (ValueError, RecursionError) as exc:
            raise WorkspaceFileError(f"{HEADER} is not JSON: {exc}") from None
        if not isinstance(header, dict) or header.get("format") != FORMAT or header.get("version") != VERSION:
            raise WorkspaceFileError(f"not a {FORMAT} file of version {VERSION}")
        if header.get("namespace") != self.namespace:
            raise ModelMismatchError(
                f"the workspace was exported from model {header.get('model_id')!r} with "
                f"namespace {header.get('namespace')!r}; this server runs namespace "
                f"{self.namespace!r} (same model file and KV layout needed)"
            )
        blocks = header.get("blocks")
        if (
            not isinstance(blocks, list)
            or not isinstance(header.get("workspace"), dict)
            or not all(
                isinstance(b, dict) and isinstance(b.get("file"), str) and _BLOCK_NAME.fullmatch(b["file"])
                for b in blocks
            )
        ):
            raise WorkspaceFileError(f"{HEADER} lacks its workspace or block list")
        return header

    def blocks(self) -> Iterator[tuple[BlockMeta, BlockKV]]:
        parent = ROOT_HASH
        limit = 4 * self.layout.kv_bytes_per_block + (16 << 20)  # the KV plus generous room for ids and summaries
        with tempfile.TemporaryDirectory(prefix="kvmem-import-") as tmp:
            for i, entry in enumerate(self.header["blocks"]):
                meta, kv = self._block(Path(tmp) / "block.kvb", entry, limit)
                if (
                    meta.n_tokens != self.layout.block_tokens
                    or meta.parent_hash != parent
                    or chain_hash(self.namespace, parent, meta.token_ids) != meta.chain_hash
                    or entry.get("hash") != meta.chain_hash
                ):
                    raise WorkspaceFileError(f"block {i} does not continue the blocks before it (edited or reordered)")
                parent = meta.chain_hash
                yield meta, kv

    def _block(self, path: Path, entry: dict[str, Any], limit: int) -> tuple[BlockMeta, BlockKV]:
        data = self._member(entry["file"], limit)
        try:
            path.write_bytes(data)
            return read_block(path, self.layout)
        except (
            CorruptBlockError,
            OSError,
            ValueError,
            KeyError,
            TypeError,
            IndexError,
        ) as exc:  # the file is untrusted
            raise WorkspaceFileError(f"{entry['file']} failed its checks: {exc}") from None

    def _member(self, name: str, limit: int) -> bytes:
        try:
            info = self.tar.getmember(name)
            if not info.isfile() or info.size > limit:
                raise WorkspaceFileError(f"{name} in the workspace file is not a file of at most {limit} bytes")
            f = self.tar.extractfile(info)
            assert f is not None
            return f.read()
        except KeyError:
            raise WorkspaceFileError(f"the workspace file has no {name}") from None
        except (OSError, tarfile.TarError, ValueError) as exc:
            raise WorkspaceFileError(f"cannot read {name} from the workspace file: {exc}") from None
