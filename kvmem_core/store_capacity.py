"""Budget accounting of ``BlockStore``: what bounds it, what retention evicts, what leaves the host cache.

A mixin over the store's state (its tiers, metas, pins, workspaces, queued writes), so the
façade in ``store.py`` keeps to the calls. The bounding tier is the disk when there is
one (file bytes, reserved when a block is appended), else host RAM (payload bytes). With
a disk the host tier is a cache: a copy leaves when its file has landed and nobody pins
it. Blocks waiting for a disk that is off after a fault (``store_disk``) stay in RAM;
when they fill it, retention evicts idle workspaces holding them.
"""

from __future__ import annotations

import logging
from typing import Callable

from kvmem_core.config import GIB
from kvmem_core.errors import CapacityError
from kvmem_core.policy import plan_workspace_eviction

from kvmem_core.store_state import StoreState

log = logging.getLogger("kvmem.store")


class CapacityMixin(StoreState):
    """Eviction and budget checks of ``BlockStore`` (see module docstring)."""

    retention: str
    _active: str | None
    _drain: Callable[..., None]
    _maybe_free: Callable[[str], None]
    _side_entries: Callable[[str], list[str]]
    _side_size: Callable[[str, str], int]
    _drop_sides: Callable[[str], None]
    _shed_side: Callable[[str, int], bool]
    disk_fault: Callable[[], str]

    def _ensure_capacity(self, nbytes: int) -> None:
        """Make ``nbytes`` fit the bounding tier, evicting idle workspaces if the retention allows, else shedding
        side data (``store_side``)."""
        used, capacity, flag = self._bound()
        if used + nbytes <= capacity:
            return
        plan = self._plan_eviction(self._freeable_bytes, used + nbytes - capacity)
        if plan is None and self._shed_side("host" if self.nvme is None else "nvme", used + nbytes - capacity):
            return
        if plan is None:
            raise CapacityError(
                f"storage full: {used / GIB:.3f} of {capacity / GIB:.3f} GiB used and "
                f"{self._why_no_eviction()}; raise {flag}"
            )
        for ws_id in plan:
            self._evict_workspace(ws_id)

    def _plan_eviction(self, size_of: Callable[[str], int], need: int) -> list[str] | None:
        """Idle, unpinned workspaces to evict, oldest first, to free ``need`` bytes as ``size_of`` counts them
        (their blocks, and their side data, which goes with them); None when the retention forbids it or they
        fall short."""
        if self.retention != "evict-idle":
            return None
        idle = [
            (w.id, [*w.hashes, *self._side_entries(w.id)])
            for w in self.workspaces.oldest_first()
            if w.id != self._active and not w.pinned and not any(h in self._pins for h in w.hashes)
        ]
        owners = lambda h: 1 if h in self._side else self.workspaces.owners(h)  # noqa: E731
        return plan_workspace_eviction(idle, owners, size_of, need)

    def _why_no_eviction(self) -> str:
        return (
            "--kvmem-retention keep-all refuses new history"
            if self.retention == "keep-all"
            else "evicting every idle, unpinned workspace would not free enough"
        )

    def _bound(self) -> tuple[int, int, str]:
        if self.nvme is None:
            return self.host.used, self.host.capacity, "--kvmem-cpu-gb (or set --kvmem-nvme-dir)"
        return self.nvme.used, self.nvme.capacity, "--kvmem-nvme-gb"

    def _freeable_bytes(self, h: str) -> int:
        if h in self._side:
            return self._side_size(h, "host" if self.nvme is None else "nvme")
        if h in self._pins or h not in self._metas:
            return 0
        if self.nvme is None:
            return self._host_bytes(h)
        return self.nvme.sizes.get(h, self._writing.get(h, (0, 0))[1])

    def _host_bytes(self, h: str) -> int:
        kv = self.host.get(h)
        return kv.nbytes if kv is not None else 0

    def _unwritten_host_bytes(self, h: str) -> int:
        """Host bytes of a block waiting for the disk (its write failed or was never queued), or of side data in
        RAM; 0 otherwise."""
        if h in self._side:
            return self._side_size(h, "host")
        waiting = h not in self._pins and self._writing.get(h, (None, 0))[0] == 0
        return self._host_bytes(h) if waiting else 0

    def _evict_workspace(self, ws_id: str) -> None:
        ws = self.workspaces[ws_id]
        log.info("evicting idle workspace %s (%d blocks, last used %.0f)", ws_id, len(ws.hashes), ws.last_used)
        self._counts["evicted_workspaces"] += 1
        self._events.append({"event": "evicted_workspace", "workspace": ws_id, "blocks": len(ws.hashes)})
        for h in self.workspaces.delete(ws_id):
            self._maybe_free(h)
        self._drop_sides(ws_id)

    def _make_host_room(self, nbytes: int) -> None:
        """Evict clean, unpinned host copies (LRU), waiting for write-through if all are dirty; then evict idle
        workspaces whose blocks wait for a disk that is off, or whose side data is in RAM; then shed side data."""
        while not self.host.can_fit(nbytes):
            if self._evict_one():
                continue
            if self._pending:
                self._drain(wait=True)
                continue
            need = self.host.used + nbytes - self.host.capacity
            plan = self._plan_eviction(self._unwritten_host_bytes, need)
            if plan is None and self._shed_side("host", need):
                continue
            if plan is None:
                raise CapacityError(self._host_full_message())
            for ws_id in plan:
                self._evict_workspace(ws_id)

    def _host_full_message(self) -> str:
        held = f"the host tier ({self.host.capacity / GIB:.3f} GiB) is full"
        fault = self.disk_fault()
        if fault:
            return (
                f"{held} of blocks waiting for the NVMe tier, which is off after a disk fault ({fault}), and "
                f"{self._why_no_eviction()}; free disk space or raise --kvmem-cpu-gb"
            )
        return f"{held} of pinned blocks; raise --kvmem-cpu-gb"

    def _evict_one(self) -> bool:
        """Drop the policy's first clean, unpinned host copy; False if there is none."""
        victim = next((h for h in self.policy.candidates() if self._is_evictable(h)), None)
        if victim is None:
            return False
        self.host.pop(victim)
        self.policy.remove(victim)
        self._counts["evictions"] += 1
        return True

    def _is_evictable(self, h: str) -> bool:
        assert self.nvme is not None, "host copies are evicted only where the NVMe tier keeps the blocks"
        return h not in self._pins and h in self.nvme.sizes
