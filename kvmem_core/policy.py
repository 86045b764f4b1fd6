"""Eviction policies: which cached host copy goes first, and which idle workspaces to drop.

``EvictionPolicy`` orders the host tier's blocks; the store only evicts the candidates it
yields that are clean (already on disk) and unpinned. ``plan_workspace_eviction`` decides,
before anything is dropped, whether evicting idle workspaces oldest first frees enough.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterable, Iterator, Protocol, Sequence


class EvictionPolicy(Protocol):
    """Recency bookkeeping over block hashes; ``candidates`` yields the next victims first."""

    def insert(self, block_hash: str) -> None: ...

    def touch(self, block_hash: str) -> None: ...

    def remove(self, block_hash: str) -> None: ...

    def candidates(self) -> Iterator[str]: ...  # oldest first, live: no removal while iterating


class LRUPolicy:
    """Least recently inserted or touched first."""

    def __init__(self) -> None:
        self._order: OrderedDict[str, None] = OrderedDict()

    def insert(self, block_hash: str) -> None:
        self._order[block_hash] = None
        self._order.move_to_end(block_hash)

    def touch(self, block_hash: str) -> None:
        if block_hash in self._order:
            self._order.move_to_end(block_hash)

    def remove(self, block_hash: str) -> None:
        self._order.pop(block_hash, None)

    def candidates(self) -> Iterator[str]:
        """Oldest first; a live view: take what you need before removing anything."""
        return iter(self._order)


def plan_workspace_eviction(
    idle: Sequence[tuple[str, Sequence[str]]], owners: Callable[[str], int], size_of: Callable[[str], int], need: int
) -> list[str] | None:
    """Workspace ids to evict, oldest first, to free ``need`` bytes; None if all idle ones fall short.

    ``idle`` is (workspace id, its block hashes) ordered oldest first; ``owners(h)`` counts
    the workspaces referencing h now. A block is freed once every workspace holding it is
    evicted, so shared blocks count only when their last owner goes.
    """
    dropped: dict[str, int] = {}
    freed, chosen = 0, []
    for ws_id, hashes in idle:
        if freed >= need:
            break
        chosen.append(ws_id)
        freed += sum(_release(h, dropped, owners, size_of) for h in _unique(hashes))
    return chosen if freed >= need else None


def _release(h: str, dropped: dict[str, int], owners: Callable[[str], int], size_of: Callable[[str], int]) -> int:
    dropped[h] = dropped.get(h, 0) + 1
    return size_of(h) if dropped[h] == owners(h) else 0


def _unique(hashes: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(hashes))
