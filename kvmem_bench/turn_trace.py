"""Where one turn's device time goes: ``torch.profiler`` over a turn, the engine's phases labelled.

``cProfile`` (``turn_profile``) sees the host only: on a GPU the host waits at a few sync points and the kernels'
time lands on whatever waits. Here each phase of the engine's step (prompt building, prefill, selection and its
scoring, materialization, the query's replay, decoding, archiving) is a ``record_function`` range, so the profiler
adds up the host time spent inside it and the device time of the kernels it launched. Written per size:
``SIZE.trace.txt`` (the phases, then the kernels by device time) and ``SIZE.trace.json.gz`` (the timeline).
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import kvmem_core.engine as engine_module
from kvmem_core.engine import KVMemEngine

PHASES = ("_prefill", "_select", "_index", "_spans", "_materialize", "_replay", "_decode", "_archive", "_stage")
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
    """Label ``engine``'s phases (and the prompt's admission) for the duration; the engine is unchanged after."""
    admit = engine_module.admit
    for name in PHASES:
        setattr(engine, name, _labelled(name, getattr(engine, name)))
    engine._scorer = _label_scorer(engine._scorer)  # type: ignore[method-assign]
    engine_module.admit = _labelled("admit", admit)
    try:
        yield
    finally:
        engine_module.admit = admit
        for name in (*PHASES, "_scorer"):
            delattr(engine, name)


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
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    lines += ["", events.table(sort_by=sort, row_limit=50, max_name_column_width=90)]
    (out / f"{size}.trace.txt").write_text("\n".join(lines))
    raw = out / f"{size}.trace.json"
    prof.export_chrome_trace(str(raw))
    with raw.open("rb") as src, gzip.open(out / f"{size}.trace.json.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    return tokens, ttft
