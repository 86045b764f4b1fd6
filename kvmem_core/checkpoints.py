"""Recurrent-state checkpoints of hybrid models.

A recurrent (DeltaNet) state cannot be subset like attention blocks: going on after token
N needs the state taken exactly after N tokens. ``Checkpoints`` keeps such states in host
memory, each keyed by the exact token ids it consumed, so a fork or another workspace that
shares the prefix finds it; the least recently used go first. The step takes them at turn
boundaries (the prefix-match point, the query's start, the end of each step) and at the
query-replay start. Where no checkpoint exists, the step recomputes from the latest
earlier one (the empty state at worst), never going on from a wrong state.

With an NVMe directory, every checkpoint is also written to disk (``CheckpointFiles``), so
after a restart a hybrid workspace resumes from its stored checkpoints instead of being
prefilled again from the start.

With a ``store``, checkpoints count in its budgets as side data of the workspace they were
first taken for (``kvmem_core.store_side``): the state's bytes in RAM under
``--kvmem-cpu-gb``, its file under ``--kvmem-nvme-gb``. One that does not fit is not kept
there (it is recomputed when needed); a workspace the store evicts or deletes takes its
checkpoints along at once. The files found at start are counted under their workspaces;
those whose workspace is gone (and no other replica's) are removed.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from kvmem_core.adapter import RecurrentCheckpoints
from kvmem_core.checkpoint_files import CheckpointFiles, file_bytes
from kvmem_core.errors import CorruptBlockError
from kvmem_core.step import common_prefix

if TYPE_CHECKING:
    from kvmem_core.store import BlockStore

MAX_CHECKPOINTS = 16  # a step takes up to four; a 27B qwen35 state is ~150 MB of host memory
MAX_DIGEST_STATES = 256  # saved hash states of ``PrefixKeys`` (a few hundred bytes each)


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """The recurrent state after ``n_tokens`` tokens, first taken for workspace ``ws_id``."""

    n_tokens: int
    ws_id: str
    state: Any


class Checkpoints:
    """Recurrent-state checkpoints keyed by the tokens they consumed (see module docstring).

    Created on an empty view: the adapter's state then is the empty (zero) state, which
    stands for the checkpoint of no tokens.
    """

    def __init__(
        self,
        adapter: RecurrentCheckpoints,
        capacity: int = MAX_CHECKPOINTS,
        files: CheckpointFiles | None = None,
        store: BlockStore | None = None,
    ) -> None:
        self.adapter, self.capacity, self.files, self.store = adapter, capacity, files, store
        self._zero = adapter.save_state()
        self._items: OrderedDict[bytes, Checkpoint] = OrderedDict()
        self.keys = PrefixKeys()
        if files is not None:
            files.on_remove = lambda key: self._release("nvme", key)

    @classmethod
    def open(
        cls, adapter: RecurrentCheckpoints, nvme_dir: Any, namespace: str, store: BlockStore | None = None
    ) -> Checkpoints:
        """Checkpoints in host memory, also written under ``nvme_dir`` (for model ``namespace``) when given;
        counted in ``store``'s budgets when given (see module docstring)."""
        checkpoints = cls(adapter, files=CheckpointFiles(nvme_dir, namespace) if nvme_dir else None, store=store)
        if store is not None:
            store.on_side_dropped, store.on_side_shed = checkpoints.forget, checkpoints.shed
            if checkpoints.files is not None:
                checkpoints._count_files()
        return checkpoints

    def _count_files(self) -> None:
        """Count the files found at start under their workspaces; remove those that do not fit or whose workspace
        is gone, unless another replica's manifest names it."""
        assert self.files is not None and self.store is not None, "files are counted in a store"
        for key, (_, ws_id) in list(self.files.index.items()):
            if not self._charge("nvme", key, ws_id, self.files.size(key)) and not self.store.foreign_workspace(ws_id):
                self.files.remove(key)

    def take(self, tokens: Sequence[int] | np.ndarray, ws_id: str, state: Any = None) -> None:
        """Keep the adapter's live state, or ``state`` (a ``save_state`` checkpoint the adapter handed out
        otherwise: ``ForwardOut.states``), as the state after exactly ``tokens`` (in RAM and on disk where it fits)."""
        key = self.keys.key(tokens)
        if key in self._items:
            self._items.move_to_end(key)
            return
        state = self.adapter.save_state() if state is None else state
        arrays = self.adapter.state_arrays(state)
        if self._charge("host", key, ws_id, sum(a.nbytes for a in arrays.values())):
            self._keep(key, Checkpoint(len(tokens), ws_id, state))
        if (
            self.files is not None
            and key not in self.files.index
            and self._charge("nvme", key, ws_id, file_bytes(arrays))
        ):
            self.files.put(key, len(tokens), ws_id, arrays)

    def _keep(self, key: bytes, checkpoint: Checkpoint) -> None:
        self._items[key] = checkpoint
        while len(self._items) > self.capacity:
            self._release("host", self._items.popitem(last=False)[0])

    def _charge(self, tier: str, key: bytes, ws_id: str, nbytes: int) -> bool:
        """Count a checkpoint in the store's ``tier``; False when it does not fit (always True without a store)."""
        return self.store is None or self.store.keep_side(tier, key.hex(), ws_id, nbytes)

    def _release(self, tier: str, key: bytes) -> None:
        if self.store is not None:
            self.store.drop_side(tier, key.hex())

    def has(self, tokens: Sequence[int] | np.ndarray) -> bool:
        return len(tokens) == 0 or self._has(self.keys.key(tokens))

    def _has(self, key: bytes) -> bool:
        return key in self._items or (self.files is not None and key in self.files.index)

    def restore(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Make the adapter's live state the state after ``tokens`` (``has(tokens)`` must hold). A checkpoint
        on disk that fails to load raises ``CorruptBlockError`` (it is gone then: the next step recomputes)."""
        if len(tokens) == 0:
            self.adapter.restore_state(self._zero)
            return
        key = self.keys.key(tokens)
        if key not in self._items:
            assert self.files is not None, "has(tokens) held: the checkpoint is on disk"
            n_tokens, ws_id = self.files.index[key]
            arrays = self.files.get(key)
            if arrays is None:
                raise CorruptBlockError(f"the recurrent-state checkpoint after {n_tokens} tokens failed to load")
            state = self.adapter.state_from_arrays(arrays)
            if not self._charge("host", key, ws_id, sum(a.nbytes for a in arrays.values())):
                self.adapter.restore_state(state)  # used once, not kept: no room in RAM
                return
            self._keep(key, Checkpoint(n_tokens, ws_id, state))
        self._items.move_to_end(key)
        self.adapter.restore_state(self._items[key].state)

    def latest(self, ids: Sequence[int], limit: int) -> int:
        """The largest ``n <= limit`` with a checkpoint of ``ids[:n]`` (0: the empty state)."""
        return self._first_held(ids, 1, limit + 1, reverse=True) or 0

    def earliest(self, ids: Sequence[int], lo: int, hi: int) -> int | None:
        """The smallest ``n`` in ``[lo, hi)`` with a checkpoint of ``ids[:n]``; None when there is none."""
        return self._first_held(ids, lo, hi, reverse=False)

    def _first_held(self, ids: Sequence[int], lo: int, hi: int, reverse: bool) -> int | None:
        """The first ``n`` in ``[lo, hi)``, in ascending order or ``reverse``d, with a checkpoint of ``ids[:n]``;
        only the checkpoints' lengths up to it are keyed."""
        arr = np.asarray(ids, dtype=np.int64)
        counts = {c.n_tokens for c in self._items.values()}
        if self.files is not None:
            counts |= {n for n, _ in self.files.index.values()}
        lengths = sorted((n for n in counts if lo <= n < min(hi, len(arr) + 1)), reverse=reverse)
        return next((n for n in lengths if n == 0 or self._has(self.keys.key(arr, n))), None)

    def replay_from(self, ids: Sequence[int], r0: int, mode: str) -> int | None:
        """Where a ``keep`` query replay starts: the first checkpoint at or after ``r0``. None: recompute
        the state over the whole view instead (``mode == "recompute"``, or there is no such checkpoint)."""
        return None if mode == "recompute" else self.earliest(ids, r0, len(ids))

    def resume(self, live: Sequence[int], ids: Sequence[int], cached: int, cut: Callable[[int], int]) -> int:
        """Make the live state the state after ``ids[:m]`` for the largest ``m <= cached`` possible; return m.

        ``live``: the tokens the live state has consumed. ``cut(m)`` shortens the view's
        computed tokens to at most ``m`` and returns how many remain (a cut inside a block
        that is not resident falls back to the block's start).
        """
        if len(live) == cached and common_prefix(live, ids) >= cached:
            return cached
        while True:
            m = self.latest(ids, cached)
            cached = cut(m)
            if cached == m:
                self.restore(ids[:m])
                return m

    def shed(self, tier: str, key_hex: str) -> None:
        """The store dropped a checkpoint from ``tier`` (``host``: RAM, ``nvme``: its file) to make room."""
        key = bytes.fromhex(key_hex)
        if tier == "host":
            self._items.pop(key, None)
        elif self.files is not None:
            self.files.remove(key)

    def forget(self, ws_id: str) -> None:
        """Drop the checkpoints first taken for workspace ``ws_id``."""
        for key in [k for k, c in self._items.items() if c.ws_id == ws_id]:
            del self._items[key]
            self._release("host", key)
        if self.files is not None:
            self.files.forget(ws_id)

    def close(self) -> None:
        """Finish writing checkpoints to disk."""
        if self.files is not None:
            self.files.close()


class PrefixKeys:
    """Checkpoint keys: the blake2b digest of the token ids' int64 bytes, computed from the saved hash state of the
    longest prefix hashed before. It holds one token sequence at a time (the last one asked about that did not
    start with it; a read-only array is taken as unchanging and held without a copy) and the states after its
    prefixes asked about, so a step's keys cost the tokens new since the last key, plus one comparison with that
    sequence of each array asked about that is not a prefix of the last read-only one. ``hashed`` counts tokens
    hashed."""

    def __init__(self) -> None:
        self._seq = np.zeros(0, dtype=np.int64)
        self._states: dict[int, Any] = {0: hashlib.blake2b(digest_size=16)}
        self._last: tuple[np.ndarray, int] | None = None  # a read-only array asked about, and its common prefix
        self.hashed = 0

    def key(self, tokens: Sequence[int] | np.ndarray, n: int | None = None) -> bytes:
        """The key of ``tokens[:n]`` (all of them when ``n`` is None)."""
        arr = np.asarray(tokens, dtype=np.int64)
        n = len(arr) if n is None else n
        same = self._common(arr)
        if same < n:  # hold ``arr`` instead: the states past the common prefix are another sequence's
            self._states = {p: h for p, h in self._states.items() if p <= same}
            self._seq, self._last = arr if not arr.flags.writeable else arr.copy(), None
        start = max(p for p in self._states if p <= n)
        h = self._states[start].copy()
        h.update(self._seq[start:n].tobytes())
        self.hashed += n - start
        if n not in self._states:
            if len(self._states) >= MAX_DIGEST_STATES:
                del self._states[min(p for p in self._states if p)]
            self._states[n] = h.copy()
        return h.digest()

    def _common(self, arr: np.ndarray) -> int:
        """Common prefix of ``arr`` and the sequence held. A read-only array that starts where the sequence held or the
        last one asked about starts (it again, or a slice of it: a step asks about several prefixes of its prompt) is
        compared only past what that tells."""
        if _same_start(arr, self._seq):
            return min(len(arr), len(self._seq))
        start = 0
        if self._last is not None and _same_start(arr, self._last[0]):
            held, start = self._last
            if start < len(held) or len(arr) <= len(held):
                return min(start, len(arr))
        same = start + common_prefix(self._seq[start:], arr[start:])  # ``arr`` agrees up to ``start``
        self._last = (arr, same) if not arr.flags.writeable else None
        return same


def _same_start(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether read-only ``a`` reads the memory ``b`` reads from its start on, in the same steps (``b``: an array the
    caller holds that no one writes to, so that memory holds the same tokens)."""
    return a is b or (
        not a.flags.writeable and a.strides == b.strides and a.ctypes.data == b.ctypes.data and a.dtype == b.dtype
    )
