"""The host-RAM tier: block payloads by chain hash, bounded in bytes.

It only keeps and counts; what may be evicted and when is the store's decision (pins,
write-through state, retention). Metas live with the store, not here.
"""

from __future__ import annotations

from kvmem_core.layout import BlockKV


class HostTier:
    """Payloads in RAM; ``used`` never exceeds ``capacity`` (callers check ``can_fit`` first)."""

    def __init__(self, capacity: int) -> None:
        assert capacity > 0
        self.capacity = capacity
        self.used = 0
        self._blocks: dict[str, BlockKV] = {}

    def __contains__(self, block_hash: str) -> bool:
        return block_hash in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def can_fit(self, nbytes: int) -> bool:
        return self.used + nbytes <= self.capacity

    def get(self, block_hash: str) -> BlockKV | None:
        return self._blocks.get(block_hash)

    def put(self, block_hash: str, kv: BlockKV) -> None:
        """Add a payload; the caller has made room."""
        assert block_hash not in self._blocks and self.can_fit(kv.nbytes)
        self._blocks[block_hash] = kv
        self.used += kv.nbytes

    def pop(self, block_hash: str) -> BlockKV | None:
        """Remove and return a payload (None if absent)."""
        kv = self._blocks.pop(block_hash, None)
        if kv is not None:
            self.used -= kv.nbytes
        return kv

    def hashes(self) -> list[str]:
        return list(self._blocks)
