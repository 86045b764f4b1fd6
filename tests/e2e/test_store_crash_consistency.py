"""Crash consistency of the NVMe tier: a writer process growing, flushing and deleting conversations is killed
with SIGKILL at a random moment, 50 times over one directory (200 with the slow checks), as a server that keeps
crashing would be. After every kill the next start finds each block it indexes whole and equal to what was written
(never a wrong payload), every block a workspace names on disk, no orphan or temp file, and every conversation at
least as long as the last flush the writer acknowledged before the kill."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from kvmem_bench.store import synthetic_chain
from kvmem_core.layout import BlockLayout
from kvmem_core.store import BlockStore

LAYOUT = BlockLayout(n_layers=2, n_kv_heads=1, head_dim=4, n_heads=1, block_tokens=16)
CONVERSATIONS = 8
MAX_BLOCKS = 24  # a conversation that would pass this is deleted and begun again
STRIDE = 100_000  # conversation c's tokens start at c * STRIDE


def store_at(path: Path) -> BlockStore:
    return BlockStore(LAYOUT, cpu_bytes=64 * LAYOUT.kv_bytes_per_block, nvme_dir=path, nvme_bytes=1 << 24, fsync=False)


def expected(c: int, n_blocks: int) -> list:
    ids = np.arange(c * STRIDE, c * STRIDE + n_blocks * LAYOUT.block_tokens, dtype=np.int32)
    return synthetic_chain(LAYOUT, ids, "ns", seed=c)


def grow(store: BlockStore, c: int, n_blocks: int) -> str:
    """Conversation ``c`` extended to ``n_blocks`` (a prefix already stored is matched, the rest appended)."""
    blocks = expected(c, n_blocks)
    ids = np.concatenate([m.token_ids for m, _ in blocks])
    ws, _ = store.open_workspace("ns", ids)
    for meta, kv in blocks[len(ws.hashes) :]:
        store.append(ws.id, meta, kv)
    return ws.id


def lengths(store: BlockStore) -> dict[int, tuple[str, int]]:
    """Each stored conversation's workspace and block count, told apart by its first token."""
    out = {}
    for ws in store.workspaces.all():
        if ws.hashes:
            c = int(store.lookup(ws.hashes[0]).token_ids[0]) // STRIDE
            if len(ws.hashes) >= out.get(c, ("", 0))[1]:
                out[c] = (ws.id, len(ws.hashes))
    return out


def writer(path: Path, seed: int, report: int) -> None:
    """Grow random conversations, flush now and then and report what the flush made durable ("ack C N"); announce
    a deletion before making it ("del C"). Runs until killed."""
    rng = random.Random(seed)
    store = store_at(path)
    known = {c: n for c, (_, n) in lengths(store).items()}
    os.write(report, b"ready\n")
    while True:
        c = rng.randrange(CONVERSATIONS)
        n = known.get(c, 0) + rng.randint(1, 3)
        if n > MAX_BLOCKS:
            os.write(report, f"del {c}\n".encode())
            store.delete_workspace(lengths(store)[c][0])
            known[c] = 0
            continue
        grow(store, c, n)
        known[c] = n
        if rng.random() < 0.3:
            store.flush()
            os.write(report, "".join(f"ack {k} {v}\n" for k, v in known.items()).encode())


def run_once(path: Path, seed: int, durable: dict[int, int]) -> None:
    """One writer killed at a random moment; ``durable`` (conversation -> blocks) follows its reports."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the writer: never returns into pytest
        os.close(read)
        try:
            writer(path, seed, write)
        finally:
            os._exit(1)
    os.close(write)
    with os.fdopen(read) as reports:
        assert reports.readline() == "ready\n"
        time.sleep(random.Random(seed).uniform(0.0, 0.06))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        for line in reports.read().splitlines():
            verb, c, *n = line.split()
            durable[int(c)] = int(n[0]) if verb == "ack" else 0


def check(path: Path, durable: dict[int, int]) -> None:
    store = store_at(path)
    try:
        store.flush()
        named = {h for ws in store.workspaces.all() for h in ws.hashes}
        files = {p.name for p in store.nvme.blocks_dir.iterdir()}
        assert files == {store.nvme.path(h).name for h in named}  # no orphan, no temp file, nothing named missing
        loaded = store.complete_load(store.prepare_load(sorted(named)))
        assert not loaded.missing
        found = lengths(store)
        for c, (ws_id, n) in found.items():
            for (meta, kv), h in zip(expected(c, n), store.workspaces.get(ws_id).hashes):
                assert meta.chain_hash == h
                got = loaded.blocks[h]
                assert np.array_equal(got.k, kv.k) and np.array_equal(got.v, kv.v)
        for c, n in durable.items():
            assert found.get(c, ("", 0))[1] >= n, f"conversation {c} lost blocks a flush had made durable"
    finally:
        store.close()


@pytest.mark.parametrize("runs", [50, pytest.param(200, marks=pytest.mark.slow)])
def test_an_nvme_tier_killed_again_and_again_mid_writes_keeps_every_durable_block_whole(
    tmp_path: Path, runs: int
) -> None:
    durable: dict[int, int] = {}
    for run in range(runs):
        run_once(tmp_path, run, durable)
        check(tmp_path, durable)
    assert sum(durable.values()) > 0  # the writers got far enough to flush
