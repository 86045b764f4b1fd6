"""Side data of workspaces counted in ``BlockStore``'s budgets: the recurrent-state checkpoints of hybrid models.

A checkpoint is not a block, but its bytes sit in the same RAM and on the same disk: a
27B-shaped state is ~150 MB, and a step takes up to four. Each piece is entered in a
ledger under a key, a tier (``host``: RAM, counted in ``--kvmem-cpu-gb``; ``nvme``: a file,
counted in ``--kvmem-nvme-gb``) and the workspace it belongs to. Room is made for it as for
a block: clean host copies leave, and under ``evict-idle`` idle workspaces go, oldest
first, their side data counted as freed with them (``store_capacity._plan_eviction``). A
workspace that goes (evicted or deleted) takes its side data along: the ledger entries are
dropped and ``on_side_dropped(ws_id)`` tells the owner of the data to free it at once.
Side data is optional: when it does not fit, ``keep_side`` says so and the caller does
without it (a checkpoint then is recomputed when needed); and where blocks (or newer side
data) find no room otherwise, side data of the tier is shed, oldest first, before the store
refuses (``on_side_shed(tier, key)`` tells its owner), so it never costs a step.
"""

from __future__ import annotations

from typing import Callable

from kvmem_core.errors import CapacityError

from kvmem_core.store_state import StoreState

TIERS = ("host", "nvme")


class SideDataMixin(StoreState):
    """The side-data ledger of ``BlockStore`` (see module docstring)."""

    on_side_dropped: Callable[[str], None] | None
    on_side_shed: Callable[[str, str], None] | None
    _ensure_capacity: Callable[[int], None]
    _make_host_room: Callable[[int], None]

    def keep_side(self, tier: str, key: str, ws_id: str, nbytes: int) -> bool:
        """Count ``nbytes`` of side data ``key`` of workspace ``ws_id`` in ``tier``, making room for it (see module
        docstring); True when counted (also when it already was). False, with nothing counted: the workspace is
        unknown (or evicted to make room), there is no disk for ``nvme``, or no room."""
        assert tier in TIERS
        entry = f"{tier}:{key}"
        if entry in self._side:
            return True
        if self.workspaces.get(ws_id) is None or (tier == "nvme" and self.nvme is None):
            return False
        try:
            if tier == "nvme" or self.nvme is None:
                self._ensure_capacity(nbytes)
            else:
                self._make_host_room(nbytes)
        except CapacityError:
            return False
        if self.workspaces.get(ws_id) is None:
            return False
        self._side[entry] = (ws_id, nbytes)
        self._count_side(tier, nbytes)
        return True

    def drop_side(self, tier: str, key: str) -> None:
        """Stop counting side data ``key`` in ``tier`` (nothing if it is not counted)."""
        ws_and_size = self._side.pop(f"{tier}:{key}", None)
        if ws_and_size is not None:
            self._count_side(tier, -ws_and_size[1])

    def foreign_workspace(self, ws_id: str) -> bool:
        """True when another owner's manifest named ``ws_id`` at start (or one could not be read): its side data
        on disk is that owner's to keep."""
        return self._others_ws is None or ws_id in self._others_ws

    def side_bytes(self, tier: str) -> int:
        """Side-data bytes counted in ``tier``."""
        return sum(n for entry, (_, n) in self._side.items() if entry.startswith(tier + ":"))

    def _side_entries(self, ws_id: str) -> list[str]:
        return [entry for entry, (ws, _) in self._side.items() if ws == ws_id]

    def _side_size(self, entry: str, tier: str) -> int:
        """Bytes of a ledger entry if it is in ``tier``; 0 otherwise."""
        return self._side[entry][1] if entry.startswith(tier + ":") else 0

    def _drop_sides(self, ws_id: str) -> None:
        """A workspace went: drop its side data from the ledger and have its owner free it."""
        entries = self._side_entries(ws_id)
        for entry in entries:
            tier, key = entry.split(":", 1)
            self.drop_side(tier, key)
        if entries and self.on_side_dropped is not None:
            self.on_side_dropped(ws_id)

    def _shed_side(self, tier: str, need: int) -> bool:
        """Drop side data of ``tier``, oldest first, until ``need`` bytes are free, telling its owner; False, with
        nothing dropped, when all of it would free less."""
        entries = [(entry, size) for entry, (_, size) in self._side.items() if entry.startswith(tier + ":")]
        if sum(size for _, size in entries) < need:
            return False
        freed = 0
        for entry, size in entries:
            if freed >= need:
                break
            key = entry.split(":", 1)[1]
            self.drop_side(tier, key)
            freed += size
            if self.on_side_shed is not None:
                self.on_side_shed(tier, key)
        return True

    def _count_side(self, tier: str, nbytes: int) -> None:
        if tier == "host":
            self.host.used += nbytes
        else:
            assert self.nvme is not None, "side data is counted in the NVMe tier only where there is one"
            self.nvme.used += nbytes
