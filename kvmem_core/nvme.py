"""The NVMe tier: one file per block plus one manifest per workspace, under a directory.

Files live in ``<nvme_dir>/<layout hash>/{blocks,workspaces}``, so models with other layouts
never see each other's blocks. Writes go through one background writer thread, in
order: each file is written to a temp name and renamed into place, so a file is visible
only once complete and a process crash loses at most the jobs in flight. Every
``SYNC_BYTES`` and at each ``submit_sync`` barrier the writer makes what it published
durable with one ``syncfs`` (one journal commit for many files; per-file fsync where
syncfs is missing); a power loss can cost the files since the last sync, which their
checks then report as missing. Several processes (server replicas) may share one directory:
block files are content-addressed and published by rename under a temp name unique to the
process, so a reader never sees a partial file and two writers of one block are harmless;
with an ``owner`` each keeps its manifests in ``workspaces/<owner>`` and finds blocks the
others wrote with ``adopt``. Loads run on a small pool of I/O
threads (I/O waits overlap even where threads share one core). Bookkeeping (which blocks
are on disk, reserved bytes) is the caller's thread's alone; the threads only touch
files and report ``WriteDone`` records, including their errors, through a queue.
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import os
import queue
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable

from kvmem_core.blockfile import SUFFIX, EncodedHeader, read_block, read_meta, write_block
from kvmem_core.errors import BlockDtypeError, CorruptBlockError
from kvmem_core.layout import BlockKV, BlockLayout, BlockMeta

log = logging.getLogger("kvmem.nvme")
SYNC_BYTES = 256 << 20
Manifest = Callable[[], bytes] | None  # a workspace manifest's encoding, called by the writer; None: delete it
_STOP = None


@dataclass(frozen=True)
class WriteDone:
    """A finished writer job (block/manifest/remove/sync) or a failed periodic sync (sync-error)."""

    kind: str
    key: str
    gen: int
    error: BaseException | None


@dataclass(frozen=True)
class _Job:
    kind: str
    key: str
    gen: int
    path: Path
    size: int
    write: Callable[[BinaryIO], object] | None  # None: remove the file (what a writer returns is unused)


class NvmeTier:
    """Block files and workspace manifests of one layout; ``used`` counts reserved bytes."""

    def __init__(
        self,
        root: Path,
        layout: BlockLayout,
        capacity: int,
        *,
        fsync: bool = True,
        io_threads: int = 8,
        owner: str = "",
    ) -> None:
        self.layout = layout
        self.owner = owner
        self.capacity = capacity
        self.used = 0
        self.sizes: dict[str, int] = {}  # blocks whose file is complete on disk
        self.root = Path(root) / layout.layout_hash()
        self.blocks_dir = self.root / "blocks"
        self.ws_dir = self.root / "workspaces" / owner if owner else self.root / "workspaces"
        for d in (self.blocks_dir, self.ws_dir):
            d.mkdir(parents=True, exist_ok=True)
        self._manifests: dict[str, Manifest] = {}
        self._manifest_lock = threading.Lock()
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.done: queue.SimpleQueue[WriteDone] = queue.SimpleQueue()  # read through next_done
        self._writer = threading.Thread(target=self._run_writer, args=(fsync,), name="kvmem-nvme-writer", daemon=True)
        self._writer.start()
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kvmem-nvme-load")

    def path(self, block_hash: str) -> Path:
        return self.blocks_dir / (block_hash + SUFFIX)

    def scan(self) -> tuple[list[BlockMeta], list[str]]:
        """Index every valid block file; remove invalid files (returned by name) and the temp leftovers of
        processes no longer running (another live process may be writing its own)."""
        metas, corrupt = [], []
        for p in sorted(self.blocks_dir.iterdir()):
            if p.suffix != SUFFIX:
                if not writer_alive(p):
                    p.unlink(missing_ok=True)
                continue
            try:
                meta, size = self._read_header(p)
            except FileNotFoundError:
                continue  # removed by another process sharing the directory
            except BlockDtypeError as exc:
                log.warning("nvme: skipping a block file of another KV dtype: %s", exc)
                continue
            except (CorruptBlockError, OSError, ValueError, KeyError) as exc:
                log.warning("nvme: dropping unreadable block file: %s", exc)
                corrupt.append(p.name)
                p.unlink(missing_ok=True)
                continue
            metas.append(meta)
            self.sizes[meta.chain_hash] = size
            self.used += size
        return metas, corrupt

    def adopt(self, block_hash: str) -> BlockMeta | None:
        """Index a block another process sharing the directory wrote; None when there is no valid file of it
        (an invalid one is left for the scan at start: it may be in use elsewhere)."""
        if block_hash in self.sizes:
            return None
        try:
            meta, size = self._read_header(self.path(block_hash))
        except FileNotFoundError:
            return None
        except (CorruptBlockError, OSError, ValueError, KeyError) as exc:
            log.warning("nvme: not adopting unreadable block file: %s", exc)
            return None
        self.sizes[block_hash] = size
        self.used += size
        return meta

    def forget(self, block_hash: str) -> None:
        """Stop indexing a block file without removing it (another process sharing the directory may use it)."""
        self.used -= self.sizes.pop(block_hash, 0)

    def _read_header(self, path: Path) -> tuple[BlockMeta, int]:
        meta, size = read_meta(path, self.layout)
        if meta.chain_hash != path.stem:
            raise CorruptBlockError(f"{path.name}: holds block {meta.chain_hash}")
        return meta, size

    def read_manifests(self) -> list[dict[str, Any]]:
        """Every workspace manifest (unreadable ones are logged and skipped)."""
        out = []
        for p in sorted(self.ws_dir.glob("*.json")):
            try:
                out.append(json.loads(p.read_bytes()))
            except (OSError, ValueError) as exc:
                log.warning("nvme: skipping unreadable workspace manifest %s: %s", p.name, exc)
        return out

    def others_named(self) -> tuple[set[str], set[str]] | None:
        """The workspace ids and block hashes the other owners' manifests name (every manifest under
        ``workspaces/`` but this store's own); None when one of them cannot be read: it may name anything."""
        top = self.root / "workspaces"
        dirs = [top, *(d for d in top.iterdir() if d.is_dir())]
        ws_ids: set[str] = set()
        hashes: set[str] = set()
        for d in dirs:
            if d == self.ws_dir:
                continue
            for p in d.glob("*.json"):
                try:
                    data = json.loads(p.read_bytes())
                    ws_ids.add(data["id"])
                    hashes.update(data["hashes"])
                except FileNotFoundError:
                    continue  # deleted by its owner meanwhile: it names nothing any more
                except (OSError, ValueError, KeyError, TypeError) as exc:
                    log.warning("nvme: unreadable manifest %s: no orphan is collected this start: %s", p, exc)
                    return None
        return ws_ids, hashes

    def age(self, block_hash: str) -> float:
        """Seconds since a block file was last written (0 when it is gone)."""
        try:
            return max(0.0, time.time() - self.path(block_hash).stat().st_mtime)
        except FileNotFoundError:
            return 0.0

    def submit_block(self, block_hash: str, gen: int, header: EncodedHeader, kv: BlockKV) -> None:
        """Queue a block file write; its bytes must already be reserved."""

        def write(f: BinaryIO) -> None:
            write_block(f, header, kv)

        self._jobs.put(_Job("block", block_hash, gen, self.path(block_hash), header.file_size, write))

    def submit_remove(self, block_hash: str) -> None:
        """Queue a block file removal (after any queued write of it)."""
        self._jobs.put(_Job("remove", block_hash, 0, self.path(block_hash), 0, None))

    def submit_sync(self) -> None:
        """Queue a barrier: everything queued before it is fsynced when it completes."""
        self._jobs.put(_Job("sync", "", 0, self.root, 0, None))

    def submit_manifest(self, ws_id: str, data: Manifest) -> bool:
        """Queue the latest manifest of a workspace (None deletes it; the writer thread calls ``data`` for the
        bytes); True if a job was queued.

        Successive calls before the writer gets to it coalesce into one write.
        """
        with self._manifest_lock:
            queued = ws_id in self._manifests
            self._manifests[ws_id] = data
        if not queued:
            self._jobs.put(_Job("manifest", ws_id, 0, self.ws_dir / f"{ws_id}.json", 0, None))
        return not queued

    def next_done(self, block: bool) -> WriteDone | None:
        """The next finished job; with ``block``, wait for one (the writer must be alive)."""
        while True:
            try:
                return self.done.get(timeout=0.5) if block else self.done.get_nowait()
            except queue.Empty:
                if not block:
                    return None
                if not self._writer.is_alive():
                    raise RuntimeError("the NVMe writer thread has stopped")

    def load(self, block_hash: str) -> Future[tuple[BlockMeta, BlockKV]]:
        """Start reading a block in the background; the future raises on a bad or missing file."""
        return self._pool.submit(read_block, self.path(block_hash), self.layout)

    def close(self) -> None:
        """Finish queued jobs, then stop the threads."""
        self._jobs.put(_STOP)
        self._writer.join()
        self._pool.shutdown(wait=True)

    def _take_manifest(self, job: _Job) -> _Job:
        """Bind a manifest job to the workspace's latest data (coalesced since it was queued)."""
        with self._manifest_lock:
            data = self._manifests.pop(job.key)
        if data is None:
            return _Job("manifest", job.key, 0, job.path, 0, None)
        try:
            encoded = data()
        except Exception as exc:  # reaches the caller's thread through WriteDone, as a failed write does
            return _Job("manifest", job.key, 0, job.path, 0, functools.partial(_fail, exc))
        return _Job("manifest", job.key, 0, job.path, len(encoded), lambda f: f.write(encoded))

    def _run_writer(self, fsync: bool) -> None:
        unsynced: list[Path] = []
        size = 0
        job = self._jobs.get()
        while job is not _STOP:
            job = self._take_manifest(job) if job.kind == "manifest" else job
            error = None if job.kind == "sync" else _attempt(_publish, job)
            if job.write is not None and error is None:
                unsynced.append(job.path)
                size += job.size
            sync_error = None
            if fsync and unsynced and (job.kind == "sync" or size >= SYNC_BYTES):
                sync_error = _attempt(_sync_all, unsynced)
                unsynced, size = [], 0
            if job.kind == "sync":
                error = sync_error
            elif sync_error is not None:
                self.done.put(WriteDone("sync-error", str(self.root), 0, sync_error))
            self.done.put(WriteDone(job.kind, job.key, job.gen, error))
            job = self._jobs.get()
        if fsync and unsynced:
            _attempt(_sync_all, unsynced)


def temp_path(path: Path) -> Path:
    """The temp name a file is written under before its rename: unique to this process, so processes sharing
    the directory never write into each other's temp file."""
    return path.with_name(f"{path.name}.{os.getpid()}.tmp")


def writer_alive(temp: Path) -> bool:
    """True when ``temp`` is the temp file (``temp_path``) of another process still running: not a leftover."""
    parts = temp.name.split(".")
    if len(parts) < 3 or parts[-1] != "tmp" or not parts[-2].isdigit():
        return False
    pid = int(parts[-2])
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fail(exc: Exception, f: BinaryIO) -> None:
    raise exc


def _attempt(fn: Callable[[Any], None], arg: Any) -> BaseException | None:
    try:
        fn(arg)
    except Exception as exc:  # every failure reaches the caller's thread through WriteDone
        return exc
    return None


def _publish(job: _Job) -> None:
    if job.write is None:
        job.path.unlink(missing_ok=True)
        return
    try:
        with open(temp_path(job.path), "wb") as f:
            job.write(f)
        os.replace(temp_path(job.path), job.path)
    except Exception:
        temp_path(job.path).unlink(missing_ok=True)
        raise


def _sync_all(paths: list[Path]) -> None:
    """Make published files durable: one syncfs of their filesystem, else fsync each and its directory."""
    if _syncfs(paths[0].parent):
        return
    for path in paths:
        try:
            _fsync_path(path)
        except FileNotFoundError:
            pass
    for d in sorted({p.parent for p in paths}):
        _fsync_path(d)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _syncfs(directory: Path) -> bool:
    """syncfs(2): one journal commit for the whole filesystem instead of one per file (Linux)."""
    if _LIBC is None or not hasattr(_LIBC, "syncfs"):
        return False
    fd = os.open(directory, os.O_RDONLY)
    try:
        return _LIBC.syncfs(fd) == 0
    finally:
        os.close(fd)


_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
