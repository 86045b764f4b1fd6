"""Workspaces: one conversation trajectory each, as an ordered list of block chain hashes.

Blocks are content-addressed, so workspaces with a common prefix share its blocks. A new
token sequence is matched block by block against every workspace of its namespace (chain
hash first, then the stored token ids); it either continues the workspace it extends or
forks a new one that shares the matched prefix, leaving the original untouched.

A ``Route`` can name the workspace beyond its tokens. A *key* (a client's
``prompt_cache_key``) is a routing hint, as OpenAI documents it, shared by any number of
conversations: a keyed step continues only a workspace under its key, and one under no key
only a keyless workspace; where none holds exactly the matched prefix it forks a new one
(under its key) sharing that prefix's blocks. No step rewinds a workspace, so two
histories under one key both keep their blocks. A *preferred* workspace (the one a
previous response ran in) wins when several hold exactly the matched prefix.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import numpy as np

from kvmem_core.layout import ROOT_HASH, BlockMeta, chain_hash
from kvmem_core.step import common_prefix


@dataclass
class Workspace:
    """A trajectory: its blocks in order, times, the last selection as plain data, its routing key and whether
    it is pinned (retention never evicts it)."""

    id: str
    namespace: str
    hashes: list[str] = field(default_factory=list)
    created: float = 0.0
    last_used: float = 0.0
    last_selection: dict[str, Any] = field(default_factory=dict)
    key: str | None = None
    pinned: bool = False

    def to_manifest(self) -> bytes:
        return json.dumps(self.__dict__).encode()

    def manifest_later(self) -> Callable[[], bytes]:
        """``to_manifest`` of the workspace as it is now, encoded when called: the hash list is copied now, the
        encoding, which grows with the workspace, is left to whoever writes it (once per coalesced write)."""
        return replace(self, hashes=list(self.hashes)).to_manifest

    @classmethod
    def from_manifest(cls, data: dict[str, Any]) -> Workspace:
        return cls(
            data["id"],
            data["namespace"],
            list(data["hashes"]),
            data["created"],
            data["last_used"],
            dict(data.get("last_selection", {})),
            data.get("key"),
            bool(data.get("pinned", False)),
        )


@dataclass(frozen=True)
class Route:
    """What besides its tokens places a step (see the module docstring): a ``key`` or a ``prefer``red workspace."""

    key: str | None = None
    prefer: str | None = None


@dataclass(frozen=True)
class PrefixMatch:
    """Result of matching a token sequence: ``hashes`` covers all of its whole blocks.

    ``workspace_id`` is the workspace the sequence continues (None: opening the match forks
    a new one holding the matched prefix, under ``key``).
    """

    namespace: str
    hashes: tuple[str, ...]
    matched_blocks: int
    block_tokens: int
    workspace_id: str | None
    key: str | None = None

    @property
    def continues(self) -> bool:
        return self.workspace_id is not None

    @property
    def matched_tokens(self) -> int:
        return self.matched_blocks * self.block_tokens


@dataclass(frozen=True, eq=False)
class _Matched:
    """What ``find_prefix`` last found: the ids (read-only), their block hashes, how many of those blocks were
    verified, and the registry's release count then."""

    namespace: str
    ids: np.ndarray
    hashes: list[str]
    verified: int
    releases: int


class WorkspaceRegistry:
    """All workspaces plus, per block, the set of workspaces referencing it (its refcount)."""

    def __init__(self, block_tokens: int, clock: Callable[[], float] = time.time) -> None:
        self.block_tokens = block_tokens
        self._clock = clock
        self._spaces: dict[str, Workspace] = {}
        self._owners: dict[str, set[str]] = {}
        self._dirty: set[str] = set()
        self._releases = 0  # blocks lost an owner this often: a verified match may not hold any more
        self._last: _Matched | None = None

    def __len__(self) -> int:
        return len(self._spaces)

    def get(self, ws_id: str) -> Workspace | None:
        return self._spaces.get(ws_id)

    def __getitem__(self, ws_id: str) -> Workspace:
        """The workspace ``ws_id``; KeyError when there is none."""
        return self._spaces[ws_id]

    def all(self) -> list[Workspace]:
        return list(self._spaces.values())

    def owners(self, block_hash: str) -> int:
        """How many workspaces reference a block."""
        return len(self._owners.get(block_hash, ()))

    def find_prefix(
        self,
        namespace: str,
        token_ids: Sequence[int] | np.ndarray,
        meta_of: Callable[[str], BlockMeta | None],
        route: Route = Route(),
    ) -> PrefixMatch:
        """Longest stored prefix of ``token_ids`` (whole blocks only, any workspace's) and the workspace the
        sequence continues under ``route``; no side effects on the workspaces.

        What the last call found is kept (``_Matched``): the blocks this sequence shares with that one keep
        their chain hashes, and those verified then need no check again while no block has lost an owner
        since; only the blocks past them are hashed and checked (besides one comparison of the ids)."""
        ids = np.asarray(token_ids, dtype=np.int64)
        last, bt = self._last, self.block_tokens
        same = common_prefix(last.ids, ids) // bt if last is not None and last.namespace == namespace else 0
        hashes = block_hashes(namespace, ids, bt, last.hashes[:same] if last is not None else ())
        k = min(same, last.verified) if last is not None and last.releases == self._releases else 0
        while k < len(hashes) and self._verified(hashes, k, ids, meta_of):
            k += 1
        self._last = _Matched(namespace, ids if not ids.flags.writeable else ids.copy(), hashes, k, self._releases)
        ws = self._continued(namespace, hashes[k - 1] if k else None, k, route)
        return PrefixMatch(namespace, tuple(hashes), k, self.block_tokens, ws.id if ws else None, route.key)

    def open(self, match: PrefixMatch) -> Workspace:
        """Continue the matched workspace (extended by blocks a match adopted past it) or fork a new one holding
        the matched prefix; return it."""
        prefix = match.hashes[: match.matched_blocks]
        if match.workspace_id is not None:
            ws = self._spaces[match.workspace_id]
        else:
            now = self._clock()
            ws = Workspace("ws-" + uuid.uuid4().hex[:16], match.namespace, [], now, now, key=match.key)
            self.add(ws)
        for h in prefix[len(ws.hashes) :]:
            self.append(ws.id, h)
        self.touch(ws.id)
        return ws

    def add(self, ws: Workspace) -> None:
        """Register a workspace (new, restored from its manifest, or imported); its id must be new."""
        assert ws.id not in self._spaces
        self._spaces[ws.id] = ws
        for h in ws.hashes:
            self._owners.setdefault(h, set()).add(ws.id)
        self._dirty.add(ws.id)

    def set_pinned(self, ws_id: str, pinned: bool) -> None:
        self._spaces[ws_id].pinned = pinned
        self._dirty.add(ws_id)

    def append(self, ws_id: str, block_hash: str) -> None:
        ws = self._spaces[ws_id]
        ws.hashes.append(block_hash)
        self._owners.setdefault(block_hash, set()).add(ws_id)
        self.touch(ws_id)

    def touch(self, ws_id: str) -> None:
        self._spaces[ws_id].last_used = self._clock()
        self._dirty.add(ws_id)

    def set_selection(self, ws_id: str, selection: dict[str, Any]) -> None:
        self._spaces[ws_id].last_selection = dict(selection)
        self._dirty.add(ws_id)

    def mark_dirty(self, ws_id: str) -> None:
        """Have the workspace's manifest written again."""
        self._dirty.add(ws_id)

    def delete(self, ws_id: str) -> list[str]:
        """Remove a workspace; return the hashes no workspace references any more."""
        ws = self._spaces.pop(ws_id)
        self._dirty.add(ws_id)
        return self._release(ws_id, ws.hashes)

    def cut_at(self, block_hash: str) -> list[str]:
        """Cut every workspace holding ``block_hash`` back to the blocks before it; return the hashes no
        workspace references any more."""
        freed = []
        for ws_id in sorted(self._owners.get(block_hash, ())):
            ws = self._spaces[ws_id]
            k = ws.hashes.index(block_hash)
            freed += self._release(ws_id, ws.hashes[k:])
            del ws.hashes[k:]
            self._dirty.add(ws_id)
        return freed

    def _release(self, ws_id: str, hashes: Sequence[str]) -> list[str]:
        """Drop ``ws_id`` from the holders of ``hashes``; return those no workspace holds now."""
        self._releases += 1
        freed = []
        for h in dict.fromkeys(hashes):
            holders = self._owners[h]
            holders.discard(ws_id)
            if not holders:
                del self._owners[h]
                freed.append(h)
        return freed

    def oldest_first(self) -> list[Workspace]:
        return sorted(self._spaces.values(), key=lambda w: (w.last_used, w.created))

    def take_dirty(self) -> list[str]:
        """Ids changed (or deleted) since the last call, for manifest writes."""
        dirty, self._dirty = sorted(self._dirty), set()
        return dirty

    def _verified(self, hashes: list[str], k: int, ids: np.ndarray, meta_of: Callable[[str], BlockMeta | None]) -> bool:
        if not self._owners.get(hashes[k]):
            return False
        meta = meta_of(hashes[k])
        block = ids[k * self.block_tokens : (k + 1) * self.block_tokens]
        parent = hashes[k - 1] if k else ROOT_HASH
        return meta is not None and meta.parent_hash == parent and np.array_equal(meta.token_ids, block)

    def _continued(self, namespace: str, last_hash: str | None, k: int, route: Route) -> Workspace | None:
        """The workspace under ``route.key`` (or under none) that is exactly the matched prefix: ``route.prefer`` if
        it is one, else the most recent."""
        if last_hash is None:
            pool = [w for w in self._spaces.values() if w.namespace == namespace and not w.hashes]
        else:
            pool = [self._spaces[i] for i in self._owners[last_hash]]
        pool = [w for w in pool if len(w.hashes) == k and w.key == route.key]
        if not pool:
            return None
        return max(pool, key=lambda w: (w.id == route.prefer, w.last_used, w.created))


def block_hashes(
    namespace: str, token_ids: Sequence[int] | np.ndarray, block_tokens: int, known: Sequence[str] = ()
) -> list[str]:
    """Chain hashes of every whole block of a token sequence; ``known``: those of its first blocks."""
    ids = np.asarray(token_ids[len(known) * block_tokens :], dtype=np.int32)  # a turn converts its new ids alone
    out, parent = list(known), known[-1] if known else ROOT_HASH
    for start in range(0, len(ids) - block_tokens + 1, block_tokens):
        parent = chain_hash(namespace, parent, ids[start : start + block_tokens])
        out.append(parent)
    return out


def describe(ws: Workspace, meta_of: Callable[[str], BlockMeta | None], in_use: bool) -> dict[str, Any]:
    """A workspace's summary for listings: ids, sizes (stored tokens), times, key, pin."""
    tokens = sum(m.n_tokens for m in map(meta_of, ws.hashes) if m is not None)
    return {
        "id": ws.id,
        "namespace": ws.namespace,
        "blocks": len(ws.hashes),
        "tokens": tokens,
        "created": ws.created,
        "last_used": ws.last_used,
        "in_use": in_use,
        "key": ws.key,
        "pinned": ws.pinned,
    }


def detail(
    ws: Workspace,
    meta_of: Callable[[str], BlockMeta | None],
    tier_of: Callable[[str], str | None],
    block_tokens: int,
    in_use: bool,
) -> dict[str, Any]:
    """Summary plus each block's token range and tier (``missing`` if lost) and per-tier totals."""
    blocks = []
    for i, h in enumerate(ws.hashes):
        start = i * block_tokens  # blocks are consecutive and whole; meta.start_pos is where K was rotated
        blocks.append(
            {"index": i, "hash": h, "start": start, "end": start + block_tokens, "tier": tier_of(h) or "missing"}
        )
    tiers = Counter(b["tier"] for b in blocks)
    summary = describe(ws, meta_of, in_use)
    totals = {
        "blocks": len(blocks),
        "tokens": summary["tokens"],
        "host_blocks": tiers["host"] + tiers["host+nvme"],
        "nvme_blocks": tiers["nvme"] + tiers["host+nvme"],
        "missing_blocks": tiers["missing"],
    }
    return {**summary, "blocks": blocks, "totals": totals, "last_selection": ws.last_selection}
