"""Where one default-knob turn's host time goes, at several workspace sizes: ``cProfile`` of a turn of the torch speed
bench's session (``speed_ab.Session``) once the session has grown past each size.

Random qwen35 weights of a shape; on the CPU the tiny shape computes little, so what grows with the workspace
shows. Writes ``SIZE.txt`` per size (cumulative and own-time listings, then the core's functions alone) and the
whole profile as ``SIZE.prof`` (``pstats``) into ``--out``:

    python -m kvmem_bench.turn_profile --shape tiny --device cpu --sizes 131072,524288,1048576 --out OUT

``--trace`` profiles the turn with ``torch.profiler`` instead, each phase of the step labelled, so a GPU's kernel
time is charged to the phase that launched it (``turn_trace``: ``SIZE.trace.txt`` and a timeline):

    python -m kvmem_bench.turn_profile --shape 9b --device cuda --sizes 131072,1048576 --trace --out OUT --model GGUF

``--collector`` times Python's garbage collector over five turns past each size instead (``SIZE.gc.json``: passes
and milliseconds a turn, by generation): what a turn's large Python objects cost beyond building them.

``--prompt-turns N`` times only building the prompt (``kvmem_core.prompt.build_prompt``, with the default model's
tokenizer and template) of the same session's turns past N turns (365: ~1.05M tokens), no model run.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

from kvmem_bench.speed_ab import LINES, Session
from kvmem_bench.speed_session import GREEDY_ONE, Transcript
from kvmem_bench.speed_torch import DEFAULT_VIEW, session_engine
from kvmem_core.contract import StepRequest
from kvmem_core.prompt import build_prompt

COLLECTOR_TURNS = 5


def run(
    shape: str,
    model: str | None,
    sizes: Sequence[int],
    out: Path,
    device: str,
    lines: int = LINES,
    log: Any = print,
    trace: bool = False,
    collector: bool = False,
) -> list[tuple[int, float]]:
    """Profile a turn past each of ``sizes`` (ascending) into ``out``; ``trace``: with ``torch.profiler`` and the
    engine's phases labelled (``turn_trace``) instead of ``cProfile``; ``collector``: time Python's garbage
    collector over ``COLLECTOR_TURNS`` turns instead. -> (workspace tokens, TTFT s) per profile"""
    plan = dict(DEFAULT_VIEW, sizes=(max(sizes),), lines=lines)
    engine = session_engine(shape, model, plan, device)
    session, done = Session(engine, lines), []
    out.mkdir(parents=True, exist_ok=True)
    try:
        for size in sorted(sizes):
            while session.step()[0] < size:
                pass
            if trace:
                tokens, ttft = _traced(engine, session, out, size)
            elif collector:
                tokens, ttft = _collected(session, out, size, log)
            else:
                tokens, ttft = _profiled(session, out, size)
            log(f"profiled a turn at {tokens} tokens: TTFT {ttft:.3f} s")
            done.append((tokens, ttft))
    finally:
        engine.close()
    return done


def _profiled(session: Session, out: Path, size: int) -> tuple[int, float]:
    """One turn under ``cProfile``, its listings written to ``SIZE.txt`` and the profile to ``SIZE.prof``."""
    profile = cProfile.Profile()
    profile.enable()
    tokens, ttft = session.step()
    profile.disable()
    text = io.StringIO()
    for order, *limits in (("cumulative", 60), ("tottime", 30), ("cumulative", "kvmem_core", 60)):
        pstats.Stats(profile, stream=text).sort_stats(order).print_stats(*limits)
    (out / f"{size}.txt").write_text(f"workspace {tokens} tokens, TTFT {ttft:.3f} s\n{text.getvalue()}")
    profile.dump_stats(out / f"{size}.prof")
    return tokens, ttft


def _collected(session: Session, out: Path, size: int, log: Any) -> tuple[int, float]:
    """``COLLECTOR_TURNS`` turns with each of the garbage collector's passes timed (``gc.callbacks``); writes
    ``SIZE.gc.json`` and logs it: per generation, passes and milliseconds a turn. -> (the last turn's tokens, its
    TTFT)"""
    passes, ms, started = [0, 0, 0], [0.0, 0.0, 0.0], [0.0]

    def timed(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            passes[info["generation"]] += 1
            ms[info["generation"]] += (time.perf_counter() - started[0]) * 1000

    gc.callbacks.append(timed)
    try:
        for _ in range(COLLECTOR_TURNS):
            tokens, ttft = session.step()
    finally:
        gc.callbacks.remove(timed)
    per_turn = {f"gen{g}": {"passes": passes[g], "ms_a_turn": round(ms[g] / COLLECTOR_TURNS, 2)} for g in range(3)}
    (out / f"{size}.gc.json").write_text(json.dumps({"tokens": tokens, "turns": COLLECTOR_TURNS, **per_turn}))
    log(f"{tokens} tokens: the collector a turn, by generation: {per_turn}")
    return tokens, ttft


def _traced(engine: Any, session: Session, out: Path, size: int) -> tuple[int, float]:
    from kvmem_bench.turn_trace import traced  # torch's profiler, imported only here

    return traced(engine, session.step, out, size)


def prompt_seconds(model: str | None, turns: int, timed: int = 7, lines: int = LINES) -> tuple[int, list[float]]:
    """Seconds ``build_prompt`` takes for each of ``timed`` turns after ``turns`` turns of the session (one turn
    before them untimed: it fills the tokenizer's and template's caches). -> (the last prompt's tokens, seconds)"""
    from kvmem.models import resolve_model
    from kvmem_bench.torch_device import random_adapter

    adapter = random_adapter("tiny", resolve_model(model), device="cpu", view_tokens=DEFAULT_VIEW["budget"])
    transcript, seconds = Transcript(lines), []
    for _ in range(turns):
        transcript.add_tool_result()
        transcript.add_reply()
    for turn in range(timed + 1):
        request = StepRequest(messages=transcript.add_tool_result(), sampling=GREEDY_ONE)
        t0 = time.perf_counter()
        tokens = len(build_prompt(adapter, request).tokens)
        seconds += [time.perf_counter() - t0] if turn else []
        transcript.add_reply()
    adapter.close()
    return tokens, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default=None, help="the GGUF whose tokenizer and template the weights get")
    ap.add_argument("--sizes", default="131072,524288,1048576")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--trace", action="store_true", help="torch.profiler with the engine's phases labelled")
    ap.add_argument("--collector", action="store_true", help="time the garbage collector over a few turns")
    ap.add_argument("--prompt-turns", type=int, default=None, help="time building the prompt past this many turns")
    args = ap.parse_args()
    if args.prompt_turns is not None:
        tokens, seconds = prompt_seconds(args.model, args.prompt_turns)
        print(f"{tokens} tokens: build_prompt median {statistics.median(seconds) * 1000:.1f} ms, runs", seconds)
        return
    if args.out is None:
        ap.error("--out is required")
    sizes = [int(s) for s in args.sizes.split(",")]
    run(args.shape, args.model, sizes, args.out, args.device, trace=args.trace, collector=args.collector)


if __name__ == "__main__":
    main()
