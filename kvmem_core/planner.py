"""View planner: from the blocks in the engine's view and a new selection, what to move.

Two position modes:

- ``compact``: the selected blocks sit in chronological order at contiguous positions from
  0, so a short-context model can read a workspace many times its trained context.
- ``original``: every block keeps its original positions. Engines continue new tokens at the
  view's last position + 1, so the selection must end with the workspace's newest block.

Kept blocks whose position changes are listed in ``move`` (the engine re-rotates their K).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

POSITION_MODES = ("compact", "original")


@dataclass(frozen=True)
class ViewBlock:
    """A selected block: id (chain hash), original start position and token count."""

    block_id: str
    start_pos: int
    n_tokens: int


@dataclass(frozen=True)
class ViewEntry:
    """A block at a view slot: its id, the position of its first token in the view, its tokens."""

    block_id: str
    pos: int
    n_tokens: int


@dataclass(frozen=True)
class Move:
    """A kept block that changes position."""

    block_id: str
    old_pos: int
    new_pos: int


@dataclass(frozen=True)
class ViewPlan:
    """What to do to go from the current view to the selected one.

    ``load``: selected blocks not in the view (chronological); ``drop``: view blocks not
    selected (slot order); ``move``: kept blocks whose position changes; ``slots``: the
    resulting view in slot order (chronological); ``next_pos``: where new tokens continue.
    """

    load: tuple[str, ...]
    drop: tuple[str, ...]
    move: tuple[Move, ...]
    slots: tuple[ViewEntry, ...]
    next_pos: int

    @property
    def is_noop(self) -> bool:
        return not (self.load or self.drop or self.move)


def plan_view(
    current: Sequence[ViewEntry], selection: Sequence[ViewBlock], mode: str, newest_start: int | None = None
) -> ViewPlan:
    """Plan the view for ``selection`` (any order; it is sorted chronologically).

    ``newest_start`` is the start position of the workspace's newest block; in ``original``
    mode the selection must contain it (ValueError otherwise), so decoding continues right
    after it.
    """
    if mode not in POSITION_MODES:
        raise ValueError(f"position mode must be one of {POSITION_MODES}, got {mode!r}")
    chosen = sorted(selection, key=lambda b: b.start_pos)
    ids = [b.block_id for b in chosen]
    assert len(set(ids)) == len(ids), "a block is selected twice"
    if mode == "original" and newest_start is not None and (not chosen or chosen[-1].start_pos != newest_start):
        raise ValueError("original positions need the workspace's newest block in the selection")
    slots = tuple(_place(chosen, mode))
    was = {e.block_id: e.pos for e in current}
    now = set(ids)
    return ViewPlan(
        load=tuple(e.block_id for e in slots if e.block_id not in was),
        drop=tuple(e.block_id for e in current if e.block_id not in now),
        move=tuple(
            Move(e.block_id, was[e.block_id], e.pos) for e in slots if e.block_id in was and was[e.block_id] != e.pos
        ),
        slots=slots,
        next_pos=slots[-1].pos + slots[-1].n_tokens if slots else 0,
    )


def _place(chosen: Sequence[ViewBlock], mode: str) -> list[ViewEntry]:
    if mode == "original":
        return [ViewEntry(b.block_id, b.start_pos, b.n_tokens) for b in chosen]
    out, pos = [], 0
    for b in chosen:
        out.append(ViewEntry(b.block_id, pos, b.n_tokens))
        pos += b.n_tokens
    return out
