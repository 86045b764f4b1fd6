"""The portable workspace file: what is written reads back bit for bit; another model's or a damaged file is refused."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from kvmem_bench.store import synthetic_chain
from kvmem_core.errors import ModelMismatchError, WorkspaceFileError
from kvmem_core.layout import BlockLayout
from kvmem_core.portable import HEADER, WorkspaceReader, block_name, write_workspace

LAYOUT = BlockLayout(n_layers=2, n_kv_heads=1, head_dim=4, n_heads=1, block_tokens=16)
NS = "model-fingerprint:layout"
FIELDS = {
    "id": "ws-" + "c" * 16,
    "key": "chat-1",
    "pinned": True,
    "created": 1.0,
    "last_used": 2.0,
    "last_selection": {},
}


def exported(tmp_path: Path, n_blocks: int = 3) -> tuple[Path, list]:
    blocks = synthetic_chain(LAYOUT, np.arange(n_blocks * LAYOUT.block_tokens, dtype=np.int32), NS, 0)
    kv = {m.chain_hash: b for m, b in blocks}
    path = tmp_path / "ws.tar"
    write_workspace(
        path,
        {"model_id": "m", "namespace": NS, "workspace": FIELDS},
        [m for m, _ in blocks],
        lambda m: kv[m.chain_hash],
        LAYOUT,
    )
    return path, blocks


def rewrite(path: Path, edit: Callable[[str, bytes], bytes]) -> None:
    """Replace every member of the tar at ``path`` by ``edit(name, data)``."""
    with tarfile.open(path) as tar:
        members = [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            data = edit(name, data)
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def read_all(path: Path, namespace: str = NS) -> tuple[dict, list]:
    with WorkspaceReader(path, LAYOUT, namespace) as reader:
        return reader.header, list(reader.blocks())


def test_a_written_workspace_reads_back_bit_for_bit(tmp_path: Path) -> None:
    path, blocks = exported(tmp_path)
    header, back = read_all(path)
    assert header["workspace"] == FIELDS and header["tokens"] == 3 * LAYOUT.block_tokens
    assert [b["file"] for b in header["blocks"]] == [block_name(i) for i in range(3)]
    for (meta, kv), (meta2, kv2) in zip(blocks, back):
        assert (meta2.chain_hash, meta2.parent_hash, meta2.start_pos, meta2.checksum) == (
            meta.chain_hash,
            meta.parent_hash,
            meta.start_pos,
            meta.checksum,
        )
        assert np.array_equal(meta2.token_ids, meta.token_ids)
        assert np.array_equal(kv2.k, kv.k) and np.array_equal(kv2.v, kv.v)


def test_another_models_file_is_a_mismatch_before_any_block_is_read(tmp_path: Path) -> None:
    path, _ = exported(tmp_path)
    with pytest.raises(ModelMismatchError, match="namespace"):
        read_all(path, namespace="other-model:layout")


def flip_payload(name: str, data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 1]) if name == block_name(1) else data


def swap_blocks(name: str, data: bytes) -> bytes:
    if name != HEADER:
        return data
    header = json.loads(data)
    header["blocks"][0]["file"], header["blocks"][1]["file"] = header["blocks"][1]["file"], header["blocks"][0]["file"]
    return json.dumps(header).encode()


def drop_header(name: str, data: bytes) -> bytes:
    return b"{not json" if name == HEADER else data


@pytest.mark.parametrize(
    "edit, why", [(flip_payload, "checksum"), (swap_blocks, "does not continue"), (drop_header, "not JSON")]
)
def test_a_damaged_or_edited_file_is_refused(tmp_path: Path, edit: Callable[[str, bytes], bytes], why: str) -> None:
    path, _ = exported(tmp_path)
    rewrite(path, edit)
    with pytest.raises(WorkspaceFileError, match=why):
        read_all(path)


def test_what_is_not_a_workspace_file_is_refused(tmp_path: Path) -> None:
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"hello" * 100)
    with pytest.raises(WorkspaceFileError, match="tar"):
        read_all(junk)
    empty = tmp_path / "empty.tar"
    tarfile.open(empty, "w").close()
    with pytest.raises(WorkspaceFileError, match="no workspace.json"):
        read_all(empty)
