"""The fields of ``BlockStore`` that its mixins (``store_capacity``, ``store_disk``, ``store_side``, ``store_load``)
share, declared once for the type checker; ``BlockStore.__init__`` sets every one of them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections import Counter

    from kvmem_core.host import HostTier
    from kvmem_core.layout import BlockLayout, BlockMeta
    from kvmem_core.nvme import NvmeTier
    from kvmem_core.policy import EvictionPolicy
    from kvmem_core.workspace import WorkspaceRegistry


class StoreState:
    """What more than one part of the store reads or writes: the tiers, the metas, pins, queued writes, counters."""

    layout: BlockLayout
    host: HostTier
    nvme: NvmeTier | None
    policy: EvictionPolicy
    workspaces: WorkspaceRegistry
    _metas: dict[str, BlockMeta]
    _pins: Counter[str]
    _writing: dict[str, tuple[int, int]]  # hash -> (generation, reserved bytes) of its queued write
    _pending: int
    _counts: Counter[str]
    _events: list[dict[str, Any]]
    _foreign: bool
    _others_ws: set[str] | None
    _side: dict[str, tuple[str, int]]  # "<tier>:<key>" -> (workspace id, bytes)
