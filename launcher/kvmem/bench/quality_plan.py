"""What ``kvmem bench quality`` runs: the sessions, the methods, each cell's view and the servers.

Every cell's view budget is the same fraction of its workspace (``Plan.budget``), so each size
compares the methods at the same compression. ``full`` sees the whole workspace wherever the
model's trained context holds it. The cells that fit the trained context run on a server at
that context (``--kvmem-positions auto`` keeps original positions, as ``kvmem serve`` runs the
model by default); the cells beyond it run on a second server whose ``--ctx`` exceeds it, where
``auto`` picks compact positions.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvmem.bench import report
from kvmem.bench.sessions import CHARS_PER_TOKEN, KINDS, Session, make_sessions
from kvmem_core.config import SCORERS
from kvmem_core.errors import ConfigError

MIN_BUDGET = 512  # a smaller view holds no selected block beside sink, recent and the question
CTX_MARGIN = 1.25  # sessions land within a few percent of their size; contexts and full's view leave room
GEN_RESERVE = 128  # generation reserve of the servers this command starts (answers stop at max_tokens)
PREFILL_TOK_S = 150  # Qwen2.5-Coder-0.5B prefill, llama.cpp on one thread of a 2-vCPU machine
STEP_S = 4  # one more method's answer on a stored workspace: select, load the view, score, decode


@dataclass(frozen=True)
class Method:
    """One selection method as a ``kvmem`` override (``scorer`` only for retrieval)."""

    method: str
    scorer: str | None = None

    @property
    def label(self) -> str:
        return report.label(self.method, self.scorer)


ORACLE = Method("oracle")
"""The gold blocks forced into a retrieval-sized view: what the model answers when retrieval is perfect."""
METHODS = (*(Method("retrieval", s) for s in SCORERS), Method("recent"), Method("sink-recent"), Method("full"), ORACLE)
QUICK_METHODS = (Method("retrieval", "retrieval-heads"), Method("recent"), Method("full"), ORACLE)
"""``--quick``'s default: the goals' methods; the seed scorers and sink-recent run in the full plan."""

Cell = tuple[int, tuple[float, ...], tuple[str, ...]]


@dataclass(frozen=True)
class Plan:
    """(workspace tokens, needle depths, fact kinds) cells, and the view knobs shared by every cell."""

    grid: tuple[Cell, ...]
    view_fraction: float = 1 / 8
    sink_tokens: int = 64
    recent_tokens: int = 64
    max_tokens: int = 24
    block_tokens: int | None = None  # None: the server's default; the layout is read back from each workspace
    groups: bool = True  # whole-message selection (``kvmem.groups``), sent with every selecting request
    relevance: float | None = None  # ``kvmem.relevance`` of every selecting request; None: the server's

    def budget(self, size: int) -> int:
        """The view budget of a ``size``-token cell: ``view_fraction`` of it, at least ``MIN_BUDGET``."""
        return max(MIN_BUDGET, int(size * self.view_fraction))

    @property
    def sizes(self) -> list[int]:
        return sorted({size for size, _, _ in self.grid})

    def sessions(self, seed: int, chars_per_token: float = CHARS_PER_TOKEN) -> list[Session]:
        """The plan's sessions in grid order, deterministic for ``seed`` and the tokenizer's ``chars_per_token``."""
        out: list[Session] = []
        for i, (size, depths, kinds) in enumerate(self.grid):
            out += make_sessions([size], list(depths), list(kinds), seed * 1000 + i, chars_per_token)
        return out

    def session_sizes(self) -> list[int]:
        """The size of each session ``sessions`` makes, in the same order (without making them)."""
        return [size for size, depths, kinds in self.grid for _ in range(len(depths) * len(kinds))]

    def only_sizes(self, spec: str) -> Plan:
        """The plan's cells whose workspace size is listed in ``spec`` ("4096,8192")."""
        try:
            sizes = {int(s) for s in spec.split(",") if s.strip()}
        except ValueError:
            raise ConfigError(f"--sizes: {spec!r} is not a list of token counts") from None
        if not sizes or not sizes <= set(self.sizes):
            raise ConfigError(f"--sizes: choose from {', '.join(map(str, self.sizes))}")
        return replace(self, grid=tuple(cell for cell in self.grid if cell[0] in sizes))

    def overrides(self, m: Method, size: int, full_budget: int, oracle: tuple[int, ...] = ()) -> dict[str, Any]:
        """The request's ``kvmem`` object for ``m`` on a ``size``-token cell (``oracle``: the blocks it forces)."""
        if m.method == "full":
            return {"method": "full", "budget": full_budget}
        out = {"method": m.method, "budget": self.budget(size), "sink_tokens": self.sink_tokens,
               "recent_tokens": self.recent_tokens, "groups": self.groups}
        if self.relevance is not None:
            out["relevance"] = self.relevance
        if m == ORACLE:
            return {**out, "method": "retrieval", "blocks": list(oracle)}
        return {**out, "retrieval_method": m.scorer} if m.scorer else out

    def minutes(self, n_methods: int) -> int:
        """Rough wall-clock minutes on a 2-vCPU machine with the default model: one prefill per
        session at ``PREFILL_TOK_S`` plus ``STEP_S`` per method (long sessions prefill slower)."""
        return round(sum(size / PREFILL_TOK_S + n_methods * STEP_S for size in self.session_sizes()) / 60)


QUICK = Plan(grid=((4096, (0.1, 0.3, 0.7), ("passkey", "kv", "port", "owner")),
                   (4096, (0.2, 0.65), ("chain", "update"))))
"""16 sessions of 4K tokens (budget 512): every kind, 10 early needles and 6 late ones."""
FULL = Plan(grid=(*((size, (0.05, 0.15, 0.3, 0.45, 0.6, 0.75, 0.9), KINDS) for size in (4096, 8192, 16384)),
                  (49152, (0.1, 0.3, 0.5, 0.7, 0.9), ("passkey", "port", "owner"))))
"""42 sessions at each of 4K, 8K and 16K tokens (budgets 512, 1024, 2048), and 15 at 48K (budget 6144),
beyond the default model's 32K trained context."""


def fits(size: int, trained_ctx: int) -> bool:
    """Whether ``size``-token sessions fit the model's trained context, with room to spare."""
    return math.ceil(CTX_MARGIN * size) <= trained_ctx


def full_budget(sizes: Sequence[int], trained_ctx: int) -> int:
    """View budget of ``full``: room for the largest of ``sizes`` that fits the trained context (0: none does)."""
    within = [s for s in sizes if fits(s, trained_ctx)]
    return min(trained_ctx - GEN_RESERVE, math.ceil(CTX_MARGIN * max(within))) if within else 0


@dataclass(frozen=True)
class Phase:
    """One server's share of the run: the session sizes it answers and its ``--ctx`` (None: ``--url``'s)."""

    sizes: frozenset[int]
    ctx: int | None


def phases(sizes: Sequence[int], trained_ctx: int | None) -> list[Phase]:
    """The servers for sessions of ``sizes``: one at the trained context for those that fit it, one
    beyond it (compact positions) for the rest; a single given server when ``trained_ctx`` is None."""
    if trained_ctx is None:
        return [Phase(frozenset(sizes), None)]
    within = frozenset(s for s in sizes if fits(s, trained_ctx))
    beyond = frozenset(sizes) - within
    out = [Phase(within, trained_ctx)] if within else []
    return out + ([Phase(beyond, math.ceil(CTX_MARGIN * max(beyond)))] if beyond else [])
