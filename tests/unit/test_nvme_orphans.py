"""Orphaned NVMe block files (a crash cut their manifest update short) are collected at start, and only those:
never a file another owner's manifest names (replicas, or the replicas one engine follows), never a young one in a
shared directory, nothing while a manifest cannot be read. A writer killed with SIGKILL leaves no orphan behind
the next start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from test_store import LAYOUT, Clock, fill, tokens

from kvmem_core.store import BlockStore

OLD = time.time() - 3600


def store_at(path: Path, owner: str = "") -> BlockStore:
    return BlockStore(
        LAYOUT,
        cpu_bytes=8 * LAYOUT.kv_bytes_per_block,
        nvme_dir=path,
        nvme_bytes=1 << 20,
        clock=Clock(),
        nvme_owner=owner,
    )


def crash_orphans(path: Path, owner: str, n_blocks: int, offset: int, age: float = OLD) -> list[str]:
    """Blocks a store wrote whose manifest never landed (removed here, as a crash before its write leaves it);
    their files are dated ``age``."""
    store = store_at(path, owner)
    ws_id, blocks = fill(store, tokens(n_blocks, offset))
    store.close()
    (store.nvme.ws_dir / f"{ws_id}.json").unlink()
    hashes = [m.chain_hash for m, _ in blocks]
    for h in hashes:
        os.utime(store.nvme.path(h), (age, age))
    return hashes


def on_disk(store: BlockStore, hashes: list[str]) -> list[bool]:
    return [store.nvme.path(h).exists() for h in hashes]


def test_a_replicas_crash_orphans_are_collected_and_the_others_blocks_kept(tmp_path: Path) -> None:
    other = store_at(tmp_path, "r1")
    kept_ws, kept = fill(other, tokens(2, 5000))
    other.close()
    young = crash_orphans(tmp_path, "r0", 1, 9000, age=time.time())
    orphans = crash_orphans(tmp_path, "r0", 3, 1000)
    again = store_at(tmp_path, "r0")
    again.flush()
    assert again.metrics()["orphans_removed"] == 3
    assert on_disk(again, orphans) == [False] * 3
    assert on_disk(again, young) == [True]  # its replica's manifest may be on its way
    assert on_disk(again, [m.chain_hash for m, _ in kept]) == [True, True]
    assert again.metrics()["blocks"] == 0 and again.metrics()["nvme_bytes"] == 0  # the others' are not indexed
    again.close()
    r1 = store_at(tmp_path, "r1")
    assert not r1.complete_load(r1.prepare_load(r1.workspaces.get(kept_ws).hashes)).missing
    r1.close()


def test_one_engine_after_replicas_keeps_their_blocks_and_continues_their_conversations(tmp_path: Path) -> None:
    replicas = [store_at(tmp_path, f"r{i}") for i in range(2)]
    filled = [fill(store, tokens(2, 1000 * (i + 1))) for i, store in enumerate(replicas)]
    for store in replicas:
        store.close()
    orphans = crash_orphans(tmp_path, "", 2, 7000)
    one = store_at(tmp_path)
    one.flush()
    assert one.metrics()["orphans_removed"] == 2 and on_disk(one, orphans) == [False, False]
    for _, blocks in filled:
        assert on_disk(one, [m.chain_hash for m, _ in blocks]) == [True, True]
    ids = np.concatenate([tokens(2, 1000), tokens(1, 9500)])
    ws, match = one.open_workspace("ns", ids)
    assert match.matched_blocks == 2  # adopted from the replica's files
    assert not one.complete_load(one.prepare_load(ws.hashes)).missing
    one.close()
    for i, (ws_id, _) in enumerate(filled):  # and the replicas come back whole
        back = store_at(tmp_path, f"r{i}")
        assert not back.complete_load(back.prepare_load(back.workspaces.get(ws_id).hashes)).missing
        back.close()


def test_an_unreadable_manifest_of_another_owner_keeps_every_file(tmp_path: Path) -> None:
    orphans = crash_orphans(tmp_path, "", 2, 3000)
    bad = tmp_path / LAYOUT.layout_hash() / "workspaces" / "r0" / "ws-0000000000000000.json"
    bad.parent.mkdir(parents=True)
    bad.write_text("{not json")
    again = store_at(tmp_path)
    again.flush()
    assert again.metrics()["orphans_removed"] == 0 and on_disk(again, orphans) == [True, True]
    again.close()


WRITER = """
import sys, numpy as np
sys.path[:0] = sys.argv[2:]
from test_store import LAYOUT, Clock, fill, tokens
from kvmem_core.store import BlockStore
store = BlockStore(LAYOUT, cpu_bytes=8 * LAYOUT.kv_bytes_per_block, nvme_dir=sys.argv[1], nvme_bytes=1 << 26,
                   clock=Clock(), fsync=False)
print("ready", flush=True)
for i in range(100000):
    fill(store, tokens(4, 100000 * i))
"""


def test_a_writer_killed_mid_writes_leaves_no_orphan_after_the_next_start(tmp_path: Path) -> None:
    here = Path(__file__).resolve()
    paths = [str(here.parent), *sys.path]
    for run in range(3):
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(tmp_path), *paths], stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.3 + 0.2 * run)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        again = store_at(tmp_path)
        again.flush()
        named = {h for ws in again.workspaces.all() for h in ws.hashes}
        files = {p.stem for p in again.nvme.blocks_dir.iterdir()}
        assert named and files == named  # no orphan, no temp file, no manifest past a missing block
        loaded = again.complete_load(again.prepare_load(sorted(named)))
        assert not loaded.missing
        again.close()
