"""NVMe tier faults on real files: each gives the documented miss or error, nothing else is lost."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

from kvmem_bench.store import synthetic_chain
from kvmem_core.blockfile import encode_header, read_block, write_block
from kvmem_core.errors import CapacityError, CorruptBlockError
from kvmem_core.layout import BlockKV, BlockLayout, BlockMeta
from kvmem_core.store import BlockStore

LAYOUT = BlockLayout(n_layers=2, n_kv_heads=1, head_dim=4, n_heads=1, block_tokens=16)


def make_store(path: Path, nvme_bytes: int = 1 << 20, retention: str = "evict-idle") -> BlockStore:
    return BlockStore(LAYOUT, cpu_bytes=1 << 20, nvme_dir=path, nvme_bytes=nvme_bytes, retention=retention)


def stored(path: Path, n_blocks: int = 3, offset: int = 0) -> tuple[BlockStore, str, list[tuple[BlockMeta, BlockKV]]]:
    store = make_store(path)
    ids = np.arange(offset, offset + n_blocks * 16)
    ws, _ = store.open_workspace("ns", ids)
    blocks = synthetic_chain(LAYOUT, ids, "ns")
    for meta, kv in blocks:
        store.append(ws.id, meta, kv)
    store.flush()
    return store, ws.id, blocks


def load_all(store: BlockStore, blocks: list) -> tuple[dict, tuple]:
    result = store.complete_load(store.prepare_load([m.chain_hash for m, _ in blocks]))
    return result.blocks, result.missing


def cold(store: BlockStore, path: Path) -> BlockStore:
    """Drop the host copies by restarting on the same directory."""
    store.close()
    return make_store(path)


def flip_byte(path: Path, offset_from_end: int) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) - offset_from_end] ^= 0x40
    path.write_bytes(bytes(data))


def test_summary_arrays_round_trip_bit_exact(tmp_path):
    meta, kv = synthetic_chain(LAYOUT, np.arange(16), "ns")[0]
    summary = {
        "f16": np.array([1.5, -0.0, np.inf], np.float16),
        "bf16_bits": np.arange(6, dtype=np.uint16).reshape(2, 3),
        "f64": np.array([np.pi]),
        "i64": np.array([-(2**62)]),
        "scalar": np.array(7, np.int8),
        "empty": np.zeros((0, 4), np.float32),
        "nan": np.array([np.nan], np.float32),
    }
    meta = BlockMeta(meta.chain_hash, meta.parent_hash, meta.token_ids, 0, meta.checksum, summary, frozenset({"sink"}))
    with open(tmp_path / f"{meta.chain_hash}.kvb", "wb") as f:
        write_block(f, encode_header(meta, LAYOUT), kv)
    back, back_kv = read_block(tmp_path / f"{meta.chain_hash}.kvb", LAYOUT)
    assert back.tags == {"sink"} and back_kv.k.tobytes() == kv.k.tobytes()
    for name, arr in summary.items():
        assert back.summary[name].dtype == arr.dtype and back.summary[name].shape == arr.shape
        assert back.summary[name].tobytes() == arr.tobytes()


def test_corrupt_payload_byte_is_a_counted_miss_and_cuts_its_workspace_back(tmp_path):
    store, ws_id, blocks = stored(tmp_path)
    store = cold(store, tmp_path)
    flip_byte(store.nvme.path(blocks[1][0].chain_hash), 5)
    got, missing = load_all(store, blocks)
    assert missing == (blocks[1][0].chain_hash,)
    assert sorted(got) == sorted([blocks[0][0].chain_hash, blocks[2][0].chain_hash])
    assert store.metrics()["corrupt"] == 1
    assert store.take_events()[0]["event"] == "corrupt_block"
    assert store.workspaces.get(ws_id).hashes == [blocks[0][0].chain_hash]  # the history after it is recomputed
    assert store.tier(blocks[2][0].chain_hash) is None  # no workspace holds it any more
    ws, match = store.open_workspace("ns", np.arange(48))
    assert match.matched_blocks == 1 and ws.id == ws_id  # the same workspace continues from its first block


def test_corrupt_header_byte_is_dropped_at_start_and_workspace_truncated(tmp_path):
    store, ws_id, blocks = stored(tmp_path)
    other_id, other_blocks = _fill(store, np.arange(500, 548))
    store.close()
    path = store.nvme.path(blocks[2][0].chain_hash)
    flip_byte(path, LAYOUT.kv_bytes_per_block + 10)  # inside the header
    again = make_store(tmp_path)
    assert again.metrics()["corrupt"] == 1 and not path.exists()
    assert again.workspaces.get(ws_id).hashes == [m.chain_hash for m, _ in blocks[:2]]
    assert again.workspaces.get(other_id).hashes == [m.chain_hash for m, _ in other_blocks]
    assert load_all(again, blocks[:2] + other_blocks)[1] == ()


def test_truncated_file_is_missing_at_load_and_at_start(tmp_path):
    store, _, blocks = stored(tmp_path / "load")
    store = cold(store, tmp_path / "load")
    path = store.nvme.path(blocks[0][0].chain_hash)
    os.truncate(path, path.stat().st_size - 100)
    got, missing = load_all(store, blocks)
    assert missing == (blocks[0][0].chain_hash,) and len(got) == 2
    store, _, blocks = stored(tmp_path / "start")
    store.close()
    path = store.nvme.path(blocks[1][0].chain_hash)
    os.truncate(path, 20)
    again = make_store(tmp_path / "start")
    assert again.metrics()["corrupt"] == 1
    assert (
        again.tier(blocks[1][0].chain_hash) is None and again.tier(blocks[2][0].chain_hash) is None
    )  # orphaned after the gap
    short = tmp_path / "short.kvb"
    short.write_bytes(b"KVMEMBLK")
    with pytest.raises(CorruptBlockError, match="truncated prefix"):
        read_block(short, LAYOUT)


def test_deleted_file_is_a_miss(tmp_path):
    store, _, blocks = stored(tmp_path)
    store = cold(store, tmp_path)
    store.nvme.path(blocks[2][0].chain_hash).unlink()
    got, missing = load_all(store, blocks)
    assert missing == (blocks[2][0].chain_hash,) and len(got) == 2
    assert store.metrics()["corrupt"] == 1 and store.metrics()["misses"] == 1


def test_full_quota_keep_all_refuses_and_loses_nothing(tmp_path):
    one = encode_header(synthetic_chain(LAYOUT, np.arange(16), "ns")[0][0], LAYOUT).file_size
    store = make_store(tmp_path, nvme_bytes=3 * one + one // 2, retention="keep-all")
    ids = np.arange(64)
    ws, _ = store.open_workspace("ns", ids)
    blocks = synthetic_chain(LAYOUT, ids, "ns")
    for meta, kv in blocks[:3]:
        store.append(ws.id, meta, kv)
    with pytest.raises(CapacityError, match="keep-all.*raise --kvmem-nvme-gb"):
        store.append(ws.id, *blocks[3])
    store = cold(store, tmp_path)
    got, missing = load_all(store, blocks[:3])
    assert missing == () and len(got) == 3
    assert store.metrics()["nvme_bytes"] == sum(p.stat().st_size for p in store.nvme.blocks_dir.iterdir())


def test_full_quota_evict_idle_removes_the_oldest_workspace_files(tmp_path):
    one = encode_header(synthetic_chain(LAYOUT, np.arange(16), "ns")[0][0], LAYOUT).file_size
    store = make_store(tmp_path, nvme_bytes=3 * one + one // 2)
    old_ws, old_blocks = _fill(store, np.arange(1000, 1032))
    new_ws, _ = _fill(store, np.arange(2000, 2032))
    store.flush()
    assert [w["id"] for w in store.list_workspaces()] == [new_ws]
    assert all(not store.nvme.path(m.chain_hash).exists() for m, _ in old_blocks)
    assert store.metrics()["evicted_workspaces"] == 1 and store.metrics()["nvme_blocks"] == 2


def _fill(store: BlockStore, ids: np.ndarray) -> tuple[str, list]:
    ws, _ = store.open_workspace("ns", ids)
    blocks = synthetic_chain(LAYOUT, ids, "ns")
    for meta, kv in blocks:
        store.append(ws.id, meta, kv)
    return ws.id, blocks


def test_a_failed_write_turns_the_tier_off_and_keeps_the_block_in_ram(tmp_path):
    store = make_store(tmp_path)
    blocks_dir = store.nvme.blocks_dir
    blocks_dir.rmdir()
    blocks_dir.write_bytes(b"")  # a file where the directory was: every write fails
    ws, _ = store.open_workspace("ns", np.arange(16))
    meta, kv = synthetic_chain(LAYOUT, np.arange(16), "ns")[0]
    store.append(ws.id, meta, kv)
    store.flush()  # a disk fault is not raised: the tier is off, the block waits in RAM
    metrics = store.metrics()
    assert (metrics["write_errors"], metrics["nvme_faults"], metrics["nvme_offline"]) == (1, 1, 1)
    assert store.tier(meta.chain_hash) == "host" and metrics["nvme_waiting_blocks"] == 1
    assert metrics["nvme_bytes"] == encode_header(meta, LAYOUT).file_size  # reserved for when the disk is back


def test_several_failed_writes_count_one_fault_and_the_store_still_closes(tmp_path, caplog, monkeypatch):
    store = make_store(tmp_path)
    blocks_dir = store.nvme.blocks_dir
    blocks_dir.rmdir()
    blocks_dir.write_bytes(b"")
    ws, _ = store.open_workspace("ns", np.arange(64))
    chain = synthetic_chain(LAYOUT, np.arange(64), "ns")
    # the writer's results wait until every block is queued: a failure applied between two appends would turn the
    # tier off and keep the later blocks in RAM unwritten (right, but then fewer writes fail than blocks)
    monkeypatch.setattr(store.nvme, "next_done", lambda block: None)
    for meta, kv in chain:
        store.append(ws.id, meta, kv)
    monkeypatch.undo()
    store.flush()
    assert store.metrics()["write_errors"] == len(chain) and store.metrics()["write_queue"] == 0
    assert store.metrics()["nvme_faults"] == 1
    assert len([r for r in caplog.records if r.levelname == "WARNING" and "NVMe tier off" in r.message]) == 1
    closing = threading.Thread(target=store.close, daemon=True)  # every failed job was accounted for
    closing.start()
    closing.join(10)
    assert not closing.is_alive(), "close() still waits for writes that already failed"
    assert all(store.tier(meta.chain_hash) == "host" for meta, _ in chain)


def test_killed_process_leaves_every_completed_block_and_workspace(tmp_path):
    code = textwrap.dedent(f"""
        import os, signal, numpy as np
        from kvmem_bench.store import synthetic_chain
        from kvmem_core.layout import BlockLayout
        from kvmem_core.store import BlockStore
        layout = BlockLayout(n_layers=2, n_kv_heads=1, head_dim=4, n_heads=1, block_tokens=16)
        store = BlockStore(layout, cpu_bytes=1 << 20, nvme_dir={str(tmp_path)!r}, nvme_bytes=1 << 20)
        for offset in (0, 5000):
            ids = np.arange(offset, offset + 80)
            ws, _ = store.open_workspace("ns", ids)
            for meta, kv in synthetic_chain(layout, ids, "ns"):
                store.append(ws.id, meta, kv)
        store.flush()
        print(" ".join(sorted(w["id"] for w in store.list_workspaces())), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == -signal.SIGKILL, out.stderr
    store = make_store(tmp_path)
    assert sorted(w["id"] for w in store.list_workspaces()) == out.stdout.split()
    for offset in (0, 5000):
        blocks = synthetic_chain(LAYOUT, np.arange(offset, offset + 80), "ns")
        got, missing = load_all(store, blocks)
        assert missing == () and all(got[m.chain_hash].v.tobytes() == kv.v.tobytes() for m, kv in blocks)
