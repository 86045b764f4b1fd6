"""The cost of structured output per decoded token, two ways on a loaded engine. What a user pays (``exposed``):
one JSON-schema answer's decode time per token against the same prompt's unconstrained decode for as many tokens,
best of interleaved rounds. The mask's own work (``mask_ms_per_token``): the answer's tokens replayed through a
fresh grammar mask alone (``kvmem_core.structured.Constraint``, planning each step in line) over the model's whole
vocabulary. The decode loop plans each step's mask while the model computes the step's logits, so the exposed
cost is what is left of the mask's work on the token path. The goal: at most 5% of a decode step."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Any

import numpy as np

from kvmem.server.formats import grammar
from kvmem_core.contract import SamplingParams, StepRequest
from kvmem_core.structured import Constraint

GOAL_SHARE = 0.05
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "country": {"type": "string"},
        "population": {"type": "integer"},
        "landmarks": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "country", "population", "landmarks"],
    "additionalProperties": False,
}


def structured_cost(engine: Any, max_tokens: int = 96, rounds: int = 3) -> dict[str, Any]:
    """Structured output's cost per token against the engine's decode step on one constrained answer (``max_tokens``
    at most), over ``rounds`` interleaved constrained and free answers; ``None`` figures when llguidance is not
    installed. ``mask_share``: the exposed cost's share of a free decode step (negative: within the noise)."""
    try:
        text, _ = grammar((SCHEMA, True), None, None, None)
    except Exception as exc:  # no grammar library: the row says so instead of failing the run
        return {"mask_ms_per_token": None, "error": str(exc)}
    constrained = SamplingParams(temperature=0, max_tokens=max_tokens, grammar=text)
    result, constrained_ms = _decode_ms(engine, constrained)
    free = replace(constrained, grammar=None, max_tokens=max(len(result.token_ids), 1))
    free_ms = _decode_ms(engine, free)[1]
    for _ in range(rounds - 1):
        constrained_ms = min(constrained_ms, _decode_ms(engine, constrained)[1])
        free_ms = min(free_ms, _decode_ms(engine, free)[1])
    mask_ms, exposed_ms = mask_alone_ms(engine, text, result.token_ids, max_tokens), constrained_ms - free_ms
    return {
        "tokens": len(result.token_ids),
        "parses": parses(result.text),
        "vocab": engine.formats.vocabulary.n_vocab,
        "mask_ms_per_token": round(mask_ms, 4),
        "decode_ms_per_token": round(constrained_ms, 3),
        "free_decode_ms_per_token": round(free_ms, 3),
        "exposed_ms_per_token": round(exposed_ms, 4),
        "mask_alone_share": round(mask_ms / free_ms, 4),
        "mask_share": round(exposed_ms / free_ms, 4),
        "goal_share": GOAL_SHARE,
    }


def _decode_ms(engine: Any, sampling: SamplingParams) -> tuple[Any, float]:
    """One answer to the benchmark's prompt; -> (the step's result, its decode time per token in ms)."""
    request = StepRequest(messages=({"role": "user", "content": "Describe Paris as JSON."},), sampling=sampling)
    result = engine.step(request, lambda piece: True)
    return result, 1e3 * result.timings["decode_s"] / max(len(result.token_ids), 1)


def mask_alone_ms(engine: Any, text: str, tokens: list[int], max_tokens: int) -> float:
    """The grammar ``text``'s mask and advance per token, replaying ``tokens`` in line, no model (ms)."""
    vocabulary = engine.formats.vocabulary
    constraint, logits = Constraint(text, vocabulary), np.zeros(vocabulary.n_vocab, dtype=np.float32)
    t = time.perf_counter()
    for token in tokens:
        constraint.allow(logits, max_tokens)
        constraint.take(token, engine.adapter.token_bytes(token))
    return 1e3 * (time.perf_counter() - t) / max(len(tokens), 1)


def parses(text: str) -> bool:
    """Whether ``text`` is a JSON object with every key ``SCHEMA`` requires, and no other."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and set(value) == set(SCHEMA["required"])


def main(models: list[str]) -> None:
    """``python -m kvmem_bench.speed_structured [MODEL ...]``: the row alone on each model (llama.cpp; default:
    the default model), as one JSON line each."""
    from kvmem.engines import load_engine
    from kvmem.models import resolve_model
    from kvmem_core.config import KVMemConfig

    for name in models or [None]:
        engine = load_engine("llama.cpp", str(resolve_model(name)), KVMemConfig(ctx=4096))
        try:
            print(json.dumps({"model": engine.model_id, **structured_cost(engine)}), flush=True)
        finally:
            engine.close()


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
