"""Where one turn's device time goes: ``torch.profiler`` over a turn, the engine's phases labelled.

``cProfile`` (``turn_profile``) sees the host only: on a GPU the host waits at a few sync points and the kernels'
time lands on whatever waits. Here each phase of the engine's step (prompt building, prefill, selection and its
scoring, materialization, the query's replay, decoding, archiving, making room), and each of the adapter's forwards
and drops and each recurrent-state checkpoint, is a ``record_function`` range, so the profiler adds up the host time
spent inside it and the device time of the kernels it launched. Written per size: ``SIZE.trace.txt``
(the phases, how long the device sat idle inside each and its idle gaps, then the kernels by device time) and
``SIZE.trace.json.gz`` (the timeline).
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import json
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import kvmem_core.engine as engine_module
from kvmem_core.engine import KVMemEngine

PHASES = (
    "_prefill",
    "_select",
    "_index",
    "_spans",
    "_materialize",
    "_replay",
    "_decode",
    "_archive",
    "_stage",
    "_make_room",
)
ADAPTER_CALLS = ("forward", "drop")
PREFIX = "kvmem."


def _labelled(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with record_function(PREFIX + name):
            return fn(*args, **kwargs)

    return run


def _label_scorer(make: Callable[..., Any]) -> Callable[..., Any]:
    """``engine._scorer`` whose scorers' ``score`` is a labelled range."""

    @functools.wraps(make)
    def scorer(*args: Any, **kwargs: Any) -> Any:
        return _LabelledScorer(make(*args, **kwargs))

    return scorer


class _LabelledScorer:
    """A scorer whose ``score`` runs in a labelled range; everything else is the scorer's (scorers are frozen)."""

    def __init__(self, scorer: Any) -> None:
        self._scorer = scorer
        self.score = _labelled("score", scorer.score)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scorer, name)


@contextlib.contextmanager
def labelled(engine: KVMemEngine) -> Iterator[None]:
    """Label ``engine``'s phases, its adapter's forwards and drops, its checkpoints and the prompt's admission for
    the duration; the engine is unchanged after."""
    admit = engine_module.admit
    targets = [(engine, name, name) for name in PHASES]
    targets += [(engine.adapter, name, f"adapter.{name}") for name in ADAPTER_CALLS]
    targets += [(engine.checkpoints, "take", "checkpoints.take")] if engine.checkpoints is not None else []
    for owner, name, label in targets:
        setattr(owner, name, _labelled(label, getattr(owner, name)))
    engine._scorer = _label_scorer(engine._scorer)  # type: ignore[method-assign]
    engine_module.admit = _labelled("admit", admit)
    try:
        yield
    finally:
        engine_module.admit = admit
        delattr(engine, "_scorer")
        for owner, name, _ in targets:
            delattr(owner, name)


def traced(engine: KVMemEngine, turn: Callable[[], tuple[int, float]], out: Path, size: int) -> tuple[int, float]:
    """Run ``turn`` under the profiler with ``engine``'s phases labelled; write ``size``'s files into ``out``.
    -> what ``turn`` returned (workspace tokens, TTFT s)"""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with labelled(engine), profile(activities=activities) as prof:
        tokens, ttft = turn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    events = prof.key_averages()
    phases = sorted((e for e in events if e.key.startswith(PREFIX)), key=lambda e: -e.cpu_time_total)
    lines = [f"workspace {tokens} tokens, TTFT {ttft:.3f} s", "", "phase  calls  host_ms  device_ms"]
    lines += [f"{e.key}  {e.count}  {e.cpu_time_total / 1e3:.2f}  {e.device_time_total / 1e3:.2f}" for e in phases]
    raw = out / f"{size}.trace.json"
    prof.export_chrome_trace(str(raw))
    trace = Trace.of(json.loads(raw.read_text())["traceEvents"])
    lines += ["", *idle_table(trace), "", *gap_lines(trace)]
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    lines += ["", events.table(sort_by=sort, row_limit=50, max_name_column_width=90)]
    (out / f"{size}.trace.txt").write_text("\n".join(lines))
    with raw.open("rb") as src, gzip.open(out / f"{size}.trace.json.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    return tokens, ttft


DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CALLS = ("cuda_runtime", "cuda_driver")  # Triton launches through the driver API
LONG_CALL_US = 100.0  # a runtime call this long inside a gap is the host waiting (a synchronization)


@dataclass
class Trace:
    """A Chrome trace's labelled host ranges, runtime calls and device work (launch time, start, end, name)."""

    ranges: list[dict[str, Any]]
    calls: list[dict[str, Any]]
    work: list[tuple[float, float, float, str]]

    @classmethod
    def of(cls, events: list[dict[str, Any]]) -> "Trace":
        spans = [e for e in events if e.get("ph") == "X"]
        ranges = sorted((e for e in spans if e.get("cat") == "user_annotation" and PREFIX in e["name"]), key=_ts)
        calls = [e for e in spans if e.get("cat") in HOST_CALLS]
        launched_at = {e["args"]["correlation"]: e["ts"] for e in calls if "correlation" in e.get("args", {})}
        work = [
            (launched_at[e["args"]["correlation"]], e["ts"], e["ts"] + e["dur"], e["name"])
            for e in spans
            if e.get("cat") in DEVICE_WORK and e.get("args", {}).get("correlation") in launched_at
        ]
        return cls(ranges, calls, sorted(work, key=lambda w: w[1]))


def _ts(e: dict[str, Any]) -> float:
    return e["ts"]


def _busy(spans: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` spans."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        total += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return total


def idle_table(trace: Trace) -> list[str]:
    """How busy the device was under each labelled range of ``trace``: per label, the ranges'
    host time, the device time of the work they launched (overlaps counted once), the span from that work's first
    start to its last end, and the idle time inside that span. A span longer than its busy time is a device that
    waited on the host (launches, synchronizations, Python between forwards). -> the table's lines"""
    totals: dict[str, list[float]] = {}
    for r in trace.ranges:
        spans = [(start, end) for launch, start, end, _ in trace.work if r["ts"] <= launch <= r["ts"] + r["dur"]]
        span = max((e for _, e in spans), default=0.0) - min((s for s, _ in spans), default=0.0)
        row = totals.setdefault(r["name"], [0, 0.0, 0.0, 0.0])
        row[0] += 1
        row[1] += r["dur"]
        row[2] += _busy(spans)
        row[3] += span
    lines = ["range  calls  host_ms  device_busy_ms  device_span_ms  device_idle_ms"]
    for name, (calls, host, busy, span) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"{name}  {calls:.0f}  {_ms(host, busy, span, span - busy)}")
    return lines


def gap_lines(trace: Trace, min_us: float = 300.0) -> list[str]:
    """The device's idle gaps of at least ``min_us`` between the first and the last labelled range of ``trace``,
    in order: when (ms after the first range began), how long, the work that ended it, the
    labelled ranges open on the host when that work was launched, and the long runtime calls (waits) inside it;
    then the idle time summed by those open ranges. -> the lines"""
    if not trace.ranges:
        return []
    t0, t1 = trace.ranges[0]["ts"], max(r["ts"] + r["dur"] for r in trace.ranges)
    gaps, reach = [], t0
    for launch, start, end, name in (w for w in trace.work if t0 <= w[1] <= t1):
        if start - reach >= min_us:
            gaps.append((reach, start, launch, name))
        reach = max(reach, end)
    lines, by_open = [f"device idle gaps of {min_us:.0f} us or more (ms from the turn's start)"], Counter[str]()
    for a, b, launch, name in gaps:
        open_ranges = "/".join(
            r["name"][len(PREFIX) :] for r in trace.ranges if r["ts"] <= launch <= r["ts"] + r["dur"]
        )
        waits = [
            f"{c['name']} {c['dur'] / 1e3:.2f}" for c in trace.calls if a <= c["ts"] <= b and c["dur"] >= LONG_CALL_US
        ]
        by_open[open_ranges or "-"] += b - a
        lines.append(f"+{_ms(a - t0)}  {_ms(b - a)}  {name[:60]}  [{open_ranges}]  {'; '.join(waits)}")
    lines += ["", "idle ms by the ranges open at the next launch"]
    lines += [f"{_ms(us)}  {where}" for where, us in by_open.most_common()]
    return lines


def _ms(*us: float) -> str:
    return "  ".join(f"{x / 1e3:.2f}" for x in us)
