"""Quality results: per-item outcomes grouped into the output contract's rows, the goals, the tables.

Each session's *view budget* is the smallest budget its methods ran at (``full``'s budget is
its whole-workspace view), so a "long" workspace is long against the view compared there,
and each size reports its own budget. The ``oracle`` rows are the answers with the gold
blocks forced into a retrieval-sized view: a retrieval method's wrong answer is a *retrieval
error* when its selection missed the gold blocks and a *model error* when it held them; the
oracle's accuracy is the ceiling that perfect retrieval reaches with this model.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

EARLY = 0.5  # "early" needles sit in the first half of the workspace
LONG_RATIO = 4  # "long" workspaces are at least this many view budgets
HEADLINE = "retrieval/retrieval-heads"  # the method the goals are about
GOAL_VS_FULL = 0.9  # its accuracy over full's, at every size where full runs
GOAL_EARLY_MARGIN = 0.4  # its accuracy minus recent's on early needles in long workspaces
GOAL_BEYOND = 0.7  # its accuracy on sessions longer than the model's trained context
_EPS = 1e-9  # a goal met exactly passes despite float rounding


def label(method: str, scorer: str | None) -> str:
    return f"retrieval/{scorer}" if scorer else method


def _label(o: dict[str, Any]) -> str:
    return label(o["method"], o["scorer"])


def _valid(outcomes: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in outcomes if o["error"] is None]


def view_budgets(outcomes: Iterable[dict[str, Any]]) -> dict[str, int]:
    """Each session's view budget: the smallest budget any of its methods ran at."""
    out: dict[str, int] = {}
    for o in outcomes:
        out[o["session"]] = min(o["budget"], out.get(o["session"], o["budget"]))
    return out


def size_budgets(outcomes: Sequence[dict[str, Any]]) -> dict[int, int]:
    """Each workspace size's view budget (the smallest of its sessions')."""
    budgets = view_budgets(outcomes)
    out: dict[int, int] = {}
    for o in outcomes:
        out[o["size"]] = min(budgets[o["session"]], out.get(o["size"], budgets[o["session"]]))
    return dict(sorted(out.items()))


def early_long(outcomes: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Answers to needles in the first half of a workspace at least ``LONG_RATIO`` view budgets long."""
    budgets = view_budgets(outcomes)
    return [o for o in _valid(outcomes)
            if o["depth"] < EARLY and o["prompt_tokens"] >= LONG_RATIO * budgets[o["session"]]]


def rows(outcomes: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One contract row per (method, scorer, workspace size, depth): n, accuracy, gold-block recall."""
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for o in _valid(outcomes):
        groups[(o["method"], o["scorer"], o["size"], o["budget"], o["depth"])].append(o)
    out = []
    for (method, scorer, size, budget, depth), items in sorted(groups.items(), key=lambda kv: tuple(map(str, kv[0]))):
        hits = [o["gold_selected"] for o in items if o["gold_selected"] is not None]
        out.append({"method": method, "scorer": scorer, "workspace_tokens": size, "budget": budget, "depth": depth,
                    "n": len(items), "accuracy": _mean([o["correct"] for o in items]),
                    "gold_block_recall": _mean(hits) if hits else None,
                    "prompt_tokens": round(_mean([o["prompt_tokens"] for o in items]))})
    return out


def summary(outcomes: Sequence[dict[str, Any]], trained_ctx: int | None = None) -> dict[str, Any]:
    """Accuracy per method on early needles in long workspaces (overall and per fact kind), the
    retrieval-heads margin over the baselines, the goals, and the diagnosis of retrieval answers."""
    early = early_long(outcomes)
    acc = _accuracy(early)
    kinds = sorted({o["kind"] for o in early})
    out: dict[str, Any] = {"early_long_sessions": len({o["session"] for o in early}), "early_long_accuracy": acc,
                           "early_long_accuracy_by_kind": {k: _accuracy([o for o in early if o["kind"] == k]) for k in kinds}}
    for baseline in ("recent", "sink-recent"):
        if HEADLINE in acc and baseline in acc:
            out[f"retrieval_minus_{baseline.replace('-', '_')}"] = acc[HEADLINE] - acc[baseline]
    out["goals"] = goals(outcomes, trained_ctx)
    out["diagnosis"] = diagnosis(outcomes)
    errors = {_label(o): o["error"] for o in outcomes if o["error"] is not None}
    if errors:
        out["errors"] = errors
    return out


def goals(outcomes: Sequence[dict[str, Any]], trained_ctx: int | None) -> dict[str, Any]:
    """``HEADLINE``'s goals per workspace size: accuracy over ``full``'s on the sessions both answered
    (``vs_full``, None where full did not run), margin over ``recent`` on early needles in long
    workspaces (``early_vs_recent``), every retrieval method's gold-block recall; and accuracy on
    sessions longer than ``trained_ctx`` (``beyond_trained_context``, None when unknown or none)."""
    valid = _valid(outcomes)
    early = {o["session"] for o in early_long(outcomes)}
    recall = by([o for o in valid if o["method"] == "retrieval"], "size", "gold_selected")
    sizes = {}
    for size, budget in size_budgets(valid).items():
        here = [o for o in valid if o["size"] == size]
        sizes[size] = {"budget": budget, "vs_full": _vs_full(here),
                       "early_vs_recent": _early_vs_recent([o for o in here if o["session"] in early]),
                       "gold_recall": {m: r[size] for m, r in sorted(recall.items()) if size in r}}
    return {"method": HEADLINE, "sizes": sizes, "beyond_trained_context": _beyond(valid, trained_ctx)}


def _paired(outcomes: Sequence[dict[str, Any]], other: str) -> tuple[float, float, int]:
    """``HEADLINE``'s and ``other``'s accuracy on the sessions both answered, and how many those are."""
    per: dict[str, dict[str, bool]] = defaultdict(dict)
    for o in outcomes:
        per[o["session"]][_label(o)] = o["correct"]
    both = [p for p in per.values() if HEADLINE in p and other in p]
    return _mean([p[HEADLINE] for p in both]), _mean([p[other] for p in both]), len(both)


def _vs_full(outcomes: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    mine, full, n = _paired(outcomes, "full")
    if not n:
        return None
    return {"value": mine / full if full else None, "accuracy": mine, "full_accuracy": full, "sessions": n,
            "goal": GOAL_VS_FULL, "pass": mine >= GOAL_VS_FULL * full - _EPS}


def _early_vs_recent(outcomes: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    mine, recent, n = _paired(outcomes, "recent")
    if not n:
        return None
    return {"value": mine - recent, "accuracy": mine, "recent_accuracy": recent, "sessions": n,
            "goal": GOAL_EARLY_MARGIN, "pass": mine - recent >= GOAL_EARLY_MARGIN - _EPS}


def _beyond(outcomes: Sequence[dict[str, Any]], trained_ctx: int | None) -> dict[str, Any] | None:
    items = [o for o in outcomes if trained_ctx and o["prompt_tokens"] > trained_ctx and _label(o) == HEADLINE]
    if not items:
        return None
    acc = _mean([o["correct"] for o in items])
    return {"value": acc, "trained_ctx": trained_ctx, "sizes": sorted({o["size"] for o in items}),
            "sessions": len(items), "goal": GOAL_BEYOND, "pass": acc >= GOAL_BEYOND - _EPS}


def _accuracy(outcomes: Iterable[dict[str, Any]], field: str = "correct") -> dict[str, float]:
    """Mean of ``field`` per method label (answers whose field is None are left out)."""
    per: dict[str, list[bool]] = defaultdict(list)
    for o in outcomes:
        if o[field] is not None:
            per[_label(o)].append(o[field])
    return {k: _mean(v) for k, v in sorted(per.items())}


def diagnosis(outcomes: Sequence[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per retrieval method: answers counted by cause (gold selected or missed, right or wrong, oracle right).

    ``missed_wrong_oracle_right`` counts the retrieval errors that perfect retrieval would have
    fixed; ``selected_wrong`` the model errors despite the right blocks.
    """
    oracle = {o["session"]: o["correct"] for o in _valid(outcomes) if o["method"] == "oracle"}
    out: dict[str, dict[str, int]] = {}
    for o in _valid(outcomes):
        if o["method"] != "retrieval" or o["gold_selected"] is None:
            continue
        counts = out.setdefault(_label(o), dict.fromkeys(
            ("selected_right", "selected_wrong", "missed_right", "missed_wrong", "missed_wrong_oracle_right"), 0))
        counts[f"{'selected' if o['gold_selected'] else 'missed'}_{'right' if o['correct'] else 'wrong'}"] += 1
        if not o["gold_selected"] and not o["correct"] and oracle.get(o["session"]):
            counts["missed_wrong_oracle_right"] += 1
    return dict(sorted(out.items()))


def by(outcomes: Sequence[dict[str, Any]], key: str, field: str = "correct") -> dict[str, dict[Any, float]]:
    """Mean of ``field`` per method label per value of ``key`` (e.g. ``size``, ``depth``): accuracy, or
    with ``gold_selected`` gold-block recall (answers whose field is None are left out)."""
    groups: dict[str, dict[Any, list[bool]]] = defaultdict(lambda: defaultdict(list))
    for o in _valid(outcomes):
        if o[field] is not None:
            groups[_label(o)][o[key]].append(o[field])
    return {m: {k: _mean(v) for k, v in sorted(g.items())} for m, g in groups.items()}


def table(outcomes: Sequence[dict[str, Any]], trained_ctx: int | None = None) -> str:
    """Accuracy per method (rows) and workspace size (columns, with each size's view budget), accuracy
    on early needles in long workspaces and gold-block recall; then the goals table."""
    per_size, budgets = by(outcomes, "size"), size_budgets(outcomes)
    early = _accuracy(early_long(outcomes))
    recall = _accuracy(_valid(outcomes), "gold_selected")
    head = ["method", *(f"{s} tok, view {b}" for s, b in budgets.items()), f"early, >={LONG_RATIO}x", "gold recall"]
    lines = [head]
    for m in sorted(per_size, key=_order):
        lines.append([m, *(_pct(per_size[m].get(s)) for s in budgets), _pct(early.get(m)), _pct(recall.get(m))])
    return _markdown(lines) + "\n\n" + goals_table(goals(outcomes, trained_ctx))


def goals_table(g: dict[str, Any]) -> str:
    """The goals as a table (one column per size) and a line for the sessions beyond the trained context."""
    sizes = g["sizes"]
    lines = [[f"goals of {g['method']}", *(f"{s} tok" for s in sizes)],
             [f"accuracy / full's (>= {GOAL_VS_FULL:.2f})", *(_check(c["vs_full"], "{:.2f}") for c in sizes.values())],
             [f"early: minus recent (>= +{100 * GOAL_EARLY_MARGIN:.0f} pts)",
              *(_check(c["early_vs_recent"], "{:+.0%}") for c in sizes.values())]]
    methods = sorted({m for c in sizes.values() for m in c["gold_recall"]}, key=_order)
    lines += [[f"gold recall, {m}", *(_pct(c["gold_recall"].get(m)) for c in sizes.values())] for m in methods]
    beyond = g["beyond_trained_context"]
    tail = "beyond the trained context: no sessions" if beyond is None else (
        f"beyond the trained context ({beyond['trained_ctx']} tokens): {_pct(beyond['value'])} of "
        f"{beyond['sessions']} sessions (goal >= {GOAL_BEYOND:.0%}): {'pass' if beyond['pass'] else 'FAIL'}")
    return _markdown(lines) + "\n" + tail


def _check(check: dict[str, Any] | None, fmt: str) -> str:
    if check is None:
        return "-"
    value = "n/a" if check["value"] is None else fmt.format(check["value"]).replace("%", " pts")
    return f"{value} {'pass' if check['pass'] else 'FAIL'}"


def _markdown(lines: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in lines) for i in range(len(lines[0]))]
    text = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in lines]
    text.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(text)


def _order(name: str) -> tuple[int, str]:
    return (0 if name.startswith("retrieval") else 2 if name == "oracle" else 1, name)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _mean(values: Sequence[Any]) -> float:
    return sum(float(v) for v in values) / len(values) if values else 0.0
