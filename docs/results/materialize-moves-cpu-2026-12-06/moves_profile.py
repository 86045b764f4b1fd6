"""Materialization with resident blocks moved in place against dropped and reloaded, on the CPU: the torch speed
bench's session (tiny random qwen35, the default view) past 30K tokens, then turns alternating ``caps.moves_cells``,
each under cProfile; prints per turn the cumulative seconds of the engine's ``_materialize`` and of the cache's RoPE
table writes (``PagedKV.place``), and the blocks moved and loaded.

    python docs/results/materialize-moves-cpu-2026-12-06/moves_profile.py MODEL_GGUF [ROUNDS]
"""

from __future__ import annotations

import cProfile
import dataclasses
import pstats
import sys

from kvmem_bench.speed_ab import LINES, Session
from kvmem_bench.speed_torch import DEFAULT_VIEW, session_engine


def seconds(profile: cProfile.Profile, name: str) -> float:
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    return sum(v[3] for k, v in stats.items() if k[2] == name)


def main() -> None:
    plan = dict(DEFAULT_VIEW, sizes=(131072,), lines=LINES)
    engine = session_engine("tiny", sys.argv[1], plan, "cpu")
    session = Session(engine, LINES)
    while session.step()[0] < 30000:
        pass
    for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 3):
        for on in (True, False):
            engine.adapter.caps = dataclasses.replace(engine.adapter.caps, moves_cells=on)
            before = engine.metrics()
            profile = cProfile.Profile()
            profile.enable()
            tokens, ttft = session.step()
            profile.disable()
            after = engine.metrics()
            moved, loaded = (after[k] - before.get(k, 0) for k in ("blocks_moved", "blocks_loaded"))
            materialize, rope = seconds(profile, "_materialize"), seconds(profile, "place")
            print(
                f"moves {on!s:5} {tokens} tokens: TTFT {ttft:.3f} s, materialize {materialize:.4f} s, "
                f"RoPE rows {rope:.4f} s, {moved:.0f} moved, {loaded:.0f} loaded"
            )
    engine.close()


if __name__ == "__main__":
    main()
