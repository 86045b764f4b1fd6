"""NVMe tier throughput against plain sequential file I/O of the same bytes, in one run.

Both sides fsync what they write, and both read cold: after writing, every file of both
is dropped from the page cache (``posix_fadvise(DONTNEED)`` on clean, synced pages), and
the tier reads through a fresh store on the same directory, as after a restart. Rounds
alternate which side goes first; each round gives a ratio, the result is their median.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from kvmem_core.layout import ROOT_HASH, BlockKV, BlockLayout, BlockMeta, chain_hash, kv_checksum
from kvmem_core.store import BlockStore


def synthetic_block(
    layout: BlockLayout, namespace: str, parent: str, token_ids: np.ndarray, start_pos: int, rng: np.random.Generator
) -> tuple[BlockMeta, BlockKV]:
    """A block of random KV with a mean-K summary, chained to ``parent``."""
    k = rng.standard_normal(layout.kv_shape, dtype=np.float32).astype(layout.storage_dtype)
    v = rng.standard_normal(layout.kv_shape, dtype=np.float32).astype(layout.storage_dtype)
    ids = np.asarray(token_ids, dtype=np.int32)
    meta = BlockMeta(
        chain_hash(namespace, parent, ids),
        parent,
        ids,
        start_pos,
        kv_checksum(k, v),
        summary={"mean_k": k.astype(np.float32).mean(axis=1)},
    )
    return meta, BlockKV(k, v)


def synthetic_chain(
    layout: BlockLayout, token_ids: np.ndarray, namespace: str = "bench", seed: int = 0
) -> list[tuple[BlockMeta, BlockKV]]:
    """Blocks for every whole block of ``token_ids``, chained from the root."""
    rng = np.random.default_rng(seed)
    out, parent, n = [], ROOT_HASH, layout.block_tokens
    for start in range(0, len(token_ids) - n + 1, n):
        meta, kv = synthetic_block(layout, namespace, parent, token_ids[start : start + n], start, rng)
        out.append((meta, kv))
        parent = meta.chain_hash
    return out


SMOLLM2 = BlockLayout(n_layers=30, n_kv_heads=3, head_dim=64, n_heads=9, block_tokens=128)


def measure_nvme(
    directory: Path | None = None, layout: BlockLayout = SMOLLM2, n_blocks: int = 128, rounds: int = 5
) -> dict[str, float]:
    """Tier write/read throughput over plain sequential write/read of the same payload bytes.

    Each round times both sides back to back (alternating which goes first) and yields one
    ratio per direction; ``write_ratio``/``read_ratio`` are the medians over rounds, so a
    burst of foreign disk traffic spoils one round, not the result. Also returns the median
    throughputs in GB/s, the bytes moved per side and the start-up scan time of a store
    holding ``n_blocks``. ``directory`` defaults to the system temp directory.
    """
    directory = Path(tempfile.gettempdir()) if directory is None else Path(directory)
    blocks = synthetic_chain(layout, np.arange(n_blocks * layout.block_tokens) % 50000, seed=n_blocks)
    payload = sum(kv.nbytes for _, kv in blocks)
    runs = [
        _round(directory / f"kvmem-bench-{os.getpid()}-{r}", layout, blocks, tier_first=r % 2 == 0)
        for r in range(rounds)
    ]
    med = {k: float(np.median([run[k] for run in runs])) for k in runs[0]}
    return {
        "write_ratio": float(np.median([run["plain_write"] / run["tier_write"] for run in runs])),
        "read_ratio": float(np.median([run["plain_read"] / run["tier_read"] for run in runs])),
        **{k + "_GBps": payload / med[k] / 1e9 for k in ("tier_write", "plain_write", "tier_read", "plain_read")},
        "bytes": payload,
        "blocks": n_blocks,
        "rounds": rounds,
        "scan_s": med["scan"],
    }


def _round(
    root: Path, layout: BlockLayout, blocks: list[tuple[BlockMeta, BlockKV]], tier_first: bool
) -> dict[str, float]:
    """Seconds for each side's write and cold read of ``blocks`` (and the tier's start-up scan)."""
    payload = sum(kv.nbytes for _, kv in blocks)
    root.mkdir(parents=True)
    out: dict[str, float] = {}
    try:
        for side in ("tier", "plain") if tier_first else ("plain", "tier"):
            out[side + "_write"] = _tier_write(root, layout, blocks) if side == "tier" else plain_write(root, blocks)
        drop_page_cache(root)
        for side in ("tier", "plain") if tier_first else ("plain", "tier"):
            if side == "tier":
                out["tier_read"], out["scan"] = _tier_read(root, layout, blocks)
            else:
                out["plain_read"] = plain_read(root, payload)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def measure_host_copy(layout: BlockLayout = SMOLLM2, n_blocks: int = 64) -> float:
    """GB/s of copying block payloads into reused host buffers (a block's trip into the host tier)."""
    blocks = synthetic_chain(layout, np.arange(n_blocks * layout.block_tokens), seed=1)
    dst = np.empty_like(blocks[0][1].k)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _, kv in blocks:
            np.copyto(dst, kv.k)
            np.copyto(dst, kv.v)
        best = min(best, time.perf_counter() - t0)
    return sum(kv.nbytes for _, kv in blocks) / best / 1e9


def _store(root: Path, layout: BlockLayout, payload: int) -> BlockStore:
    return BlockStore(
        layout, cpu_bytes=2 * payload + (1 << 20), nvme_dir=root / "tier", nvme_bytes=4 * payload + (1 << 30)
    )


def _tier_write(root: Path, layout: BlockLayout, blocks: list[tuple[BlockMeta, BlockKV]]) -> float:
    store = _store(root, layout, sum(kv.nbytes for _, kv in blocks))
    ws, _ = store.open_workspace("bench", np.zeros(0, dtype=np.int32))
    t0 = time.perf_counter()
    for meta, kv in blocks:
        store.append(ws.id, meta, kv)
    store.flush()
    elapsed = time.perf_counter() - t0
    store.close()
    return elapsed


def _tier_read(root: Path, layout: BlockLayout, blocks: list[tuple[BlockMeta, BlockKV]]) -> tuple[float, float]:
    t0 = time.perf_counter()
    store = _store(root, layout, sum(kv.nbytes for _, kv in blocks))
    t1 = time.perf_counter()
    result = store.complete_load(store.prepare_load([m.chain_hash for m, _ in blocks]))
    t2 = time.perf_counter()
    store.close()
    assert not result.missing and len(result.blocks) == len(blocks)
    return t2 - t1, t1 - t0


def plain_write(root: Path, blocks: list[tuple[BlockMeta, BlockKV]]) -> float:
    """Seconds to write the blocks' K and V as one fsynced file ``root/plain.bin`` (the raw baseline)."""
    t0 = time.perf_counter()
    with open(root / "plain.bin", "wb") as f:
        for _, kv in blocks:
            f.write(kv.k.data)
            f.write(kv.v.data)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def plain_read(root: Path, payload: int) -> float:
    """Seconds to read ``payload`` bytes of ``root/plain.bin`` in one call (the raw baseline)."""
    t0 = time.perf_counter()
    buf = np.empty(payload, dtype=np.uint8)
    with open(root / "plain.bin", "rb", buffering=0) as f:
        assert f.readinto(buf.data) == payload
    return time.perf_counter() - t0


def drop_page_cache(root: Path) -> None:
    """Ask the kernel to drop cached pages of every file under ``root``, so the next read hits the disk."""
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
