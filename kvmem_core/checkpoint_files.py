"""Recurrent-state checkpoints on disk beside the NVMe tier, so a restart resumes hybrid workspaces.

One ``.npz`` file per checkpoint under ``<nvme_dir>/checkpoints/<namespace hash>/``, named
by the checkpoint's key (the hash of the exact tokens it consumed); it holds the state's
arrays, the token count and the workspace id. Writes run on one background thread (a
27B-shaped state is ~150 MB), to a temporary name renamed into place, so a crash never
leaves a partial file under a final name. A file that fails to load (zip CRC, truncation)
is deleted and reported; the step then recomputes. At most ``capacity`` files are kept;
the least recently written go first. Server replicas may share the directory: temp names
are unique per process; a checkpoint another replica wrote after this one started is not
known here (that step recomputes the state), and one it removes is reported missing.
"""

from __future__ import annotations

import hashlib
import os
import zipfile
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np

from kvmem_core.nvme import temp_path, writer_alive

MAX_FILES = 32  # a 27B-shaped state is ~150 MB: up to ~5 GB of disk per model
_STATE = "state_"
_NPZ_ENTRY = 1024  # more than a zip member's headers and an .npy header take


def file_bytes(arrays: dict[str, np.ndarray]) -> int:
    """An upper bound on the size of the file ``put`` writes for ``arrays`` (what the disk budget reserves)."""
    return sum(a.nbytes for a in arrays.values()) + _NPZ_ENTRY * (len(arrays) + 3)


class CheckpointFiles:
    """The checkpoint files of one model namespace (see module docstring)."""

    def __init__(self, root: Path | str, namespace: str, capacity: int = MAX_FILES) -> None:
        self.dir = Path(root) / "checkpoints" / hashlib.blake2b(namespace.encode(), digest_size=8).hexdigest()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.capacity = capacity
        self.index: OrderedDict[bytes, tuple[int, str]] = self._scan()  # key -> (n_tokens, ws_id), oldest first
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvmem-checkpoints")
        self._pending: dict[bytes, Future[None]] = {}
        self.on_remove: Callable[[bytes], None] | None = None  # told of every key removed (budget accounting)

    def _path(self, key: bytes) -> Path:
        return self.dir / f"{key.hex()}.npz"

    def _scan(self) -> OrderedDict[bytes, tuple[int, str]]:
        for tmp in self.dir.glob("*.tmp"):
            if not writer_alive(tmp):  # a write cut short by a crash, not one of another replica's in flight
                tmp.unlink(missing_ok=True)
        found = []
        for path in self.dir.glob("*.npz"):
            try:
                with np.load(path) as z:
                    found.append((path.stat().st_mtime, bytes.fromhex(path.stem), int(z["n_tokens"]), str(z["ws_id"])))
            except (OSError, ValueError, KeyError, zipfile.BadZipFile):
                path.unlink(missing_ok=True)
        return OrderedDict((key, (n, ws)) for _, key, n, ws in sorted(found))

    def put(self, key: bytes, n_tokens: int, ws_id: str, arrays: dict[str, np.ndarray]) -> None:
        """Write a checkpoint in the background (nothing if ``key`` is on disk already); ``arrays`` must not
        change afterwards."""
        if key in self.index:
            return
        self.index[key] = (n_tokens, ws_id)
        self._pending[key] = self._pool.submit(self._write, key, n_tokens, ws_id, arrays)
        while len(self.index) > self.capacity:
            self.remove(next(iter(self.index)))

    def _write(self, key: bytes, n_tokens: int, ws_id: str, arrays: dict[str, np.ndarray]) -> None:
        path = self._path(key)
        tmp = temp_path(path)
        with open(tmp, "wb") as f:
            # numpy's stub types **kwds as if they could name its allow_pickle flag; the keys here all start with _STATE
            np.savez(f, n_tokens=np.int64(n_tokens), ws_id=np.str_(ws_id), **{_STATE + k: v for k, v in arrays.items()})  # type: ignore[arg-type]
        os.replace(tmp, path)

    def get(self, key: bytes) -> dict[str, np.ndarray] | None:
        """The arrays of a checkpoint on disk; None (and the file removed) if it fails to load."""
        pending = self._pending.pop(key, None)
        try:
            if pending is not None:
                pending.result()
            with np.load(self._path(key)) as z:
                return {k[len(_STATE) :]: z[k] for k in z.files if k.startswith(_STATE)}
        except (OSError, ValueError, KeyError, zipfile.BadZipFile):
            self.remove(key)
            return None

    def size(self, key: bytes) -> int:
        """Bytes of a checkpoint's file on disk (0 when it is gone)."""
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            return 0

    def forget(self, ws_id: str) -> None:
        """Delete the checkpoints first taken for workspace ``ws_id``."""
        for key in [k for k, (_, ws) in self.index.items() if ws == ws_id]:
            self.remove(key)

    def remove(self, key: bytes) -> None:
        """Delete a checkpoint (after its write if that is still queued: one writer thread)."""
        self.index.pop(key, None)
        self._pending.pop(key, None)
        self._pool.submit(self._path(key).unlink, missing_ok=True)
        if self.on_remove is not None:
            self.on_remove(key)

    def close(self) -> None:
        """Finish the writes in flight."""
        self._pool.shutdown(wait=True)
