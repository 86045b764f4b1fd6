"""Stores of several processes (server replicas) sharing one NVMe directory: adoption on a miss, own manifests,
restarts that leave the others' files alone, temp files unique per process."""

from __future__ import annotations

import os

import numpy as np
from test_store import LAYOUT, Clock, fill, tokens

from kvmem_bench.store import synthetic_chain
from kvmem_core.store import BlockStore


def shared_store(path, owner: str) -> BlockStore:
    return BlockStore(
        LAYOUT,
        cpu_bytes=8 * LAYOUT.kv_bytes_per_block,
        nvme_dir=path,
        nvme_bytes=1 << 20,
        clock=Clock(),
        nvme_owner=owner,
    )


def test_a_conversation_moves_to_another_store_with_its_blocks(tmp_path):
    a, b = shared_store(tmp_path, "r0"), shared_store(tmp_path, "r1")
    ids = tokens(3)
    _, blocks = fill(a, ids)
    a.flush()
    ws, match = b.open_workspace("ns", np.concatenate([ids, tokens(1, 9000)]))
    assert match.matched_blocks == 3 and ws.hashes == [m.chain_hash for m, _ in blocks]
    assert b.tier(blocks[0][0].chain_hash) == "nvme"
    loaded = b.complete_load(b.prepare_load(ws.hashes))
    assert not loaded.missing
    for meta, kv in blocks:
        assert np.array_equal(loaded.blocks[meta.chain_hash].k, kv.k)
    for store in (a, b):
        store.close()


def test_each_store_keeps_its_own_workspaces_and_a_restart_leaves_the_others_files(tmp_path):
    a, b = shared_store(tmp_path, "r0"), shared_store(tmp_path, "r1")
    a_ws, a_blocks = fill(a, tokens(2, 1000))
    b_ws, _ = fill(b, tokens(2, 2000))
    for store in (a, b):
        store.close()
    again = shared_store(tmp_path, "r0")
    assert [w["id"] for w in again.list_workspaces()] == [a_ws]
    assert again.metrics()["orphans_removed"] == 0
    assert again.metrics()["blocks"] == 2
    b_again = shared_store(tmp_path, "r1")
    assert [w["id"] for w in b_again.list_workspaces()] == [b_ws]
    assert not b_again.complete_load(b_again.prepare_load(b_again.workspaces.get(b_ws).hashes)).missing
    assert all(again.nvme.path(m.chain_hash).exists() for m, _ in a_blocks)
    for store in (again, b_again):
        store.close()


def test_a_block_missing_on_disk_is_not_adopted(tmp_path):
    a, b = shared_store(tmp_path, "r0"), shared_store(tmp_path, "r1")
    ids = tokens(2)
    _, blocks = fill(a, ids)
    a.flush()
    a.nvme.path(blocks[1][0].chain_hash).unlink()
    ws, match = b.open_workspace("ns", ids)
    assert match.matched_blocks == 1 and b.metrics()["blocks"] == 1
    for store in (a, b):
        store.close()


def test_the_scan_keeps_a_live_writers_temp_file_and_removes_a_dead_ones(tmp_path):
    store = shared_store(tmp_path, "r0")
    store.close()
    blocks_dir = store.nvme.blocks_dir
    live = blocks_dir / f"x.kvb.{os.getppid()}.tmp"  # another live process: the one that started this test run
    dead = blocks_dir / "y.kvb.999999999.tmp"
    old = blocks_dir / "z.kvb.tmp"
    for p in (live, dead, old):
        p.write_bytes(b"partial")
    shared_store(tmp_path, "r1").close()
    assert live.exists() and not dead.exists() and not old.exists()


def test_two_stores_writing_the_same_block_leave_one_valid_file(tmp_path):
    a, b = shared_store(tmp_path, "r0"), shared_store(tmp_path, "r1")
    ids = tokens(2)
    opened = [(store, store.open_workspace("ns", ids)[0]) for store in (a, b)]  # before either has written
    for store, ws in opened:
        for meta, kv in synthetic_chain(LAYOUT, ids, "ns"):
            store.append(ws.id, meta, kv)
        store.flush()
    names = sorted(p.name for p in a.nvme.blocks_dir.iterdir())
    assert len(names) == 2 and all(n.endswith(".kvb") for n in names)
    assert sorted(os.listdir(a.nvme.root / "workspaces")) == ["r0", "r1"]
    c = shared_store(tmp_path, "r2")
    ws, match = c.open_workspace("ns", ids)
    assert match.matched_blocks == 2
    for store in (a, b, c):
        store.close()
