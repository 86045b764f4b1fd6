"""A failing disk under the NVMe tier (full, read-only, I/O errors): the tier turns off, the store serves from
host RAM, nothing stored is lost, and writes resume once the disk takes them again.

Faults are injected (``OSError`` from the writer) and, where this process may mount one, made real on a
small tmpfs: filled until ``ENOSPC``, remounted read-only (``EROFS``).
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
from disk_support import remount, small_tmpfs

import kvmem_core.nvme as nvme_module
from kvmem_bench.store import synthetic_chain
from kvmem_core.errors import CapacityError
from kvmem_core.layout import BlockLayout
from kvmem_core.store import BlockStore

LAYOUT = BlockLayout(n_layers=4, n_kv_heads=2, head_dim=64, n_heads=2, block_tokens=32)  # 64 KiB of KV a block
BLOCK = LAYOUT.block_tokens


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_store(
    path: Path,
    clock: Clock | None = None,
    retry_s: float = 30.0,
    cpu_bytes: int = 64 << 20,
    retention: str = "evict-idle",
) -> BlockStore:
    return BlockStore(
        LAYOUT,
        cpu_bytes=cpu_bytes,
        nvme_dir=path,
        nvme_bytes=1 << 30,
        retention=retention,
        clock=clock or Clock(),
        nvme_retry_s=retry_s,
    )


def append_chain(store: BlockStore, ids: np.ndarray, upto: int | None = None) -> tuple[str, list]:
    ws, match = store.open_workspace("ns", ids)
    chain = synthetic_chain(LAYOUT, ids, "ns")
    for meta, kv in chain[match.matched_blocks : upto]:
        store.append(ws.id, meta, kv)
    return ws.id, chain


def assert_all_stored(store: BlockStore, ws_id: str, chain: list) -> None:
    """The workspace holds the whole chain and every block loads bit-exact."""
    assert store.workspaces.get(ws_id).hashes == [m.chain_hash for m, _ in chain]
    result = store.complete_load(store.prepare_load([m.chain_hash for m, _ in chain]))
    assert result.missing == ()
    assert all(result.blocks[m.chain_hash].k.tobytes() == kv.k.tobytes() for m, kv in chain)


@pytest.fixture
def failing_disk(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """While the list holds an errno, every file the NVMe writer publishes fails with it."""
    fault: list[int] = []
    publish = nvme_module._publish

    def faulty(job):  # noqa: ANN001 - the writer's private job type
        if fault and job.write is not None:
            raise OSError(fault[0], f"injected: {errno.errorcode[fault[0]]}")
        publish(job)

    monkeypatch.setattr(nvme_module, "_publish", faulty)
    return fault


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO, errno.EROFS, errno.EDQUOT])
def test_injected_fault_turns_the_tier_off_steps_go_on_and_it_comes_back(tmp_path, failing_disk, code, caplog):
    clock = Clock()
    store = make_store(tmp_path, clock)
    ids = np.arange(6 * BLOCK)
    ws_id, chain = append_chain(store, ids, upto=2)
    store.flush()
    failing_disk.append(code)
    append_chain(store, ids, upto=6)
    store.flush()  # no error reaches the caller
    assert store.metrics()["nvme_offline"] == 1 and store.metrics()["nvme_waiting_blocks"] == 4
    assert_all_stored(store, ws_id, chain)  # the step goes on: two blocks from disk or RAM, four from RAM
    failing_disk.clear()
    clock.now += 10
    store.flush()
    assert store.metrics()["nvme_offline"] == 1  # not retried before its time
    clock.now += 25
    store.flush()
    assert store.metrics()["nvme_offline"] == 0 and store.metrics()["nvme_waiting_blocks"] == 0
    assert all(store.tier(m.chain_hash) == "host+nvme" for m, _ in chain)
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert (
        len(warnings) == 1
        and "NVMe tier off" in warnings[0].message
        and "continue from host RAM" in warnings[0].message
    )
    store.close()
    assert_all_stored(make_store(tmp_path), ws_id, chain)  # after a restart, everything from disk


def test_a_failed_retry_stays_off_quietly_until_the_next(tmp_path, failing_disk, caplog):
    clock = Clock()
    store = make_store(tmp_path, clock)
    failing_disk.append(errno.ENOSPC)
    ws_id, chain = append_chain(store, np.arange(3 * BLOCK))
    store.flush()
    clock.now += 31
    store.flush()  # retried, failed again
    metrics = store.metrics()
    assert (metrics["nvme_offline"], metrics["nvme_faults"], metrics["nvme_waiting_blocks"]) == (1, 1, 3)
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1
    failing_disk.clear()
    clock.now += 31
    store.flush()
    assert store.metrics()["nvme_offline"] == 0
    store.close()
    assert_all_stored(make_store(tmp_path), ws_id, chain)


def test_ram_full_of_blocks_waiting_for_the_disk_evicts_idle_workspaces(tmp_path, failing_disk):
    kv_bytes = LAYOUT.kv_bytes_per_block
    store = make_store(tmp_path, cpu_bytes=5 * kv_bytes)
    failing_disk.append(errno.ENOSPC)
    old_id, _ = append_chain(store, np.arange(3 * BLOCK))
    new_id, chain = append_chain(store, np.arange(1000, 1000 + 3 * BLOCK))
    assert [w["id"] for w in store.list_workspaces()] == [new_id]
    assert store.metrics()["evicted_workspaces"] == 1
    assert_all_stored(store, new_id, chain)
    assert old_id != new_id


def test_ram_full_of_waiting_blocks_under_keep_all_refuses_with_the_cause(tmp_path, failing_disk):
    store = make_store(tmp_path, cpu_bytes=3 * LAYOUT.kv_bytes_per_block, retention="keep-all")
    failing_disk.append(errno.ENOSPC)
    ws_id, chain = append_chain(store, np.arange(3 * BLOCK))
    store.flush()
    with pytest.raises(CapacityError, match="NVMe tier, which is off after a disk fault.*free disk space"):
        store.append(ws_id, *synthetic_chain(LAYOUT, np.arange(4 * BLOCK), "ns")[3])
    assert_all_stored(store, ws_id, chain)  # nothing already stored was lost


# -- a real small filesystem ------------------------------------------------------------


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    with small_tmpfs(tmp_path / "mnt", "1m") as mount:
        yield mount


def test_a_real_full_disk_turns_the_tier_off_and_freed_space_brings_it_back(small_fs):
    clock = Clock()
    store = make_store(small_fs / "nvme", clock)
    ballast = small_fs / "ballast"
    ballast.write_bytes(b"\0" * (600 << 10))
    ws_id, chain = append_chain(store, np.arange(12 * BLOCK))  # ~800 KB of block files: no room for all
    store.flush()
    assert store.metrics()["nvme_offline"] == 1 and store.metrics()["nvme_waiting_blocks"] > 0
    assert_all_stored(store, ws_id, chain)
    ballast.unlink()
    clock.now += 31
    store.flush()
    assert store.metrics()["nvme_offline"] == 0 and store.metrics()["nvme_waiting_blocks"] == 0
    store.close()
    assert_all_stored(make_store(small_fs / "nvme"), ws_id, chain)


def test_a_real_read_only_disk_turns_the_tier_off_until_it_is_writable(small_fs):
    clock = Clock()
    store = make_store(small_fs / "nvme", clock)
    ids = np.arange(4 * BLOCK)
    ws_id, chain = append_chain(store, ids, upto=2)
    store.flush()
    remount(small_fs, "ro")
    try:
        append_chain(store, ids)
        store.flush()
        assert store.metrics()["nvme_offline"] == 1
        assert_all_stored(store, ws_id, chain)
    finally:
        remount(small_fs, "rw")
    clock.now += 31
    store.flush()
    assert store.metrics()["nvme_offline"] == 0
    store.close()
    assert_all_stored(make_store(small_fs / "nvme"), ws_id, chain)
