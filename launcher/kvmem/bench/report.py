"""Quality results: per-item outcomes grouped into the output contract's rows, the headline check, a table.

The ``oracle`` rows are the answers with the gold blocks forced into a retrieval-sized view:
a retrieval method's wrong answer is a *retrieval error* when its selection missed the gold
blocks and a *model error* when it held them; the oracle's accuracy is the ceiling that
perfect retrieval reaches with this model.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

EARLY = 0.5  # "early" needles sit in the first half of the workspace
LONG_RATIO = 4  # "long" workspaces are at least this many budgets


def label(method: str, scorer: str | None) -> str:
    return f"retrieval/{scorer}" if scorer else method


def _valid(outcomes: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in outcomes if o["error"] is None]


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


def summary(outcomes: Sequence[dict[str, Any]], budget: int) -> dict[str, Any]:
    """Accuracy per method on early needles in long workspaces (overall and per fact kind), the
    retrieval-heads margin over the baselines, and the diagnosis of retrieval methods' answers."""
    early = [o for o in _valid(outcomes) if o["depth"] < EARLY and o["prompt_tokens"] >= LONG_RATIO * budget]
    acc = _accuracy(early)
    kinds = sorted({o["kind"] for o in early})
    out: dict[str, Any] = {"early_long_sessions": len({o["session"] for o in early}), "early_long_accuracy": acc,
                           "early_long_accuracy_by_kind": {k: _accuracy([o for o in early if o["kind"] == k]) for k in kinds}}
    if "retrieval/retrieval-heads" in acc and "recent" in acc:
        out["retrieval_minus_recent"] = acc["retrieval/retrieval-heads"] - acc["recent"]
    if "retrieval/retrieval-heads" in acc and "sink-recent" in acc:
        out["retrieval_minus_sink_recent"] = acc["retrieval/retrieval-heads"] - acc["sink-recent"]
    out["diagnosis"] = diagnosis(outcomes)
    errors = {label(o["method"], o["scorer"]): o["error"] for o in outcomes if o["error"] is not None}
    if errors:
        out["errors"] = errors
    return out


def _accuracy(outcomes: Iterable[dict[str, Any]]) -> dict[str, float]:
    per: dict[str, list[bool]] = defaultdict(list)
    for o in outcomes:
        per[label(o["method"], o["scorer"])].append(o["correct"])
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
        counts = out.setdefault(label(o["method"], o["scorer"]), dict.fromkeys(
            ("selected_right", "selected_wrong", "missed_right", "missed_wrong", "missed_wrong_oracle_right"), 0))
        counts[f"{'selected' if o['gold_selected'] else 'missed'}_{'right' if o['correct'] else 'wrong'}"] += 1
        if not o["gold_selected"] and not o["correct"] and oracle.get(o["session"]):
            counts["missed_wrong_oracle_right"] += 1
    return dict(sorted(out.items()))


def by(outcomes: Sequence[dict[str, Any]], key: str) -> dict[str, dict[Any, float]]:
    """Accuracy per method label per value of ``key`` (e.g. ``size`` or ``depth``)."""
    groups: dict[str, dict[Any, list[bool]]] = defaultdict(lambda: defaultdict(list))
    for o in _valid(outcomes):
        groups[label(o["method"], o["scorer"])][o[key]].append(o["correct"])
    return {m: {k: _mean(v) for k, v in sorted(g.items())} for m, g in groups.items()}


def table(outcomes: Sequence[dict[str, Any]], budget: int) -> str:
    """Accuracy per method (rows) and workspace size (columns), early-long accuracy and gold-block recall."""
    per_size = by(outcomes, "size")
    sizes = sorted({s for g in per_size.values() for s in g})
    early = summary(outcomes, budget)["early_long_accuracy"]
    recall: dict[str, list[bool]] = defaultdict(list)
    for o in _valid(outcomes):
        if o["gold_selected"] is not None:
            recall[label(o["method"], o["scorer"])].append(o["gold_selected"])
    head = ["method"] + [f"{s} tok" for s in sizes] + [f"early, >={LONG_RATIO}x", "gold recall"]
    lines = [head]
    for m in sorted(per_size, key=_order):
        cells = [_pct(per_size[m].get(s)) for s in sizes]
        lines.append([m, *cells, _pct(early.get(m)), _pct(_mean(recall[m]) if recall[m] else None)])
    widths = [max(len(r[i]) for r in lines) for i in range(len(head))]
    text = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in lines]
    text.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(text)


def _order(name: str) -> tuple[int, str]:
    return (0 if name.startswith("retrieval") else 2 if name == "oracle" else 1, name)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _mean(values: Sequence[Any]) -> float:
    return sum(float(v) for v in values) / len(values) if values else 0.0
