"""Write-through of ``BlockStore`` to its NVMe tier: queued writes, their results, disk faults, restart.

A mixin over the store's state. Every completed block reserves its file bytes and is
queued for the background writer (``nvme.py``); ``_writing`` maps it to (generation,
reserved bytes) until its file lands. Generation 0 marks a block waiting in RAM: its
write failed, or the tier was off when it was stored.

A disk fault (any ``OSError`` of a write: disk full, read-only, I/O error, quota) turns
the tier off instead of failing the caller: one warning line, ``nvme_faults`` counted,
``nvme_offline`` set. Steps continue from host RAM (blocks on disk still load, and a
failed read is the usual counted miss); new blocks and manifests wait in RAM. Every
``retry_s`` a store call resumes write-through: the waiting blocks and every manifest are
queued again; the first write that lands turns the tier back on (one info line), a
failure turns it off again quietly until the next retry. Nothing stored is dropped for
a fault; a block that never reaches the disk is lost only with the process, as any write
in flight is.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from kvmem_core.blockfile import EncodedHeader, encode_header
from kvmem_core.workspace import Workspace

from kvmem_core.store_state import StoreState

if TYPE_CHECKING:
    from kvmem_core.layout import BlockKV
    from kvmem_core.nvme import NvmeTier, WriteDone

log = logging.getLogger("kvmem.store")
NVME_RETRY_S = 30.0  # how long the tier stays off after a disk fault before writes are tried again
ORPHAN_GRACE_S = 300.0  # a block file younger than this may still be waiting for its manifest in a live replica


@dataclass
class DiskState:
    """Whether writes go to the disk: ``on``; ``off`` after a fault (``fault`` says which) until ``retry_at``;
    ``retrying`` once writes resumed, until one lands (then ``on``) or fails (then ``off`` again)."""

    mode: str = "on"
    fault: str = ""
    retry_at: float = 0.0


class WriteThroughMixin(StoreState):
    """The NVMe side of ``BlockStore`` (see module docstring)."""

    _gen: Any
    _disk: DiskState
    _retry_s: float
    _orphan_grace_s: float
    _clock: Callable[[], float]
    _maybe_free: Callable[[str], None]

    @property
    def _tier(self) -> NvmeTier:
        """The NVMe tier, for the paths that run only where the store has one."""
        assert self.nvme is not None, "the store has no NVMe tier"
        return self.nvme

    def disk_fault(self) -> str:
        """The fault that turned the NVMe tier off, or "" while it writes."""
        return self._disk.fault if self._disk.mode == "off" else ""

    def _reserve_and_write(self, h: str, header: EncodedHeader, kv: BlockKV) -> None:
        """Reserve a new block's file bytes and queue its write (unless the tier is off: it waits in RAM)."""
        self._tier.used += header.file_size
        self._writing[h] = (0, header.file_size)
        if self._disk.mode != "off":
            self._queue_block(h, header, kv)

    def _queue_block(self, h: str, header: EncodedHeader, kv: BlockKV) -> None:
        gen = next(self._gen)
        self._writing[h] = (gen, header.file_size)
        self._tier.submit_block(h, gen, header, kv)
        self._pending += 1

    def _drop_file(self, h: str) -> None:
        _, reserved = self._writing.pop(h, (0, 0))
        self._tier.used -= reserved + self._tier.sizes.pop(h, 0)
        self._tier.submit_remove(h)
        self._pending += 1

    def _drain(self, wait: bool = False) -> None:
        """Retry an off tier when due; apply finished writer jobs; re-raise the first failure among them that is
        not a disk fault."""
        if self.nvme is None:
            return
        if self._disk.mode == "off" and self._clock() >= self._disk.retry_at:
            self._resume_writes()
        first: BaseException | None = None
        done = self.nvme.next_done(block=wait)
        while done is not None:
            error = self._apply(done)  # every result is applied, also after a failure
            first = first or error
            done = self.nvme.next_done(block=False)
        if first is not None:
            raise first

    def _apply(self, done: WriteDone) -> BaseException | None:
        if done.kind != "sync-error":
            self._pending -= 1
        if done.kind == "block" and self._writing.get(done.key, (0, 0))[0] == done.gen:
            _, size = self._writing.pop(done.key)
            if done.error is None:
                self._tier.sizes[done.key] = size
            else:
                self._writing[done.key] = (0, size)  # waits in RAM for the next retry
        if done.error is None:
            if done.kind in ("block", "manifest") and self._disk.mode == "retrying":
                self._disk.mode = "on"
                log.info("NVMe tier back on: writes land again in %s", self._tier.root)
                self._events.append({"event": "nvme_on"})
            return None
        self._counts["write_errors"] += 1
        self._events.append({"event": "write_error", "kind": done.kind, "key": done.key, "error": str(done.error)})
        if isinstance(done.error, OSError):
            self._turn_off(f"{done.kind} {done.key}: {done.error}".replace("  ", " "))
            return None
        log.error("NVMe %s %s failed: %s", done.kind, done.key, done.error)
        return done.error

    def _turn_off(self, fault: str) -> None:
        """Stop writing after a disk fault until ``retry_s`` from now; warn once per fault, not per failed retry."""
        self._disk.retry_at = self._clock() + self._retry_s
        if self._disk.mode == "off":
            return
        if self._disk.mode == "on":
            self._counts["nvme_faults"] += 1
            self._disk.fault = fault
            log.warning(
                "NVMe tier off after a disk fault (%s); steps continue from host RAM, writes retried every %.0f s",
                fault,
                self._retry_s,
            )
            self._events.append({"event": "nvme_off", "error": fault})
        else:
            log.debug("NVMe tier still failing: %s", fault)
        self._disk.mode = "off"

    def _resume_writes(self) -> None:
        """Queue again every block waiting in RAM and every workspace's manifest; on at once if there is none."""
        self._disk.mode = "retrying"
        queued = self._pending
        for h, (gen, _) in list(self._writing.items()):
            kv = self.host.get(h)
            if gen == 0 and kv is not None:
                self._queue_block(h, encode_header(self._metas[h], self.layout), kv)
        for ws in self.workspaces.all():
            self.workspaces.mark_dirty(ws.id)
        self._sync_manifests()
        if self._pending == queued:
            self._disk.mode = "on"

    def _sync_manifests(self) -> None:
        """Queue the manifests of workspaces changed since the last call (they stay marked while the tier is off)."""
        if self.nvme is not None and self._disk.mode == "off":
            return
        for ws_id in self.workspaces.take_dirty():
            ws = self.workspaces.get(ws_id)
            if self.nvme is not None and self.nvme.submit_manifest(ws_id, ws.manifest_later() if ws else None):
                self._pending += 1

    def _restore(self) -> None:
        metas, corrupt = self._tier.scan()
        self._metas = {m.chain_hash: m for m in metas}
        for name in corrupt:
            self._counts["corrupt"] += 1
            self._events.append({"event": "corrupt_block", "block": name, "error": "failed its check at start"})
        truncated = []
        for data in self._tier.read_manifests():
            ws = Workspace.from_manifest(data)
            whole = next((i for i, h in enumerate(ws.hashes) if h not in self._metas), len(ws.hashes))
            if whole < len(ws.hashes):
                log.warning(
                    "workspace %s: %d of its blocks are missing; keeping its first %d",
                    ws.id,
                    len(ws.hashes) - whole,
                    whole,
                )
                ws.hashes = ws.hashes[:whole]
                truncated.append(ws.id)
            self.workspaces.add(ws)
        self.workspaces.take_dirty()
        for ws_id in truncated:
            self.workspaces.mark_dirty(ws_id)
        self._collect_orphans([h for h in self._metas if not self.workspaces.owners(h)])
        self._sync_manifests()

    def _collect_orphans(self, unowned: list[str]) -> None:
        """Remove the files of blocks no manifest names (a crash cut their manifest update short): one pass over
        the blocks the start found. Never removed, only unindexed (the file stays, adopted again on a miss): a
        block another owner's manifest names (replicas sharing the directory, or replicas that used it before one
        engine), and, with an owner, one written less than ``orphan_grace_s`` ago (a live replica's manifest
        update may be in flight). A manifest of another owner that cannot be read keeps every file."""
        others = self._tier.others_named()
        self._foreign = others is None or bool(others[1])
        self._others_ws = None if others is None else others[0]
        grace = self._orphan_grace_s if self._tier.owner else 0.0
        for h in unowned:
            if others is None or h in others[1] or (grace > 0 and self._tier.age(h) < grace):
                self._forget(h)
                continue
            self._counts["orphans_removed"] += 1
            self._maybe_free(h)

    def _forget(self, h: str) -> None:
        """Unindex a block of a shared directory that no workspace here holds; its file stays for the others."""
        del self._metas[h]
        self._tier.forget(h)
