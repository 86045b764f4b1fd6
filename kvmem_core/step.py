"""The engine's view of one trajectory and the moves that shape it.

``ViewState`` remembers which logical tokens have KV computed (``tokens``), which whole
blocks of them are resident in the adapter's view and at which view position, and the
*tail*: the tokens after the last whole block, always resident and contiguous. New tokens
go at ``next_pos``. Positions are logical in ``original`` mode; ``compact`` renumbers the
resident blocks contiguously so a workspace may outgrow the model's trained context.

Stored blocks keep K rotated at ``BlockMeta.start_pos`` (the view position they were
computed at); moving one to another position re-rotates it while writing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence, cast

import numpy as np

from kvmem_core.adapter import EngineAdapter, MovesCells, Placement
from kvmem_core.layout import BlockKV, BlockMeta

LoadBlocks = Callable[[Sequence[int]], list[tuple[BlockMeta, BlockKV]]]


@dataclass
class ViewState:
    """What the adapter's view holds for the trajectory ``tokens`` (see module docstring)."""

    block_tokens: int
    tokens: list[int] = field(default_factory=list)
    blocks: dict[int, int] = field(default_factory=dict)  # logical block index -> view position
    tail_pos: int = 0
    replayed_from: int | None = None  # first token whose resident KV was recomputed against a selected view
    _array: tuple[list[int], np.ndarray] | None = field(default=None, repr=False, compare=False)

    @property
    def tail_start(self) -> int:
        return len(self.tokens) // self.block_tokens * self.block_tokens

    @property
    def next_pos(self) -> int:
        return self.tail_pos + len(self.tokens) - self.tail_start

    def common_prefix(self, ids: Sequence[int] | np.ndarray) -> int:
        """Length of the common prefix of ``ids`` and the computed tokens."""
        return common_prefix(self.token_array(), ids)

    def token_array(self) -> np.ndarray:
        """``tokens`` as a read-only int64 array. The list is converted once; later calls convert only the tokens
        appended since (``tokens`` changes only by appends, or by being rebound to another list)."""
        held = self._array
        if held is not None and held[0] is self.tokens and len(held[1]) == len(self.tokens):
            return held[1]
        if held is not None and held[0] is self.tokens and len(held[1]) < len(self.tokens):
            arr = np.concatenate((held[1], np.asarray(self.tokens[len(held[1]) :], dtype=np.int64)))
        else:
            arr = np.asarray(self.tokens, dtype=np.int64)
        return self.assign(self.tokens, arr)

    def assign(self, tokens: list[int], array: np.ndarray) -> np.ndarray:
        """Make ``tokens`` the computed tokens, ``array`` (the same ids, int64) their ``token_array``."""
        assert len(tokens) == len(array), "the array holds the same tokens"
        array = array.view()
        array.flags.writeable = False
        self.tokens, self._array = tokens, (tokens, array)
        return array

    def keep(self, n: int) -> None:
        """Keep the first ``n`` computed tokens (their ``token_array`` stays converted)."""
        held = self._array
        tokens = self.tokens[:n]
        if held is not None and held[0] is self.tokens and len(held[1]) >= n:
            self.assign(tokens, held[1][:n])
        else:
            self.tokens, self._array = tokens, None


def common_prefix(a: Sequence[int] | np.ndarray, b: Sequence[int] | np.ndarray) -> int:
    """Length of the longest common prefix of two token sequences (one pass over int64 arrays: pass arrays, a
    list is converted first)."""
    n = min(len(a), len(b))
    x, y = np.asarray(a[:n], dtype=np.int64), np.asarray(b[:n], dtype=np.int64)
    if np.array_equal(x, y):
        return n
    return int(np.flatnonzero(x != y)[0])


def reset(view: ViewState, adapter: EngineAdapter) -> None:
    """Forget everything and empty the adapter's view."""
    adapter.clear_view()
    view.tokens, view.blocks, view.tail_pos, view.replayed_from = [], {}, 0, None


def truncate(view: ViewState, adapter: EngineAdapter, n: int) -> int:
    """Keep the computed tokens before ``n`` that can stay; return how many did.

    A cut inside a resident block keeps that block's head as the new tail; a cut inside a
    block that is not resident falls back to the block's start.
    """
    if n >= len(view.tokens):
        return len(view.tokens)
    if view.replayed_from is not None and n <= view.replayed_from:
        view.replayed_from = None  # what stays was computed before any replay
    bt = view.block_tokens
    if n >= view.tail_start:
        adapter.drop(view.tail_pos + n - view.tail_start, view.next_pos)
        view.keep(n)
        return n
    b0 = n // bt
    if b0 not in view.blocks:
        n = b0 * bt
    adapter.drop(view.tail_pos, view.next_pos)
    for b in [b for b in view.blocks if b > b0 or (b == b0 and n % bt == 0)]:
        adapter.drop(view.blocks[b], view.blocks.pop(b) + bt)
    if b0 in view.blocks:
        view.tail_pos = view.blocks.pop(b0)
        adapter.drop(view.tail_pos + n % bt, view.tail_pos + bt)
    else:
        view.tail_pos = max((p + bt for p in view.blocks.values()), default=0)
    view.keep(n)
    return n


def append_computed(view: ViewState, tokens: Sequence[int]) -> list[int]:
    """Record ``tokens`` as computed at ``next_pos`` onward; return the block indices they completed."""
    bt = view.block_tokens
    done = []
    for t in tokens:
        view.tokens.append(int(t))
        if len(view.tokens) % bt == 0:
            b = len(view.tokens) // bt - 1
            view.blocks[b] = view.tail_pos
            view.tail_pos += bt
            done.append(b)
    return done


def materialize(
    view: ViewState, adapter: EngineAdapter, target: dict[int, int], tail_pos: int, load: LoadBlocks
) -> tuple[int, int, int]:
    """Make the view hold exactly the ``target`` blocks (index -> position) plus the tail at ``tail_pos``.

    Blocks resident elsewhere move where the adapter moves cells (``caps.moves_cells``), the tail with them; elsewhere
    they are dropped and reloaded (the store holds every whole block) and the tail is read out and rewritten.
    Returns (blocks loaded, blocks dropped, blocks moved).
    """
    bt = view.block_tokens
    assert all(tail_pos >= p + bt for p in target.values()), "the tail must come after every block"
    moves = adapter.caps.moves_cells
    n_tail = len(view.tokens) - view.tail_start
    tail_moves = n_tail > 0 and tail_pos != view.tail_pos
    moving = {b: p for b, p in target.items() if b in view.blocks and view.blocks[b] != p} if moves else {}
    tail_kv = adapter.read_block(view.tail_pos, n_tail) if tail_moves and not moves else None
    stale = [b for b, p in view.blocks.items() if target.get(b) != p and b not in moving]
    for b in stale:
        pos = view.blocks.pop(b)
        adapter.drop(pos, pos + bt)
    if tail_kv is not None:
        adapter.drop(view.tail_pos, view.tail_pos + n_tail)
    cells = [(view.blocks[b], p, bt) for b, p in moving.items()]
    if tail_moves and moves:
        cells.append((view.tail_pos, tail_pos, n_tail))
    if cells:
        cast(MovesCells, adapter).move_cells(cells)
    view.blocks.update(moving)
    missing = sorted(b for b in target if b not in view.blocks)
    placements = [Placement(kv, meta.start_pos, target[b]) for b, (meta, kv) in zip(missing, load(missing))]
    if tail_kv is not None:
        placements.append(Placement(tail_kv, view.tail_pos, tail_pos))
    adapter.write_blocks(placements)
    view.blocks.update({b: target[b] for b in missing})
    view.tail_pos = tail_pos
    return len(missing), len(stale), len(moving)


def chunk_cuts(start: int, end: int, chunk: int, marks: Sequence[int] = ()) -> list[int]:
    """Chunk boundaries of a prefill of ``[start, end)``: every ``chunk`` tokens and at each mark inside."""
    return sorted(set(range(start, end, chunk)) | {m for m in marks if start < m < end} | {end})


def view_sequence(view: ViewState) -> tuple[list[int], list[int]]:
    """The view's tokens and their positions in view order: resident blocks, then the tail."""
    bt, tokens, positions = view.block_tokens, list[int](), list[int]()
    for b in sorted(view.blocks):
        tokens += view.tokens[b * bt : (b + 1) * bt]
        positions += range(view.blocks[b], view.blocks[b] + bt)
    tokens += view.tokens[view.tail_start :]
    positions += range(view.tail_pos, view.next_pos)
    return tokens, positions


def refill(view: ViewState, adapter: EngineAdapter, empty_state: Callable[[], None]) -> np.ndarray:
    """Recompute the whole view in place from the empty recurrent state; return the last logits.

    Hybrid models' ``recompute`` mode: the recurrent state (and attention KV) then cover
    exactly the view's tokens. ``empty_state`` puts the empty recurrent state back.
    """
    tokens, positions = view_sequence(view)
    adapter.clear_view()
    empty_state()
    out = adapter.forward(tokens, positions)
    assert out.logits is not None
    return out.logits
