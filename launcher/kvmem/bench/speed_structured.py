"""The cost of structured output per decoded token: one JSON-schema answer on a loaded engine, then its tokens
replayed through a fresh grammar mask alone (``kvmem_core.structured.Constraint``) over the model's whole
vocabulary, so the mask's own time is measured apart from the model's. The goal: at most 5% of a decode step."""
from __future__ import annotations

import json
import time
from typing import Any

import numpy as np

from kvmem.server.formats import grammar
from kvmem_core.contract import SamplingParams, StepRequest
from kvmem_core.structured import Constraint

GOAL_SHARE = 0.05
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "country": {"type": "string"},
                                           "population": {"type": "integer"}, "landmarks": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "country", "population", "landmarks"], "additionalProperties": False}


def structured_cost(engine: Any, max_tokens: int = 96) -> dict[str, Any]:
    """Mask time per token against the engine's decode step on one constrained answer (``max_tokens`` at most);
    ``None`` figures when llguidance is not installed."""
    try:
        text, _ = grammar((SCHEMA, True), None, None, None)
    except Exception as exc:  # no grammar library: the row says so instead of failing the run
        return {"mask_ms_per_token": None, "error": str(exc)}
    request = StepRequest(messages=({"role": "user", "content": "Describe Paris as JSON."},),
                          sampling=SamplingParams(temperature=0, max_tokens=max_tokens, grammar=text))
    result = engine.step(request, lambda piece: True)
    vocabulary = engine.formats.vocabulary
    constraint, logits = Constraint(text, vocabulary), np.zeros(vocabulary.n_vocab, dtype=np.float32)
    adapter = engine.adapter
    t = time.perf_counter()
    for token in result.token_ids:
        constraint.allow(logits, max_tokens)
        constraint.take(token, adapter.token_bytes(token))
    tokens = max(len(result.token_ids), 1)
    mask_ms, step_ms = 1e3 * (time.perf_counter() - t) / tokens, 1e3 * result.timings["decode_s"] / tokens
    return {"tokens": len(result.token_ids), "parses": parses(result.text), "vocab": vocabulary.n_vocab,
            "mask_ms_per_token": round(mask_ms, 4),
            "decode_ms_per_token": round(step_ms, 3), "mask_share": round(mask_ms / step_ms, 4),
            "goal_share": GOAL_SHARE}


def parses(text: str) -> bool:
    """Whether ``text`` is a JSON object with every key ``SCHEMA`` requires, and no other."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and set(value) == set(SCHEMA["required"])


def main(models: list[str]) -> None:
    """``python -m kvmem.bench.speed_structured [MODEL ...]``: the row alone on each model (llama.cpp; default:
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
