"""Reading blocks back from ``BlockStore``'s tiers: two-phase loads, blocks lost on the way, and blocks that
other stores sharing the NVMe directory wrote.

A mixin over the store's state. ``prepare_load`` pins the stored blocks asked for and starts
reading those not in the host tier; ``complete_load`` waits for the reads, returns the
payloads and the missing hashes, and unpins. A block read from disk stays in the host tier
when room can be made from clean copies. A block whose file fails a check, or that is gone,
is dropped, logged and counted, and every workspace holding it is cut back to the blocks
before it. In a directory shared with other stores, ``_adopt`` indexes the blocks they wrote
that extend a prefix match, so a conversation moves between replicas without prefilling again.
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from kvmem_core.errors import CorruptBlockError
from kvmem_core.layout import ROOT_HASH, BlockKV, BlockMeta

from kvmem_core.store_state import StoreState

if TYPE_CHECKING:
    from kvmem_core.workspace import PrefixMatch

log = logging.getLogger("kvmem.store")


@dataclass(frozen=True, eq=False)
class LoadTicket:
    """Blocks asked for by ``prepare_load``; ``pinned`` are those held until completion."""

    hashes: tuple[str, ...]
    pinned: tuple[str, ...]
    reads: dict[str, Future[tuple[BlockMeta, BlockKV]]]


@dataclass(frozen=True, eq=False)
class LoadResult:
    """Payloads by hash, and the requested hashes that are missing (unknown or corrupt)."""

    blocks: dict[str, BlockKV]
    missing: tuple[str, ...]


class LoadMixin(StoreState):
    """The read side of ``BlockStore`` (see module docstring)."""

    _drain: Callable[..., None]
    _maybe_free: Callable[[str], None]
    _evict_one: Callable[[], bool]
    _drop_file: Callable[[str], None]
    _sync_manifests: Callable[[], None]

    def prepare_load(self, hashes: Sequence[str]) -> LoadTicket:
        """Pin the stored blocks among ``hashes`` and start reading those not in the host tier."""
        self._drain()
        pinned = tuple(h for h in dict.fromkeys(hashes) if h in self._metas)
        reads = {}
        for h in pinned:
            self._pins[h] += 1
            if h not in self.host and self.nvme is not None:
                reads[h] = self.nvme.load(h)
        return LoadTicket(tuple(hashes), pinned, reads)

    def complete_load(self, ticket: LoadTicket) -> LoadResult:
        """Wait for a ticket's reads; return payloads and the missing hashes; unpin."""
        blocks: dict[str, BlockKV] = {}
        try:
            for h in dict.fromkeys(ticket.hashes):
                kv = self._collect(h, ticket)
                if kv is not None:
                    blocks[h] = kv
        finally:
            for h in ticket.pinned:
                assert self._pins[h] > 0, "a load ticket completed twice"
                self._pins[h] -= 1
                if not self._pins[h]:
                    del self._pins[h]
                    self._maybe_free(h)
        return LoadResult(blocks, tuple(h for h in dict.fromkeys(ticket.hashes) if h not in blocks))

    # -- loading --------------------------------------------------------------------

    def _collect(self, h: str, ticket: LoadTicket) -> BlockKV | None:
        read = ticket.reads.get(h)
        if read is None:
            kv = self.host.get(h)
            if kv is not None:
                self.policy.touch(h)
            elif h in self._metas:
                self._drop_lost(h, "gone from the host tier")
            else:
                self._counts["misses"] += 1
            return kv
        try:
            _, kv = read.result()
        except (CorruptBlockError, OSError, ValueError, KeyError) as exc:
            self._drop_lost(h, str(exc))
            return None
        self._cache(h, kv)
        return kv

    def _cache(self, h: str, kv: BlockKV) -> None:
        """Keep a loaded block in the host tier if room can be made from clean copies."""
        if h in self.host or h not in self._metas:
            return
        while not self.host.can_fit(kv.nbytes):
            if not self._evict_one():
                return
        self.host.put(h, kv)
        self.policy.insert(h)

    def _drop_lost(self, h: str, why: str) -> None:
        """Forget a block that failed its checks or is gone, and cut every workspace holding it back to the
        blocks before it: their history from there on is prefilled again by the next step that sends it."""
        log.warning("block %s is unreadable and treated as missing: %s", h, why)
        self._counts["corrupt"] += 1
        self._counts["misses"] += 1
        self._events.append({"event": "corrupt_block", "block": h, "error": why})
        self.policy.remove(h)
        if self._metas.pop(h, None) is not None and self.nvme is not None:
            self._drop_file(h)
        for freed in self.workspaces.cut_at(h):
            self._maybe_free(freed)
        self._sync_manifests()

    def _adopt(self, match: PrefixMatch, token_ids: Sequence[int] | np.ndarray) -> tuple[PrefixMatch, list[str]]:
        """Index the blocks on disk that other stores wrote that extend ``match`` (in order, up to the first one
        no store has written or whose tokens differ) and return the match extended by them, with the hashes
        indexed: replicas sharing the directory, or the replicas that used it before this one engine. In a
        directory no other store uses, ``match`` unchanged."""
        adopted: list[str] = []
        if self.nvme is None or not (self.nvme.owner or self._foreign):
            return match, adopted
        ids, size = np.asarray(token_ids, dtype=np.int64), self.layout.block_tokens
        k = match.matched_blocks
        while k < len(match.hashes) and match.hashes[k] not in self._metas:
            meta = self.nvme.adopt(match.hashes[k])
            if meta is None:
                break
            self._metas[meta.chain_hash] = meta
            adopted.append(meta.chain_hash)
            parent = match.hashes[k - 1] if k else ROOT_HASH
            if meta.parent_hash != parent or not np.array_equal(meta.token_ids, ids[k * size : (k + 1) * size]):
                break
            k += 1
        return dataclasses.replace(match, matched_blocks=k), adopted
