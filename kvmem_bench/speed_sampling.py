"""What drawing a token costs the host at the server's default sampling (``kvmem bench speed``'s ``sampling`` row).

A decode step samples on the host before the next forward can start (the token is that forward's input), so the
sampler's time adds to every step. Timed on logits of the engine's vocabulary size (seeded, scaled like a model's)
with the server's defaults (``SamplingParams()``: temperature 0.8, top-k 40, top-p 0.95, what a client that sends
none of them gets) and greedily (what the bench's own decode rates use).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from kvmem_core.contract import SamplingParams
from kvmem_core.sampling import Sampler

DRAWS = 200


def engine_vocab(engine: Any) -> int | None:
    """The size of the logits ``engine`` last computed (its vocabulary); None before any."""
    logits = engine.last_logits
    return None if logits is None else int(logits.shape[-1])


def sampling_cost(n_vocab: int | None, step_ms: float | None, draws: int = DRAWS) -> dict[str, Any]:
    """Median ms a token of ``draws`` draws at the server's default sampling and greedily, over ``n_vocab`` logits
    (None: no figures); ``default_share``: the default's share of a decode step of ``step_ms`` (None without one)."""
    if not n_vocab:
        return {"vocab": None, "default_ms_per_token": None, "greedy_ms_per_token": None, "default_share": None}
    logits = (np.random.default_rng(0).standard_normal(n_vocab) * 3.0).astype(np.float32)
    out: dict[str, Any] = {"vocab": n_vocab, "draws": draws}
    for name, params in (("default", SamplingParams(seed=0)), ("greedy", SamplingParams(temperature=0.0))):
        sample = Sampler(params)
        sample(logits)
        seconds = []
        for _ in range(draws):
            start = time.perf_counter()
            sample(logits)
            seconds.append(time.perf_counter() - start)
        out[f"{name}_ms_per_token"] = round(statistics.median(seconds) * 1e3, 4)
    out["default_share"] = round(out["default_ms_per_token"] / step_ms, 4) if step_ms else None
    return out


def step_ms(points: list[dict[str, Any]]) -> float | None:
    """A decode step's ms at the largest workspace measured (None where it decoded nothing)."""
    rate = points[-1].get("kvmem_tok_s") if points else None
    return 1e3 / rate if rate else None


def sampling_line(row: dict[str, Any]) -> str:
    return (
        f"sampling at the server's defaults: {row['default_ms_per_token']} ms a token "
        f"({row['default_share']} of a decode step; greedy {row['greedy_ms_per_token']} ms)"
    )
