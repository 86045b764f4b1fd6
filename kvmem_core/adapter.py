"""What an engine binding implements so that the backend-neutral step can drive it.

The adapter owns one *view*: the bounded set of KV cells the model attends to, each at an
explicit position. The core decides what the view holds; the adapter only runs forwards
over it and moves blocks of KV in and out. Shapes use the adapter's ``layout``:
K and V of a block are ``[layers, tokens, kv heads, head dim]`` in the engine's frame
(K rotated at the block's stored start position).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import numpy as np

from kvmem_core.layout import BlockKV, BlockLayout
from kvmem_core.retrieval.summaries import SummaryOptions

PREFILL_CHUNK = 512  # tokens per prefill forward unless the adapter asks for more


@dataclass(frozen=True)
class Capabilities:
    """Declared once per loaded model; the core plans around these."""

    backend: str
    max_view_tokens: int  # cells the view holds (history budget + generation reserve must fit)
    trained_ctx: int  # positions the model was trained on (compact mode keeps the view inside them)
    position_modes: tuple[str, ...] = ("original", "compact")
    paged_slots: bool = False  # True: the core addresses KV slots directly (torch engine)
    recurrent_state: bool = False  # True: hybrid model with checkpoints to save/restore
    async_copies: bool = False
    devices: tuple[str, ...] = ("cpu",)
    prefill_chunk: int = PREFILL_CHUNK  # tokens per prefill forward the adapter asks for (more on a GPU: larger GEMMs)
    # True: ``forward`` takes ``stop_after`` (compute only the layers up to it); with ``MovedBlocks`` too, a probe
    # also runs in compact position mode
    probe: bool = False
    # True: ``stage_reads(starts, n_tokens)`` takes the KV of those view blocks now (on a GPU: queued copies to the
    # host) and ``read_block`` of each hands it out later, after forwards and drops in between (the prefill
    # archives a chunk's blocks while the next chunk computes)
    staged_reads: bool = False
    draft_head: bool = False  # True: the model carries MTP layers and ``draft_head()`` makes a drafter from them
    # True: ``forward_every`` of a lookup draft costs about a one-token step (a CUDA graph verifies it), so
    # ``--speculative auto`` drafts
    cheap_drafts: bool = False
    # True: ``forward`` takes ``snapshot_at`` (offsets into its tokens) and hands out the recurrent state after
    # each in ``ForwardOut.states``, so a checkpoint does not end a forward (``kvmem_core.prefill``)
    snapshots: bool = False
    # True: ``move_cells`` (``MovesCells``) gives resident cells new positions in place, so materialization moves
    # the blocks that stay in the view instead of dropping and reloading them
    moves_cells: bool = False


@dataclass(frozen=True, eq=False)
class Placement:
    """One block to write into the view: its KV as stored at ``src_pos``, placed at ``dst_pos``."""

    kv: BlockKV
    src_pos: int
    dst_pos: int


class ForwardOut:
    """Result of a forward over the view.

    ``logits``: float32 ``[vocab]`` of the last token (None when not asked for); it may be a view of the
    backend's own buffer, not to be written and valid until the adapter's next ``forward``: copy it to keep it.
    ``queries``: float32 pre-RoPE ``[layers, captured tokens, query heads, head dim]``
    for the tokens asked for with ``capture_from`` (None otherwise): the query projection
    without its bias (the bias pulls every query toward the same keys, whatever it asks); the caller's own.
    ``states``: the recurrent states after the tokens asked for with ``snapshot_at`` (``save_state``'s kind of
    checkpoint), in that order (None when not asked for).
    A forward may return while the device still computes or copies these: each may be given as a call that
    waits for it (``read``, ``read_queries``, ``read_states``), made on its first access, so the caller's host
    work can overlap the device's. Read the logits before the next forward; queries and states stay valid.
    """

    __slots__ = ("_values", "_reads")

    def __init__(
        self,
        logits: np.ndarray | None = None,
        queries: np.ndarray | None = None,
        *,
        read: Callable[[], np.ndarray] | None = None,
        read_queries: Callable[[], np.ndarray] | None = None,
        read_states: Callable[[], list[Any]] | None = None,
    ) -> None:
        self._values: dict[str, Any] = {"logits": logits, "queries": queries, "states": None}
        self._reads = {k: f for k, f in (("logits", read), ("queries", read_queries), ("states", read_states)) if f}

    def _get(self, name: str) -> Any:
        read = self._reads.pop(name, None)
        if read is not None:
            self._values[name] = read()
        return self._values[name]

    @property
    def logits(self) -> np.ndarray | None:
        return self._get("logits")

    @property
    def queries(self) -> np.ndarray | None:
        return self._get("queries")

    @property
    def states(self) -> list[Any] | None:
        return self._get("states")


@runtime_checkable
class EngineAdapter(Protocol):
    """A loaded model and its view. Calls are serialized by the core."""

    model_id: str
    model_path: str
    fingerprint: str  # stable id of the weights file, keys calibration profiles
    chat_template: str  # the model's jinja2 chat template source
    caps: Capabilities
    layout: BlockLayout

    def tokenize(self, text: str, *, special: bool = True) -> list[int]:
        """Token ids of ``text``; ``special`` parses control tokens such as ``<|im_start|>``."""
        ...

    def token_array(self, text: str) -> np.ndarray:
        """``tokenize(text)`` (control tokens parsed) as a read-only int64 array: what a prompt is built from. A
        long transcript tokenizes into it incrementally, and no list of its million ids is made."""
        ...

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` (control tokens rendered as text)."""
        ...

    def token_bytes(self, token: int) -> bytes:
        """Raw bytes of one token, for streaming text that may split UTF-8 sequences."""
        ...

    def is_eog(self, token: int) -> bool:
        """True for end-of-generation tokens (EOS, EOT, ``<|im_end|>``...)."""
        ...

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """The model's own chat template applied to ``messages``."""
        ...

    def forward(
        self,
        tokens: Sequence[int],
        positions: Sequence[int],
        *,
        want_logits: bool = True,
        capture_from: int | None = None,
    ) -> ForwardOut:
        """Append ``tokens`` at ``positions`` to the view and run the model over them.

        Positions must exceed every position already in the view. ``capture_from``: index
        into ``tokens`` from which pre-RoPE queries are returned. ``stop_after`` (adapters with
        ``caps.probe``; needs ``capture_from``): a *probe* that computes layers up to that one only: their
        queries are returned (deeper ones as zeros), no logits, and the new cells hold valid K and V up to that
        layer only, so the caller drops them before anything attends to them. ``snapshot_at`` (adapters with
        ``caps.snapshots``): ascending offsets inside ``tokens`` (0 < offset < len(tokens)); the recurrent state
        after each comes back in ``ForwardOut.states``, as ``save_state`` would have taken it there.
        """
        ...

    def view_free(self) -> int:
        """Cells still free in the view."""
        ...

    def read_block(self, start_pos: int, n_tokens: int) -> BlockKV:
        """Copy out the KV of the view cells at positions ``[start_pos, start_pos + n_tokens)``."""
        ...

    def write_blocks(self, placements: Sequence[Placement]) -> None:
        """Write blocks into the view, re-rotating K where ``dst_pos != src_pos``."""
        ...

    def drop(self, p0: int, p1: int) -> None:
        """Remove the view cells with positions in ``[p0, p1)`` (p1 < 0: to the end)."""
        ...

    def clear_view(self) -> None:
        """Empty the view."""
        ...

    def content_keys(self, k: np.ndarray, start_pos: int) -> np.ndarray:
        """Pre-RoPE (content-frame) float32 keys of a block's stored K rotated at ``start_pos``."""
        ...

    def close(self) -> None:
        """Free the model and its buffers; the adapter is unusable afterwards."""
        ...


@runtime_checkable
class RecurrentCheckpoints(Protocol):
    """Also implemented by adapters whose models keep recurrent state (``caps.recurrent_state``).

    The state cannot be subsetted like attention blocks: a replay from position N restores
    the checkpoint taken at N.
    """

    def save_state(self) -> Any:
        """Checkpoint of the recurrent state at the view's current end."""
        ...

    def restore_state(self, snap: Any) -> None:
        """Put a checkpoint taken by ``save_state`` back."""
        ...

    def state_arrays(self, snap: Any) -> dict[str, np.ndarray]:
        """A checkpoint as named numpy arrays (to write it to disk); ``state_from_arrays`` inverts it exactly."""
        ...

    def state_from_arrays(self, arrays: dict[str, np.ndarray]) -> Any:
        """The checkpoint ``state_arrays`` described."""
        ...


def file_fingerprint(path: str) -> str:
    """Stable 16-hex id of a weights file: its size plus its first and last MiB (fast on large files)."""
    size = os.path.getsize(path)
    h = hashlib.blake2b(digest_size=8)
    h.update(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()


@runtime_checkable
class StagedReads(Protocol):
    """Also implemented by adapters with ``caps.staged_reads``."""

    def stage_reads(self, starts: Sequence[int], n_tokens: int) -> None:
        """Take the KV of the ``n_tokens`` view cells from each of ``starts`` now; ``read_block`` of each hands it
        out later, after forwards and drops in between."""
        ...


@runtime_checkable
class StagedSummaries(Protocol):
    """Also implemented by adapters that summarize staged blocks where their KV is (a GPU), so the host need not."""

    def summarize_staged(self, heads: Sequence[tuple[int, int]], opts: SummaryOptions) -> None:
        """From now on ``stage_reads`` may also compute each block's scoring summaries for these index heads and
        options, as ``summarize_block`` computes them from its content keys."""
        ...

    def staged_summary(self, start_pos: int, n_tokens: int) -> dict[str, np.ndarray] | None:
        """A staged block's summaries, asked before its ``read_block``; None where ``stage_reads`` computed none."""
        ...


@runtime_checkable
class WarmUp(Protocol):
    """Also implemented by adapters whose kernels compile on their first use (a GPU's), to compile them at start."""

    def warm_up(self) -> float:
        """Run once what a first step runs, then empty the view: a step finds it as if nothing had run.
        -> seconds taken (0 where nothing needs it)"""
        ...


@runtime_checkable
class MovedBlocks(Protocol):
    """Also implemented by adapters that re-rotate K on the host (a compact-mode probe moves held blocks back)."""

    def moved(self, kv: BlockKV, src_pos: int, dst_pos: int) -> BlockKV:
        """``kv`` (computed at positions from ``src_pos``) as computed at positions from ``dst_pos``: K re-rotated
        in its own storage, V as is."""
        ...


@runtime_checkable
class MovesCells(Protocol):
    """Also implemented by adapters that give resident cells new positions in place (a paged view whose keys are
    rotated when read; ``caps.moves_cells``)."""

    def move_cells(self, moves: Sequence[tuple[int, int, int]]) -> None:
        """For each (src, dst, n), at once: the resident cells at positions ``[src, src + n)`` take positions
        ``[dst, dst + n)``, their KV unchanged. Every source is resident; afterwards no two cells share a position."""
        ...
