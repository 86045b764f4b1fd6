"""The block store: metas in RAM, payloads in the host tier and/or the NVMe tier, workspaces.

Without an NVMe directory the host tier holds everything and is what retention bounds.
With one, every completed block is written through to disk in the background; the disk
is what retention bounds and the host tier is an LRU cache over it whose entries leave
only once they are on disk and unpinned. Loads are two-phase: ``prepare_load`` pins and
starts reading, ``complete_load`` returns the payloads and unpins. A block whose file
fails a check is dropped, logged and counted, and reported missing.

With an ``nvme_owner`` the directory is shared with other stores (server replicas, one per
process): each keeps its own workspaces, indexes at start only the blocks they hold, and on
a prefix miss adopts the blocks another wrote (chain hashes name the files), so a
conversation moves between replicas without prefilling again.

One caller thread drives a store (the engine serializes steps); background threads only
do file I/O and hand results back through a queue.

``BlockStore`` is this module's façade over mixins that share its state (``store_state``): ``store_capacity``
(budgets, eviction), ``store_disk`` (write-through, disk faults, restart), ``store_side``
(side data in the budgets) and ``store_load`` (loads, lost blocks, adopted blocks).
"""

from __future__ import annotations

import itertools
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from kvmem_core.blockfile import encode_header
from kvmem_core.config import GIB, KVMemConfig
from kvmem_core.host import HostTier
from kvmem_core.layout import ROOT_HASH, BlockKV, BlockLayout, BlockMeta, MetaView
from kvmem_core.nvme import NvmeTier
from kvmem_core.policy import EvictionPolicy, LRUPolicy
from kvmem_core.store_capacity import CapacityMixin
from kvmem_core.store_disk import NVME_RETRY_S, ORPHAN_GRACE_S, DiskState, WriteThroughMixin
from kvmem_core.store_load import LoadMixin
from kvmem_core.store_side import SideDataMixin
from kvmem_core.workspace import PrefixMatch, Route, Workspace, WorkspaceRegistry, describe, detail

REPLICA_ENV = "KVMEM_REPLICA"
RETRY_ENV = "KVMEM_NVME_RETRY_S"


class BlockStore(CapacityMixin, WriteThroughMixin, SideDataMixin, LoadMixin):
    """Blocks of every workspace across the host and NVMe tiers; see the module docstring."""

    def __init__(
        self,
        layout: BlockLayout,
        *,
        cpu_bytes: int,
        nvme_dir: Path | None = None,
        nvme_bytes: int = 0,
        retention: str = "evict-idle",
        policy: EvictionPolicy | None = None,
        clock: Callable[[], float] = time.time,
        fsync: bool = True,
        nvme_owner: str = "",
        nvme_retry_s: float = NVME_RETRY_S,
        orphan_grace_s: float = ORPHAN_GRACE_S,
    ) -> None:
        assert retention in ("evict-idle", "keep-all")
        self.layout = layout
        self.retention = retention
        self.host = HostTier(cpu_bytes)
        self.policy = policy or LRUPolicy()
        self.nvme = (
            NvmeTier(nvme_dir, layout, nvme_bytes, fsync=fsync, owner=nvme_owner) if nvme_dir is not None else None
        )
        self.workspaces = WorkspaceRegistry(layout.block_tokens, clock)
        self._metas: dict[str, BlockMeta] = {}
        self._pins: Counter[str] = Counter()
        self._writing: dict[str, tuple[int, int]] = {}  # hash -> (generation, reserved bytes) of its queued write
        self._gen = itertools.count(1)
        self._pending = 0
        self._active: str | None = None
        self._counts: Counter[str] = Counter()
        self._events: list[dict[str, Any]] = []
        self._clock = clock
        self._disk = DiskState()
        self._retry_s = nvme_retry_s
        self._orphan_grace_s = orphan_grace_s
        self._foreign = False  # other owners' manifests named blocks at start (set by ``_restore``)
        self._others_ws: set[str] | None = set()  # the workspaces they named (None: one could not be read)
        self._side: dict[str, tuple[str, int]] = {}
        self.on_side_dropped: Callable[[str], None] | None = None  # told when a workspace's side data goes with it
        self.on_side_shed: Callable[[str, str], None] | None = None  # told of side data dropped to make room
        if self.nvme is not None:
            self._restore()

    @classmethod
    def from_config(cls, config: KVMemConfig, layout: BlockLayout, **kwargs: Any) -> BlockStore:
        """The store ``config`` describes; ``$KVMEM_REPLICA`` (set by the server for each of several replicas)
        names this store's owner in a shared NVMe directory; ``$KVMEM_NVME_RETRY_S`` how long the NVMe tier stays
        off after a disk fault."""
        kwargs.setdefault("nvme_owner", os.environ.get(REPLICA_ENV, ""))
        kwargs.setdefault("nvme_retry_s", float(os.environ.get(RETRY_ENV, NVME_RETRY_S)))
        return cls(
            layout,
            cpu_bytes=int(config.cpu_gb * GIB),
            nvme_dir=config.nvme_dir,
            nvme_bytes=int(config.nvme_gb * GIB),
            retention=config.retention,
            **kwargs,
        )

    # -- workspaces -------------------------------------------------------------------

    def open_workspace(
        self, namespace: str, token_ids: Sequence[int] | np.ndarray, route: Route = Route()
    ) -> tuple[Workspace, PrefixMatch]:
        """Match ``token_ids`` against stored prefixes; continue or fork as ``route`` says; it becomes the
        workspace in use."""
        self._drain()
        match = self.workspaces.find_prefix(namespace, token_ids, self._metas.get, route)
        match, adopted = self._adopt(match, token_ids)
        ws = self.workspaces.open(match)
        for h in adopted:
            if not self.workspaces.owners(h):
                self._forget(h)
        self._active = ws.id
        self._sync_manifests()
        return ws, match

    def append(self, ws_id: str, meta: BlockMeta, kv: BlockKV) -> None:
        """Add a completed block at the end of a workspace, storing it unless already stored.

        Raises CapacityError (naming the flag to raise) when it does not fit under the retention.
        """
        self._drain()
        ws = self.workspaces.get(ws_id)
        assert ws is not None, f"unknown workspace {ws_id}"
        assert meta.parent_hash == (ws.hashes[-1] if ws.hashes else ROOT_HASH), "block does not extend the workspace"
        assert kv.k.shape == self.layout.kv_shape and kv.k.dtype == self.layout.storage_dtype
        self._active = ws_id
        if meta.chain_hash not in self._metas:
            self._store_new(meta, kv)
        self.workspaces.append(ws_id, meta.chain_hash)
        self._sync_manifests()

    def add_workspace(self, ws: Workspace, blocks: Iterable[tuple[BlockMeta, BlockKV]]) -> None:
        """Add a workspace from elsewhere (an import) with its blocks, in order, stored unless already here.
        All or nothing: on any failure (CapacityError, a bad block) the workspace is deleted and the error raised."""
        self.workspaces.add(
            Workspace(ws.id, ws.namespace, [], ws.created, ws.last_used, ws.last_selection, ws.key, ws.pinned)
        )
        try:
            for meta, kv in blocks:
                self.append(ws.id, meta, kv)
        except BaseException:
            self.delete_workspace(ws.id)
            raise

    def set_pinned(self, ws_id: str, pinned: bool) -> bool:
        """Pin a workspace (retention never evicts it) or unpin it; False if unknown."""
        if self.workspaces.get(ws_id) is None:
            return False
        self.workspaces.set_pinned(ws_id, pinned)
        self._sync_manifests()
        return True

    def set_selection(self, ws_id: str, selection: dict[str, Any]) -> None:
        """Remember a step's selection (plain data) with its workspace."""
        self.workspaces.set_selection(ws_id, selection)
        self._sync_manifests()

    def workspace_blocks(self, ws_id: str) -> list[BlockMeta]:
        """Metas of a workspace's stored blocks, in order (none for an unknown workspace): what a step may select
        from."""
        return list(self.workspace_view(ws_id)) if self.workspaces.get(ws_id) is not None else []

    def workspace_view(self, ws_id: str) -> MetaView:
        """``workspace_blocks`` of a workspace in use as a ``MetaView``: each meta looked up when read, valid while the
        workspace keeps the blocks it holds now (a step's selection). Every block a workspace holds has its meta: a
        lost block cuts the workspaces holding it (``_drop_lost``)."""
        ws = self.workspaces.get(ws_id)
        assert ws is not None, f"unknown workspace {ws_id}"
        return MetaView(ws.hashes, len(ws.hashes), self._metas)

    def delete_workspace(self, ws_id: str) -> bool:
        """Delete a workspace; blocks no other workspace references are freed. False if unknown."""
        self._drain()
        if self.workspaces.get(ws_id) is None:
            return False
        for h in self.workspaces.delete(ws_id):
            self._maybe_free(h)
        self._drop_sides(ws_id)
        if self._active == ws_id:
            self._active = None
        self._sync_manifests()
        return True

    def list_workspaces(self) -> list[dict[str, Any]]:
        """Every workspace's summary, most recently used first."""
        return [describe(ws, self._metas.get, ws.id == self._active) for ws in self.workspaces.oldest_first()[::-1]]

    def workspace_info(self, ws_id: str) -> dict[str, Any] | None:
        """A workspace's blocks (token range, tier) and totals; None if unknown."""
        ws = self.workspaces.get(ws_id)
        if ws is None:
            return None
        return detail(ws, self._metas.get, self.tier, self.layout.block_tokens, ws.id == self._active)

    # -- blocks -----------------------------------------------------------------------

    def lookup(self, block_hash: str) -> BlockMeta | None:
        """The meta of a stored block; no side effects."""
        return self._metas.get(block_hash)

    def meta(self, block_hash: str) -> BlockMeta:
        """The meta of a block known to be stored; KeyError when it is not."""
        return self._metas[block_hash]

    def tier(self, block_hash: str) -> str | None:
        """``host``, ``nvme``, ``host+nvme`` or None when not stored."""
        if block_hash not in self._metas:
            return None
        on_disk = self.nvme is not None and block_hash in self.nvme.sizes
        return ("host+nvme" if on_disk else "host") if block_hash in self.host else ("nvme" if on_disk else None)

    def touch(self, hashes: Iterable[str]) -> None:
        """Mark blocks recently used (host cache recency)."""
        for h in hashes:
            self.policy.touch(h)

    def flush(self) -> None:
        """Wait until every queued write (blocks, manifests, removals) has landed and is fsynced; then raise
        the first failure among them that is not a disk fault, if any (all of them were applied and counted).
        A disk fault turns the NVMe tier off instead (``store_disk``): what it could not write waits in RAM."""
        if self.nvme is not None:
            self.nvme.submit_sync()
            self._pending += 1
        first: Exception | None = None
        while self._pending:
            try:
                self._drain(wait=True)
            except Exception as exc:  # keep waiting: a failure must not leave later jobs unaccounted for
                first = first or exc
        if first is not None:
            raise first

    def close(self) -> None:
        """Flush and stop the background threads."""
        try:
            self.flush()
        finally:
            if self.nvme is not None:
                self.nvme.close()

    def metrics(self) -> dict[str, float]:
        """Counts and bytes per tier, evictions, misses, corrupt files, write-through queue length; with a disk,
        whether it is off after a fault, the blocks waiting in RAM for it, and the faults so far."""
        out: dict[str, float] = {
            "blocks": len(self._metas),
            "workspaces": len(self.workspaces),
            "pinned_blocks": len(self._pins),
            "host_blocks": len(self.host),
            "host_bytes": self.host.used,
            "host_capacity_bytes": self.host.capacity,
            "write_queue": self._pending,
            "side_host_bytes": self.side_bytes("host"),
        }
        if self.nvme is not None:
            out.update(
                nvme_blocks=len(self.nvme.sizes),
                nvme_bytes=self.nvme.used,
                nvme_capacity_bytes=self.nvme.capacity,
                side_nvme_bytes=self.side_bytes("nvme"),
                nvme_offline=int(self._disk.mode == "off"),
                nvme_waiting_blocks=sum(gen == 0 for gen, _ in self._writing.values()),
            )
        for name in (
            "evictions",
            "evicted_workspaces",
            "misses",
            "corrupt",
            "write_errors",
            "orphans_removed",
            "nvme_faults",
        ):
            out[name] = self._counts[name]
        return out

    def take_events(self) -> list[dict[str, Any]]:
        """Drain the log of notable events (workspace evictions, corrupt files, write errors)."""
        events, self._events = self._events, []
        return events

    # -- storing and freeing ------------------------------------------------------------

    def _store_new(self, meta: BlockMeta, kv: BlockKV) -> None:
        h = meta.chain_hash
        if self.nvme is None:
            self._ensure_capacity(kv.nbytes)
        else:
            header = encode_header(meta, self.layout)
            self._ensure_capacity(header.file_size)
            self._make_host_room(kv.nbytes)
            self._reserve_and_write(h, header, kv)
        self.host.put(h, kv)
        self.policy.insert(h)
        self._metas[h] = meta

    def _maybe_free(self, h: str) -> None:
        """Drop a block once no workspace references it and nobody holds a pin on it."""
        if self.workspaces.owners(h) or h in self._pins or h not in self._metas:
            return
        del self._metas[h]
        self.host.pop(h)
        self.policy.remove(h)
        if self.nvme is not None:
            self._drop_file(h)
