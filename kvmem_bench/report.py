"""Quality results: outcomes grouped into rows, the goals, the tables.

An outcome's *config* is its method in its view (``retrieval @ default``, ``oracle @ 1/8``, ``full``). Every
outcome counts: an errored request is a wrong answer (``errors`` lists them). The oracle answers with the gold
blocks forced into the same view: a retrieval answer that is wrong with the gold blocks selected is a model
error, without them a retrieval error; the oracle's accuracy is what perfect retrieval reaches with this model.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

GOAL_RECALL = 0.9  # retrieval's gold-block recall at every size
GOAL_VS_FULL = 0.9  # retrieval's accuracy over full's, wherever full runs
GOAL_VS_ORACLE = 0.85  # retrieval's accuracy over the oracle's, at sizes of at least ORACLE_GOAL_FROM tokens
ORACLE_GOAL_FROM = 131072
_EPS = 1e-9  # a goal met exactly passes despite float rounding
VIEW_ORDER = ("default", "1/8", "full")
METHOD_ORDER = ("retrieval", "recent", "oracle", "full")


def config(o: dict[str, Any]) -> str:
    """``method @ view`` (``full`` alone: its view is the workspace)."""
    return "full" if o["method"] == "full" else f"{o['method']} @ {o['view']}"


def _config_order(name: str) -> tuple[int, int, str]:
    method, _, view = name.partition(" @ ")
    return (
        VIEW_ORDER.index(view) if view in VIEW_ORDER else 2,
        METHOD_ORDER.index(method) if method in METHOD_ORDER else 9,
        name,
    )


def rows(outcomes: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (view, method, size, kind): n (errors included), accuracy, errors, gold-block recall."""
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for o in outcomes:
        groups[(o["view"], o["method"], o["size"], o["kind"])].append(o)
    out = []
    for (view, method, size, kind), items in sorted(groups.items(), key=lambda kv: tuple(map(str, kv[0]))):
        hits = [o["gold_selected"] for o in items if o["gold_selected"] is not None]
        out.append(
            {
                "view": view,
                "budget": items[0]["budget"],
                "method": method,
                "workspace_tokens": size,
                "kind": kind,
                "n": len(items),
                "accuracy": _mean([o["correct"] for o in items]),
                "errors": sum(o["error"] is not None for o in items),
                "gold_block_recall": _mean(hits) if hits else None,
                "prompt_tokens": round(_mean([o["prompt_tokens"] for o in items if o["prompt_tokens"]])),
            }
        )
    return out


def by(outcomes: Iterable[dict[str, Any]], key: str, field: str = "correct") -> dict[str, dict[Any, float]]:
    """Mean of ``field`` per config per value of ``key`` (``size``, ``depth``, ``kind``): accuracy, or with
    ``gold_selected`` gold-block recall (outcomes whose field is None are left out)."""
    groups: dict[str, dict[Any, list[bool]]] = defaultdict(lambda: defaultdict(list))
    for o in outcomes:
        if o[field] is not None:
            groups[config(o)][o[key]].append(o[field])
    return {
        m: {k: _mean(v) for k, v in sorted(g.items())}
        for m, g in sorted(groups.items(), key=lambda kv: _config_order(kv[0]))
    }


def counts(outcomes: Iterable[dict[str, Any]]) -> dict[str, dict[int, int]]:
    """Outcomes per config per size (the n behind each accuracy)."""
    out: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for o in outcomes:
        out[config(o)][o["size"]] += 1
    return {k: dict(v) for k, v in out.items()}


def summary(outcomes: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Accuracy and n per config and size, the goals, the diagnosis of retrieval's answers, and every error."""
    return {
        "accuracy": by(outcomes, "size"),
        "n": counts(outcomes),
        "gold_recall": by(outcomes, "size", "gold_selected"),
        "accuracy_by_kind": by(outcomes, "kind"),
        "goals": goals(outcomes),
        "diagnosis": diagnosis(outcomes),
        "errors": [
            {k: o.get(k) for k in ("queue", "session", "view", "method", "error")}
            for o in outcomes
            if o["error"] is not None
        ],
    }


def goals(outcomes: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per size and bounded view: retrieval's gold-block recall (>= ``GOAL_RECALL``), accuracy over ``full``'s on the
    sessions both answered (>= ``GOAL_VS_FULL``, where full ran), over the oracle's (>= ``GOAL_VS_ORACLE`` from
    ``ORACLE_GOAL_FROM`` tokens), and ``update`` sessions answered with the newest value (all of them)."""
    out: dict[str, Any] = {}
    for size in sorted({o["size"] for o in outcomes}):
        here = [o for o in outcomes if o["size"] == size]
        for view in [v for v in VIEW_ORDER if v != "full" and any(o["view"] == v for o in here)]:
            mine = [o for o in here if o["view"] == view and o["method"] == "retrieval"]
            recall = [o["gold_selected"] for o in mine if o["gold_selected"] is not None]
            updates = [o for o in mine if o["kind"] == "update"]
            out[f"{size} @ {view}"] = {
                "budget": mine[0]["budget"] if mine else None,
                "gold_recall": _check(_mean(recall) if recall else None, GOAL_RECALL, len(recall)),
                "vs_full": _ratio(here, mine, lambda o: o["method"] == "full", GOAL_VS_FULL),
                "vs_oracle": _ratio(here, mine, lambda o: o["view"] == view and o["method"] == "oracle", GOAL_VS_ORACLE)
                if size >= ORACLE_GOAL_FROM
                else None,
                "update_newest": _check(_mean([o["correct"] for o in updates]) if updates else None, 1.0, len(updates)),
            }
    return out


def _check(value: float | None, goal: float, n: int) -> dict[str, Any] | None:
    return None if value is None else {"value": value, "goal": goal, "n": n, "pass": value >= goal - _EPS}


def _ratio(here: Sequence[dict[str, Any]], mine: Sequence[dict[str, Any]], is_other: Any, goal: float) -> dict | None:
    """Retrieval's accuracy over another config's on the sessions both answered."""
    other = {o["session"]: o["correct"] for o in here if is_other(o)}
    both = [o for o in mine if o["session"] in other]
    if not both:
        return None
    a, b = _mean([o["correct"] for o in both]), _mean([other[o["session"]] for o in both])
    return {
        "value": a / b if b else None,
        "accuracy": a,
        "other_accuracy": b,
        "n": len(both),
        "goal": goal,
        "pass": a >= goal * b - _EPS,
    }


def diagnosis(outcomes: Sequence[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per size and view: retrieval's answers counted by cause (gold selected or missed, right or wrong, oracle
    right, errors). ``missed_wrong_oracle_right`` counts retrieval errors that perfect retrieval would have fixed."""
    oracle = {(o["session"], o["view"]): o["correct"] for o in outcomes if o["method"] == "oracle"}
    out: dict[str, dict[str, int]] = {}
    for o in outcomes:
        if o["method"] != "retrieval":
            continue
        c = out.setdefault(
            f"{o['size']} @ {o['view']}",
            dict.fromkeys(
                (
                    "selected_right",
                    "selected_wrong",
                    "missed_right",
                    "missed_wrong",
                    "missed_wrong_oracle_right",
                    "errors",
                ),
                0,
            ),
        )
        if o["error"] is not None or o["gold_selected"] is None:
            c["errors"] += 1
            continue
        c[f"{'selected' if o['gold_selected'] else 'missed'}_{'right' if o['correct'] else 'wrong'}"] += 1
        if not o["gold_selected"] and not o["correct"] and oracle.get((o["session"], o["view"])):
            c["missed_wrong_oracle_right"] += 1
    return out


def table(outcomes: Sequence[dict[str, Any]]) -> str:
    """Accuracy (n) per config and size, gold-block recall, then the goals and the error count."""
    if not outcomes:
        return "no outcomes"
    acc, n, recall = by(outcomes, "size"), counts(outcomes), by(outcomes, "size", "gold_selected")
    sizes = sorted({o["size"] for o in outcomes})
    lines = [["config", *(f"{s} tok" for s in sizes)]]
    for m in acc:
        lines.append([m, *(f"{_pct(acc[m].get(s))} ({n[m].get(s, 0)})" if s in acc[m] else "-" for s in sizes)])
    for m in [m for m in recall if m.startswith("retrieval")]:
        lines.append([f"gold recall, {m}", *(_pct(recall[m].get(s)) for s in sizes)])
    errors = sum(o["error"] is not None for o in outcomes)
    return _markdown(lines) + "\n\n" + goals_table(goals(outcomes)) + f"\n\nerrors (counted wrong): {errors}"


def goals_table(g: dict[str, Any]) -> str:
    """The goals, one row per (size, view)."""
    lines = [
        [
            "size @ view",
            f"gold recall (>= {GOAL_RECALL:.0%})",
            f"/ full (>= {GOAL_VS_FULL})",
            f"/ oracle (>= {GOAL_VS_ORACLE}, from {ORACLE_GOAL_FROM})",
            "update newest",
        ]
    ]
    for key, c in g.items():
        lines.append(
            [
                key,
                _show(c["gold_recall"], "{:.0%}"),
                _show(c["vs_full"], "{:.2f}"),
                _show(c["vs_oracle"], "{:.2f}"),
                _show(c["update_newest"], "{:.0%}"),
            ]
        )
    return _markdown(lines)


def _show(check: dict[str, Any] | None, fmt: str) -> str:
    if check is None:
        return "-"
    value = "n/a" if check["value"] is None else fmt.format(check["value"])
    return f"{value} (n={check['n']}) {'pass' if check['pass'] else 'MISS'}"


def _markdown(lines: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in lines) for i in range(len(lines[0]))]
    text = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in lines]
    text.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(text)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _mean(values: Sequence[Any]) -> float:
    return sum(float(v) for v in values) / len(values) if values else 0.0
