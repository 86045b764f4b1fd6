"""Recurrent-state checkpoints of a tiny random qwen35 count in the store's budgets: their RAM in the host tier,
their files in the NVMe tier; a workspace evicted or deleted takes its checkpoints along (RAM and files); at a
restart the files on disk are counted again and those of workspaces gone are removed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from test_hybrid_kvmem import FITS, make_engine, model, step, tokens  # noqa: E402,F401

from kvmem_core.checkpoint_files import CheckpointFiles  # noqa: E402
from kvmem_core.config import GIB  # noqa: E402
from kvmem_core.engine import KVMemEngine  # noqa: E402
from kvmem_core.store import BlockStore  # noqa: E402
from kvmem_torch.adapter import TorchAdapter  # noqa: E402


def engine_on(path: Path, nvme: Path, nvme_bytes: int, adapter: TorchAdapter | None = None) -> KVMemEngine:
    cfg = FITS.replace(nvme_dir=nvme)
    adapter = adapter or TorchAdapter(path, view_tokens=cfg.view_tokens, block_tokens=16, device="cpu", progress=False)
    store = BlockStore(adapter.layout, cpu_bytes=int(cfg.cpu_gb * GIB), nvme_dir=nvme, nvme_bytes=nvme_bytes)
    return KVMemEngine(adapter, cfg, heads=((0, 0),), store=store)


def stop(engine: KVMemEngine) -> None:
    """Close an engine's store and checkpoint files, keeping its adapter for the next engine (a restart)."""
    engine.checkpoints.close()
    engine.store.close()


def ledger(engine: KVMemEngine) -> tuple[set[str], set[str]]:
    """The workspaces with checkpoints in RAM, and with checkpoint files."""
    cps = engine.checkpoints
    return {c.ws_id for c in cps._items.values()}, {ws for _, ws in cps.files.index.values()}


def file_bytes(engine: KVMemEngine) -> int:
    return sum(p.stat().st_size for p in engine.checkpoints.files.dir.glob("*.npz"))


def test_checkpoints_count_in_ram_and_on_disk_and_go_with_a_deleted_workspace(model, tmp_path: Path) -> None:
    engine = engine_on(model[1], tmp_path / "nvme", 1 << 30)
    result = step(engine, tokens(50, seed=1))
    engine.store.flush()
    m = engine.store.metrics()
    state = sum(a.nbytes for a in engine.adapter.state_arrays(engine.adapter.save_state()).values())
    assert m["side_host_bytes"] == len(engine.checkpoints._items) * state > 0
    blocks_in_ram = sum(engine.store.host.get(h).nbytes for h in engine.store.host.hashes())
    assert m["host_bytes"] == blocks_in_ram + m["side_host_bytes"]
    engine.checkpoints.files._pool.submit(lambda: None).result()  # the writes queued before have landed
    assert m["side_nvme_bytes"] >= file_bytes(engine) > 0
    assert m["nvme_bytes"] == sum(engine.store.nvme.sizes.values()) + m["side_nvme_bytes"]
    assert engine.delete_workspace(result.workspace_id)
    m = engine.store.metrics()
    assert m["side_host_bytes"] == m["side_nvme_bytes"] == 0 and ledger(engine) == (set(), set())
    engine.close()
    assert file_bytes(engine) == 0


def test_an_evicted_workspace_takes_its_checkpoints_and_a_restart_counts_the_files(model, tmp_path: Path) -> None:
    probe = engine_on(model[1], tmp_path / "probe", 1 << 30)
    step(probe, tokens(50, seed=1))
    blocks, side = sum(probe.store.nvme.sizes.values()), probe.store.metrics()["side_nvme_bytes"]
    stop(probe)
    assert side > blocks  # a budget of 1.5 conversations' blocks alone would hold two
    engine = engine_on(model[1], tmp_path / "nvme", int(1.5 * (blocks + side)), probe.adapter)
    a = step(engine, tokens(50, seed=1)).workspace_id
    b = step(engine, tokens(50, seed=2)).workspace_id
    assert [w["id"] for w in engine.list_workspaces()] == [b]
    assert ledger(engine) == ({b}, {b})
    assert engine.store.metrics()["nvme_bytes"] <= engine.store.nvme.capacity
    stop(engine)
    orphan = CheckpointFiles(tmp_path / "nvme", engine.namespace)
    orphan.put(b"\x01" * 16, 16, a, {"rec": np.zeros(4, dtype=np.float32)})  # a workspace gone before the crash
    orphan.close()
    again = engine_on(model[1], tmp_path / "nvme", int(1.5 * (blocks + side)), probe.adapter)
    assert ledger(again)[1] == {b}
    again.checkpoints.files._pool.submit(lambda: None).result()
    assert again.store.metrics()["side_nvme_bytes"] == file_bytes(again) > 0
    result = step(again, tokens(50, seed=2) + tokens(5, seed=3))
    assert result.cached_tokens >= 48  # resumed from the counted checkpoints
    again.close()
