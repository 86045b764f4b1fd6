"""The cost of structured output per decoded token, two ways on a loaded engine. What a user pays (``exposed``):
one JSON-schema answer's decode time per token against the same prompt's unconstrained decode for as many tokens,
best of interleaved rounds. The mask's own work (``mask_ms_per_token``): the answer's tokens replayed through a
fresh grammar mask alone (``kvmem_core.structured.Constraint``, planning each step in line) over the model's whole
vocabulary. The decode loop plans each step's mask while the model computes the step's logits, so the exposed
cost is what is left of the mask's work on the token path. The goal: at most 5% of a decode step. Two figures
tell where it goes: ``masked_share``, the share of the answer's steps whose logits the mask was built for (a
greedy pick the grammar allows needs none), and ``host_ms_per_token``, the constrained decode loop's host time
per token less the free loop's, on the answer replayed with no model (every pick allowed: what the grammar adds
between two step launches where no mask is built, all of it exposed where the device step ends first)."""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import replace
from typing import Any

import numpy as np

from kvmem.server.formats import grammar
from kvmem_core.contract import SamplingParams, StepRequest
from kvmem_core.sampling import decode
from kvmem_core.structured import Constraint
from kvmem_core.vocabulary import Vocabulary

GOAL_SHARE = 0.05
_FRESH = itertools.count(1)
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
    made = _watch_constraints(engine)
    result, constrained_ms = _decode_ms(engine, constrained)
    steps, masked = made[-1].steps, made[-1].masked
    free = replace(constrained, grammar=None, max_tokens=max(len(result.token_ids), 1))
    free_ms = _decode_ms(engine, free)[1]
    for _ in range(rounds - 1):
        constrained_ms = min(constrained_ms, _decode_ms(engine, constrained)[1])
        free_ms = min(free_ms, _decode_ms(engine, free)[1])
    mask_ms, exposed_ms = mask_alone_ms(engine, text, result.token_ids, max_tokens), constrained_ms - free_ms
    vocabulary = engine.formats.vocabulary
    return {
        "tokens": len(result.token_ids),
        "parses": parses(result.text),
        "vocab": vocabulary.n_vocab,
        "steps": steps,
        "masked_share": round(masked / max(steps, 1), 4),
        "host_ms_per_token": round(host_ms(vocabulary, text, result.token_ids, max_tokens), 4),
        "compile_ms": round(compile_ms(vocabulary, text), 3),
        "mask_ms_per_token": round(mask_ms, 4),
        "decode_ms_per_token": round(constrained_ms, 3),
        "free_decode_ms_per_token": round(free_ms, 3),
        "exposed_ms_per_token": round(exposed_ms, 4),
        "mask_alone_share": round(mask_ms / free_ms, 4),
        "mask_share": round(exposed_ms / free_ms, 4),
        "goal_share": GOAL_SHARE,
    }


def _watch_constraints(engine: Any) -> list[Constraint]:
    """The constraints the engine's steps make from now on, in order (their counters read after a step)."""
    made: list[Constraint] = []
    make = engine.formats.constraint

    def constraint(sampling: SamplingParams, n_vocab: int) -> Constraint | None:
        made.append(made_one := make(sampling, n_vocab))
        return made_one

    engine.formats.constraint = constraint
    return made


def host_ms(vocabulary: Vocabulary, text: str, tokens: list[int], max_tokens: int, rounds: int = 5) -> float:
    """The host time per token the grammar ``text`` adds to the decode loop (``kvmem_core.sampling.decode``) on an
    answer of ``tokens`` replayed greedily with no model (each step's logits peak at the answer's next token, then
    at an end token), best of ``rounds`` interleaved constrained and free loops (ms)."""
    rows = np.zeros((len(tokens) + 1, vocabulary.n_vocab), dtype=np.float32)
    rows[np.arange(len(tokens) + 1), [*tokens, vocabulary.ends[0]]] = 1.0
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    best = {True: float("inf"), False: float("inf")}
    for _ in range(rounds):
        for constrained in best:
            feed = iter(rows)
            constraint = Constraint(text, vocabulary) if constrained else None
            t = time.process_time()
            ids = decode(
                params,
                next(feed),
                vocabulary.token_bytes,
                set(vocabulary.ends).__contains__,
                lambda token: lambda: next(feed),
                lambda piece: True,
                None,
                constraint,
            )[1]
            best[constrained] = min(best[constrained], time.process_time() - t)
            assert ids == list(tokens), "the replay left the answer"
    return 1e3 * (best[True] - best[False]) / max(len(tokens), 1)


def compile_ms(vocabulary: Vocabulary, text: str) -> float:
    """Compiling the grammar ``text`` anew (ms): what an answer in a format the engine has not kept pays once, in
    its decode time (blank lines, more each call, make it a text the vocabulary has not compiled)."""
    fresh = text + "\n" * next(_FRESH)
    t = time.perf_counter()
    Constraint(fresh, vocabulary)
    return 1e3 * (time.perf_counter() - t)


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


def main(args: list[str]) -> None:
    """``python -m kvmem_bench.speed_structured [--engine torch] [MODEL ...]``: the row alone on each model
    (default engine llama.cpp; default model: the default model), as one JSON line each."""
    from kvmem.engines import load_engine
    from kvmem.models import resolve_model
    from kvmem_core.config import KVMemConfig

    backend, models = ("torch", args[2:]) if args[:2] == ["--engine", "torch"] else ("llama.cpp", args)
    for name in models or [None]:
        engine = load_engine(backend, str(resolve_model(name)), KVMemConfig(ctx=4096))
        try:
            print(json.dumps({"model": engine.model_id, **structured_cost(engine)}), flush=True)
        finally:
            engine.close()


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
