"""What ``kvmem bench quality`` runs: named plans of sessions, the views each is measured at, and the servers.

The method (docs/benchmarks.md) is enforced here:

- **Every view is bounded from the first prefill.** Each (size, view) pair runs on its own ``kvmem serve``
  started with that view as its ``--kvmem-budget``; nothing else differs from a default server, so the
  first request of a session prefills the workspace through the view being measured, as a user's server
  does. ``full`` runs on a server whose view holds the whole workspace.
- **Default knobs.** The servers get no other knob: sink, recent, generation reserve, block size, relevance
  floor, groups, the host tier (auto: a share of the machine's memory) and ``--ctx`` (auto: what the host tier
  holds) are ``kvmem serve``'s defaults; a run's change (``--change``) is named in its results.
- **Tuning and report splits.** A session's seed is its split, plan seed, size, kind and depth; the
  ``tuning`` split is for choosing methods and knobs, the ``report`` split (fixed with the plans below) is
  only reported, never tuned on.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvmem_bench.heldout import HELDOUT_KINDS, make_heldout_session
from kvmem_bench.sessions import CHARS_PER_TOKEN, KINDS, Session, make_session
from kvmem.tools_format import render_plain
from kvmem_core.errors import ConfigError

SPLITS = ("tuning", "report")
ALL_KINDS = (*KINDS, *HELDOUT_KINDS)
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
FIT_MARGIN = 1.06  # full's view must hold the session (sized within a few percent) and the answer
DEFAULT_BUDGET = 2048  # kvmem serve's --kvmem-budget and --kvmem-gen-budget defaults (KVMemConfig)
DEFAULT_GEN = 512
MIN_BUDGET = 128 + 512 + 64  # the default sink + recent + one default block: the smallest view a default server takes
MAX_TOKENS = 24  # answers are one short value


@dataclass(frozen=True)
class Method:
    """One answering method on a server: the request's ``kvmem`` object (None: none, the server's default)."""

    label: str

    def overrides(self, oracle: Sequence[int] = ()) -> dict | None:
        """The request's ``kvmem`` object: retrieval and full send none; ``recent`` names its method; the oracle
        forces the gold blocks ``oracle`` into the same view (the rest of it the newest blocks)."""
        if self.label == "recent":
            return {"method": "recent"}
        if self.label == "oracle":
            return {"blocks": list(oracle)}
        return None


RETRIEVAL, RECENT, ORACLE, FULL = Method("retrieval"), Method("recent"), Method("oracle"), Method("full")
METHODS = (RETRIEVAL, RECENT, ORACLE)
"""The methods each bounded view answers with, in order: the first request prefills the workspace."""


@dataclass(frozen=True)
class View:
    """One server configuration: ``label`` ("default", "1/8", "full") and its ``--kvmem-budget`` (None: the
    default)."""

    label: str
    budget: int | None

    @property
    def methods(self) -> tuple[Method, ...]:
        return (FULL,) if self.label == "full" else METHODS

    def flags(self) -> list[str]:
        """``kvmem serve`` flags beyond the model and backend: only what differs from the defaults."""
        return [] if self.budget is None else ["--kvmem-budget", str(self.budget)]


@dataclass(frozen=True)
class Cell:
    """Sessions of one workspace size: every kind at every depth."""

    size: int
    kinds: tuple[str, ...] = ALL_KINDS
    depths: tuple[float, ...] = DEPTHS

    def pairs(self) -> list[tuple[str, float]]:
        """(kind, depth) of each session, ordered so that any first N cover the kinds evenly and vary depth."""
        k, d = len(self.kinds), len(self.depths)
        return [(self.kinds[j], self.depths[(i + j) % d]) for i in range(d) for j in range(k)]


@dataclass(frozen=True)
class Plan:
    """A named set of cells on one split, measured at the default view, at 1/8 of each size (``eighth``) and with
    ``full`` wherever the whole workspace fits the model's trained context."""

    name: str
    split: str
    cells: tuple[Cell, ...]
    eighth: bool = True
    full: bool = True
    note: str = ""

    @property
    def sizes(self) -> list[int]:
        return [c.size for c in self.cells]

    def views(self, cell: Cell, trained_ctx: int) -> list[View]:
        """The servers of ``cell``: default view, 1/8 of the size (when it differs and the default sink, recent
        window and a block fit it), full (when the workspace fits the trained context)."""
        out = [View("default", None)]
        if self.eighth and cell.size // 8 != DEFAULT_BUDGET and cell.size // 8 >= MIN_BUDGET:
            out.append(View("1/8", cell.size // 8))
        if self.full and math.ceil(FIT_MARGIN * cell.size) + MAX_TOKENS <= trained_ctx - DEFAULT_GEN:
            out.append(View("full", trained_ctx - DEFAULT_GEN))
        return out

    def sessions(self, cell: Cell, seed: int, fits: Mapping[str, float] | None = None) -> list[Session]:
        """``cell``'s sessions in ``Cell.pairs`` order; each fixed by (split, seed, size, kind, depth) alone and sized
        with its kind's ``fits`` (chars per token of the model's tokenizer, ``fit_kinds``)."""
        fits = fits or {}
        return [
            make_any_session(kind, cell.size, depth, self.split, seed, fits.get(kind, CHARS_PER_TOKEN))
            for kind, depth in cell.pairs()
        ]


def make_any_session(
    kind: str, size: int, depth: float, split: str, seed: int, chars_per_token: float = CHARS_PER_TOKEN
) -> Session:
    """The session of ``kind`` (either generator's) for (split, seed, size, depth), independent of any other."""
    rng = random.Random(f"{split}:{seed}:{size}:{kind}:{depth}")
    sid = f"{split[0]}{seed}-s{size}-d{depth:.2f}-{kind}"
    if kind in HELDOUT_KINDS:
        return make_heldout_session(sid, kind, size, depth, rng, chars_per_token)
    return make_session(sid, kind, size, depth, rng, chars_per_token)


def fit_kinds(count_tokens: Callable[[str], int], kinds: Sequence[str] = ALL_KINDS) -> dict[str, float]:
    """Chars per token (digits aside, which digit-splitting tokenizers count one each) of each kind's text for the
    tokenizer behind ``count_tokens``, fitted on a 12K-token probe session of that kind, so every kind's sessions
    come out at their size: the two generators' texts (code, logs, prose, CSV) tokenize differently."""
    out = {}
    for kind in kinds:
        probe = make_any_session(kind, 12000, 0.5, "probe", 0)
        text = "\n".join(t["content"] for t in render_plain(list(probe.messages), None))
        digits = sum(c.isdigit() for c in text)
        out[kind] = (len(text) - digits) / max(1, count_tokens(text) - digits)
    return out


SIZES = (8192, 30000, 131072, 262144)
"""The report's sizes: 30000 is the largest whose whole workspace (and answer) fits the default model's 32K
trained context, so ``full`` runs there; 128K and 256K are past it (compact positions)."""
PLANS = {
    p.name: p
    for p in (
        Plan(
            "quick",
            "tuning",
            (Cell(8192, depths=(0.3,)),),
            note="10 sessions of 8K tokens on the tuning split: every kind once, at depth 0.3",
        ),
        Plan(
            "tuning",
            "tuning",
            tuple(Cell(s) for s in (8192, 30000, 131072)),
            note="the tuning split: 50 sessions at each of 8K, 30K and 128K tokens",
        ),
        Plan(
            "report",
            "report",
            tuple(Cell(s) for s in SIZES),
            note="the report split: 50 sessions (10 kinds x 5 depths) at each of 8K, 30K, 128K and 256K tokens",
        ),
        Plan(
            "report-1m",
            "report",
            (Cell(1 << 20, depths=(0.1, 0.5, 0.9)),),
            eighth=False,
            note="the report split at 1M tokens, default view only",
        ),
    )
}


def plan_named(name: str) -> Plan:
    try:
        return PLANS[name]
    except KeyError:
        raise ConfigError(f"--plan: unknown {name!r}; choose from {', '.join(PLANS)}") from None


def only_sizes(plan: Plan, spec: str) -> Plan:
    """``plan`` with only the cells whose size is listed in ``spec`` ("8192,30000")."""
    try:
        sizes = {int(s) for s in spec.split(",") if s.strip()}
    except ValueError:
        raise ConfigError(f"--sizes: {spec!r} is not a list of token counts") from None
    if not sizes or not sizes <= set(plan.sizes):
        raise ConfigError(f"--sizes: choose from {', '.join(map(str, plan.sizes))}")
    return Plan(
        plan.name, plan.split, tuple(c for c in plan.cells if c.size in sizes), plan.eighth, plan.full, plan.note
    )


@dataclass(frozen=True)
class Queue:
    """One server's share of a run: a view of one cell and the sessions it answers (a shard of the cell's)."""

    cell: Cell
    view: View
    shard: int = 0
    sessions: tuple[Session, ...] = field(default=(), compare=False)

    @property
    def cell_view(self) -> str:
        return f"{self.cell.size}/{self.view.label}"

    @property
    def name(self) -> str:
        return f"{self.cell_view}/{self.shard}"


def queues(plan: Plan, trained_ctx: int, sessions: dict[int, list[Session]], shards: dict[int, int]) -> list[Queue]:
    """Every (cell, view) pair's sessions split round-robin over ``shards[size]`` servers (default 1), largest
    cells first so a parallel run starts its longest queues early."""
    out = []
    for cell in sorted(plan.cells, key=lambda c: -c.size):
        n = max(1, shards.get(cell.size, 1))
        for view in plan.views(cell, trained_ctx):
            out += [Queue(cell, view, i, tuple(sessions[cell.size][i::n])) for i in range(n)]
    return out


def parse_shards(spec: str | None) -> dict[int, int]:
    """``--shards 131072=2,262144=4`` -> {size: servers}."""
    if not spec:
        return {}
    try:
        return {int(k): int(v) for k, v in (item.split("=") for item in spec.split(",") if item.strip())}
    except ValueError:
        raise ConfigError(f"--shards: {spec!r} is not SIZE=N,SIZE=N") from None
