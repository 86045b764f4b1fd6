"""Fill a token budget with a workspace's blocks: mandatory spans first, then by score.

Mandatory: the sink (blocks holding the first ``sink_tokens`` tokens), blocks tagged
``mandatory`` (system prompt, tool schemas), the recent window (blocks holding the last
``recent_tokens`` history tokens) and the live tail (``tail_tokens`` not yet in blocks, which
only consume budget). Blocks tagged ``atomic:<name>`` form a group taken whole or not at all.
A block whose winning token sits within ``edge_tokens`` of an edge is taken together with
the neighbour on that side, so a fact that straddles two blocks is not cut in half.

Under retrieval, a block taken by score brings the rest of its message group (``turns``: a
tool call with its results, a user or an assistant turn; ``kvmem_core.groups``) when that rest
holds at most half the budget left after the mandatory spans, so one long tool result cannot
fill the view; from a larger group it brings the blocks nearest to it, up to that half. The
newest blocks fill in block by block, newest first (a group that does not fit is cut there
rather than skipped for older blocks), and mandatory spans are not extended to their groups.

Retrieval takes by score only the blocks that score at least ``relevance`` times the best
candidate; the budget left goes to the newest blocks. On agent transcripts the blocks just
under the best are same-form look-alikes of the asked fact (other names, other values), and a
small model shown them answers with their values as it does over the whole workspace; the
newest blocks are what it would read anyway (docs/retrieval.md has the numbers).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Iterable, Sequence

import numpy as np

from kvmem_core.config import KVMemConfig
from kvmem_core.errors import BudgetError, ConfigError
from kvmem_core.layout import BlockMeta, starts_with
from kvmem_core.retrieval.base import BlockScores

MANDATORY_TAG = "mandatory"
ATOMIC_PREFIX = "atomic:"
BASELINES = ("recent", "sink-recent", "full")


@dataclass(frozen=True, eq=False)
class BlockSpans:
    """What the selector knows of each block: tokens [N], mandatory tag [N], atomic group [N] and message
    group [N] (-1: none; ``turns`` None: no message groups)."""

    n_tokens: np.ndarray
    mandatory: np.ndarray
    groups: np.ndarray
    turns: np.ndarray | None = None

    @classmethod
    def from_metas(cls, metas: Sequence[BlockMeta], names: dict[str, int] | None = None) -> BlockSpans:
        """``names``: the atomic groups' numbers so far (blocks before ``metas``'), extended with new ones."""
        names = {} if names is None else names
        groups = [_group_of(m.tags, names) for m in metas]
        return cls(
            np.array([m.n_tokens for m in metas], dtype=np.int64),
            np.array([MANDATORY_TAG in m.tags for m in metas], dtype=bool),
            np.array(groups, dtype=np.int64),
        )

    @classmethod
    def uniform(cls, n_blocks: int, block_tokens: int) -> BlockSpans:
        """Untagged full blocks."""
        return cls(np.full(n_blocks, block_tokens, np.int64), np.zeros(n_blocks, bool), np.full(n_blocks, -1, np.int64))

    def for_step(self, mandatory: np.ndarray, turns: np.ndarray | None) -> BlockSpans:
        """These spans with ``mandatory`` [N] also mandatory and ``turns`` as the message groups."""
        return replace(self, mandatory=self.mandatory | mandatory, turns=turns)

    def __len__(self) -> int:
        return len(self.n_tokens)


class StoredSpans:
    """``BlockSpans.from_metas`` of one workspace's blocks, kept between steps: a step converts only the blocks
    added since the last one (all of them again when the list no longer starts with the blocks held)."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.hashes: list[str] = []
        self._names: dict[str, int] = {}
        self._spans = BlockSpans.uniform(0, 0)

    def spans(self, metas: Sequence[BlockMeta]) -> BlockSpans:
        """The spans of ``metas`` (as ``BlockSpans.from_metas`` gives them)."""
        if not starts_with(metas, self.hashes):
            self._reset()
        n = len(self.hashes)
        old, new = self._spans, BlockSpans.from_metas(metas[n:], self._names)
        self._spans = BlockSpans(
            np.concatenate((old.n_tokens, new.n_tokens)),
            np.concatenate((old.mandatory, new.mandatory)),
            np.concatenate((old.groups, new.groups)),
        )
        self.hashes += [m.chain_hash for m in metas[n:]]
        return self._spans


def _group_of(tags: frozenset[str], names: dict[str, int]) -> int:
    atomic = sorted(t for t in tags if t.startswith(ATOMIC_PREFIX))
    return names.setdefault(atomic[0], len(names)) if atomic else -1


@dataclass(frozen=True)
class Selection:
    """Chosen block indices in chronological order and how they were chosen."""

    blocks: tuple[int, ...]
    tokens: int
    tail_tokens: int
    mandatory: tuple[int, ...] = ()
    expanded: tuple[int, ...] = ()
    method: str = "retrieval"

    def to_dict(self) -> dict[str, object]:
        return {
            "method": self.method,
            "blocks": list(self.blocks),
            "history_tokens": self.tokens,
            "tail_tokens": self.tail_tokens,
            "mandatory_blocks": list(self.mandatory),
            "expanded_blocks": list(self.expanded),
        }


@dataclass(frozen=True)
class Selector:
    """Budget and mandatory-span policy; ``select`` is deterministic for equal inputs."""

    budget: int
    sink_tokens: int = 128
    recent_tokens: int = 512
    edge_tokens: int = 16
    relevance: float = 0.35  # KVMemConfig.relevance; the default is measured in docs/retrieval.md

    @classmethod
    def from_config(cls, config: KVMemConfig, budget: int | None = None) -> Selector:
        return cls(budget or config.budget, config.sink_tokens, config.recent_tokens, relevance=config.relevance)

    def select(
        self, spans: BlockSpans, scores: BlockScores | None, tail_tokens: int = 0, method: str = "retrieval"
    ) -> Selection:
        """Mandatory spans, then blocks by descending score (ties: the later block first) down to
        ``relevance`` times the best candidate's score, then the newest blocks.

        ``method`` is ``retrieval`` (needs ``scores``) or a baseline: ``recent`` (newest
        blocks, no sink), ``sink-recent`` (sink plus newest), ``full`` (everything, or
        BudgetError). Raises BudgetError when the mandatory spans alone exceed the budget.
        Message groups (``spans.turns``) apply to retrieval only; the baselines stay plain.
        """
        n = len(spans)
        if method == "full":
            return self._full(spans, tail_tokens)
        if method == "retrieval":
            if scores is None:
                raise ConfigError("retrieval selection needs block scores")
            order_key, peaks = np.asarray(scores.scores, dtype=np.float64), scores.peaks
        elif method in ("recent", "sink-recent"):
            order_key, peaks = np.arange(n, dtype=np.float64), np.full(n, -1)
        else:
            raise ConfigError(f"unknown selection method {method!r}")
        picker = _Picker(spans, self.budget - tail_tokens)
        mandatory = self._mandatory(spans, sink=method != "recent")
        picker.take_mandatory(mandatory, self.budget, tail_tokens)
        floor = self._floor(order_key, mandatory) if method == "retrieval" else -np.inf
        cap = picker.room // 2 if method == "retrieval" else None
        for b in np.lexsort((-np.arange(n), -order_key)):
            if picker.full() or order_key[b] < floor:
                break
            picker.offer(int(b), self._unit(int(b), peaks, spans), cap)
        for b in range(n - 1, -1, -1):
            if picker.full():
                break
            picker.offer(b, [b], None)
        return picker.result(tail_tokens, method)

    def _floor(self, scores: np.ndarray, mandatory: np.ndarray) -> float:
        """The lowest score taken by score: ``relevance`` times the best candidate's (when it is positive)."""
        best = scores[~mandatory].max(initial=-np.inf)
        return self.relevance * best if best > 0 else -np.inf

    def _mandatory(self, spans: BlockSpans, sink: bool) -> np.ndarray:
        ends = np.cumsum(spans.n_tokens)
        starts = ends - spans.n_tokens
        mask = spans.mandatory.copy()
        if sink:
            mask |= starts < self.sink_tokens
        total = ends[-1] if len(ends) else 0
        mask |= ends > total - self.recent_tokens
        return mask

    def _unit(self, b: int, peaks: np.ndarray, spans: BlockSpans) -> list[int]:
        unit = [b]
        peak = int(peaks[b])
        if peak < 0:
            return unit
        if peak < self.edge_tokens and b > 0:
            unit.append(b - 1)
        if peak >= spans.n_tokens[b] - self.edge_tokens and b + 1 < len(spans):
            unit.append(b + 1)
        return unit

    def _full(self, spans: BlockSpans, tail_tokens: int) -> Selection:
        need = int(spans.n_tokens.sum()) + tail_tokens
        if need > self.budget:
            raise BudgetError(
                f"method full needs {need} tokens but --kvmem-budget is {self.budget}; raise it or use retrieval"
            )
        return Selection(tuple(range(len(spans))), need - tail_tokens, tail_tokens, method="full")


class _Picker:
    """Greedy budget filling with whole atomic groups and capped message groups."""

    def __init__(self, spans: BlockSpans, room: int) -> None:
        self.spans = spans
        self.room = room
        self.chosen = np.zeros(len(spans), dtype=bool)
        self.mandatory: tuple[int, ...] = ()
        self.expanded: list[int] = []
        self._members = _Members(spans.groups)
        self._turns = _Members(spans.turns) if spans.turns is not None else _Members(np.zeros(0, np.int64))
        self._smallest = int(spans.n_tokens.min()) if len(spans) else 0

    def take_mandatory(self, mask: np.ndarray, budget: int, tail_tokens: int) -> None:
        blocks = self._close([int(i) for i in np.flatnonzero(mask)])
        need = int(self.spans.n_tokens[blocks].sum()) if blocks else 0
        if need + tail_tokens > budget:
            raise BudgetError(
                f"mandatory spans need {need + tail_tokens} tokens ({need} history + {tail_tokens} live tail) "
                f"but --kvmem-budget is {budget}; raise the budget or lower --kvmem-sink-tokens/--kvmem-recent-tokens"
            )
        self.chosen[blocks] = True
        self.room -= need
        self.mandatory = tuple(sorted(blocks))

    def full(self) -> bool:
        return self.room < self._smallest

    def offer(self, b: int, unit: list[int], cap: int | None) -> None:
        """Take ``unit`` (block ``b`` and what comes with it) closed over its atomic groups and, unless ``cap``
        is None, over its message groups (``with_turns``), if it fits; else nothing."""
        if self.chosen[b]:
            return
        unit = unit if cap is None else self.with_turns(unit, cap)
        new = [i for i in self._close(unit) if not self.chosen[i]]
        need = int(self.spans.n_tokens[new].sum())
        if need <= self.room:
            self.chosen[new] = True
            self.room -= need
            self.expanded.extend(i for i in new if i != b)

    def with_turns(self, unit: list[int], cap: int) -> list[int]:
        """``unit`` plus the message group of each of its blocks: whole when the group's blocks not yet
        chosen hold at most ``cap`` tokens, else the group's blocks nearest to the unit (the one before
        first, then alternately) while the blocks not yet chosen stay within ``cap`` and the room left."""
        turns = self.spans.turns
        if turns is None:
            return unit
        taken = set(unit)
        for g in sorted({int(turns[u]) for u in unit} - {-1}):
            members = self._turns[g]
            if self._need(members) <= cap:
                taken.update(members)
            else:
                self._window(taken, members, min(cap, self.room))
        return sorted(taken)

    def _window(self, taken: set[int], members: list[int], limit: int) -> None:
        """Add to ``taken`` the ``members`` nearest to those it holds, while its blocks not yet chosen hold
        at most ``limit`` tokens."""
        inside = [m for m in members if m in taken]
        before = [m for m in reversed(members) if m < inside[0]]
        after = [m for m in members if m > inside[-1]]
        need = self._need(taken)
        for m in (m for pair in itertools.zip_longest(before, after) for m in pair if m is not None):
            extra = self._need([m])
            if need + extra > limit:
                break
            taken.add(m)
            need += extra

    def _need(self, blocks: Iterable[int]) -> int:
        """Tokens of those of ``blocks`` not chosen yet."""
        return sum(int(self.spans.n_tokens[i]) for i in blocks if not self.chosen[i])

    def _close(self, blocks: list[int]) -> list[int]:
        out = set(blocks)
        for b in blocks:
            g = int(self.spans.groups[b])
            if g >= 0:
                out.update(self._members[g])
        return sorted(out)

    def result(self, tail_tokens: int, method: str) -> Selection:
        blocks = tuple(int(i) for i in np.flatnonzero(self.chosen))
        tokens = int(self.spans.n_tokens[list(blocks)].sum()) if blocks else 0
        return Selection(blocks, tokens, tail_tokens, self.mandatory, tuple(sorted(self.expanded)), method)


class _Members:
    """Block indexes per group label (``labels`` [N], -1: in no group), in order; a group's are listed on first use,
    so a step's work in Python follows the groups it offers, not the workspace's."""

    def __init__(self, labels: np.ndarray) -> None:
        inside = np.flatnonzero(labels >= 0)
        self._order = inside[np.argsort(labels[inside], kind="stable")]
        self._labels = labels[self._order]
        self._listed: dict[int, list[int]] = {}

    def __getitem__(self, group: int) -> list[int]:
        if group not in self._listed:
            lo, hi = np.searchsorted(self._labels, (group, group + 1))
            self._listed[group] = self._order[lo:hi].tolist()
        return self._listed[group]
