"""The cost of structured output per decoded token, two ways on a loaded engine. What a user pays (``exposed``):
one JSON-schema answer's decode time per token against the same answer decoded without the grammar. The
free run replays the answer's tokens through the same decode loop (``Replay``: each step still makes the free
loop's own greedy pick from the logits, then takes the answer's token), so both runs decode the same tokens at
the same positions, as many model steps, and end the same way (the end token picked from the logits after the
closing bracket). An unconstrained answer to the prompt would not: it is other text, and cut at the answer's
length it skips the last model step, which the grammar's answer runs to pick its end token (one step in 47 on
the default model: 2% of the decode, which would count as the grammar's). Each step is timed apart, from one pick
to the next (``StepTimer``), over ``rounds`` interleaved rounds of both, and each side's time is the sum of its
steps' best times: a burst of other work on the machine slows some steps of one round, not the same steps of
every round, so a slow round does not count whole. ``tests/reference/test_bench_speed_llamacpp.py`` checks that
a known cost put into the grammar's steps shows up at its size.

The mask's own work (``mask_ms_per_token``): the answer's tokens replayed through a fresh grammar mask alone
(``kvmem_core.structured.Constraint``, planning each step in line) over the model's whole vocabulary. The decode
loop plans each step's mask while the model computes the step's logits, so the exposed cost is what is left of
the mask's work on the token path. The goal: at most 5% of a decode step. Two figures tell where it goes:
``masked_share``, the share of the answer's steps whose logits the mask was built for (a greedy pick the grammar
allows needs none), and ``host_ms_per_token``, the constrained decode loop's host time per token less the free
loop's, on the answer replayed with no model (every pick allowed: what the grammar adds between two step
launches where no mask is built, all of it exposed where the device step ends first)."""

from __future__ import annotations

import itertools
import json
import time
from typing import Any, Callable, Sequence

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


def structured_cost(engine: Any, max_tokens: int = 96, rounds: int = 5) -> dict[str, Any]:
    """Structured output's cost per token against the engine's decode step on one constrained answer (``max_tokens``
    at most), over ``rounds`` interleaved constrained answers and replays of it without the grammar, after one
    constrained answer that warms up and gives the answer to replay; ``None`` figures when llguidance is not
    installed or a round's answer is not the first one's. ``mask_share``: the exposed cost's share of a free decode
    step (negative: within the noise)."""
    try:
        text, _ = grammar((SCHEMA, True), None, None, None)
    except Exception as exc:  # no grammar library: the row says so instead of failing the run
        return {"mask_ms_per_token": None, "error": str(exc)}
    constrained = SamplingParams(temperature=0, max_tokens=max_tokens, grammar=text)
    timer = StepTimer(engine)
    try:
        result, _ = timer.answer(constrained)
        steps, masked = timer.made.steps, timer.made.masked
        vocabulary = engine.formats.vocabulary
        replay, timed = Replay(result.token_ids, vocabulary.ends[0]), {True: [], False: []}
        for _ in range(rounds):
            for grammar_on in timed:
                again, steps_ms = timer.answer(constrained, None if grammar_on else replay)
                if again.token_ids != result.token_ids:  # other steps: nothing left to compare them with
                    return {"mask_ms_per_token": None, "error": "the constrained answer changed between rounds"}
                timed[grammar_on].append(steps_ms)
    finally:
        timer.close()
    constrained_ms, free_ms = (best_steps_ms(timed[on]) / max(len(result.token_ids), 1) for on in (True, False))
    mask_ms, exposed_ms = mask_alone_ms(engine, text, result.token_ids, max_tokens), constrained_ms - free_ms
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


def best_steps_ms(rounds: list[list[float]]) -> float:
    """The sum over an answer's steps of each step's best time across ``rounds`` (ms): a burst of other work on the
    machine slows a few steps of one round, which another round's same steps replace."""
    return float(np.min(np.array(rounds), axis=0).sum())


class Replay:
    """The decode loop's work without a grammar, on a given answer: each pick is the free loop's own (``sample`` of
    the logits), and the answer's next token is taken in its place (``end`` after the answer's last), so the model
    decodes the same tokens at the same positions, as many steps, and ends the same way."""

    def __init__(self, tokens: Sequence[int], end: int) -> None:
        self.tokens, self.end, self.at = tuple(tokens), end, 0

    def restart(self) -> Replay:
        self.at = 0
        return self

    def allow(self, logits: np.ndarray, left: int) -> np.ndarray:
        return logits

    def choose(self, logits: np.ndarray, left: int, sample: Callable[[np.ndarray], int], greedy: bool) -> int:
        sample(logits)
        return self.tokens[self.at] if self.at < len(self.tokens) else self.end

    def take(self, token: int, data: bytes, left: int | None = None) -> None:
        self.at += 1


class StepTimer:
    """Times an engine's decode steps one by one: its steps' constraints (the grammar's, or a ``Replay`` in its
    place) stamp the time at each pick. A step's time runs from one pick to the next, its model step included;
    the first runs from the making of the constraint, which a grammar's answer pays too."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.make = engine, engine.formats.constraint
        self.made: Any = None  # the latest answer's constraint (its ``steps`` and ``masked`` read after it)
        self._replay: Replay | None = None
        self._stamps: list[float] = []
        engine.formats.constraint = self._constraint

    def answer(self, sampling: SamplingParams, replay: Replay | None = None) -> tuple[Any, list[float]]:
        """One answer to the benchmark's prompt, under the grammar or ``replay``; -> (the step's result, each step's
        time in ms)."""
        self._replay, self._stamps = replay, []
        request = StepRequest(messages=({"role": "user", "content": "Describe Paris as JSON."},), sampling=sampling)
        result = self.engine.step(request, lambda piece: True)
        return result, list(1e3 * np.diff(self._stamps))

    def close(self) -> None:
        self.engine.formats.constraint = self.make

    def _constraint(self, sampling: SamplingParams, n_vocab: int) -> Any:
        self._stamps.append(time.perf_counter())
        self.made = self._replay.restart() if self._replay is not None else self.make(sampling, n_vocab)
        return None if self.made is None else _Stamped(self.made, self._stamps)  # None: a step without a format


class _Stamped:
    """``inner``'s picks, each stamped into ``stamps`` as it starts (one wrapper for both, so both pay it alike)."""

    def __init__(self, inner: Any, stamps: list[float]) -> None:
        self.inner, self.stamps = inner, stamps

    def allow(self, logits: np.ndarray, left: int) -> np.ndarray:
        return self.inner.allow(logits, left)

    def choose(self, logits: np.ndarray, left: int, sample: Callable[[np.ndarray], int], greedy: bool) -> int:
        self.stamps.append(time.perf_counter())
        return self.inner.choose(logits, left, sample, greedy)

    def take(self, token: int, data: bytes, left: int | None = None) -> None:
        self.inner.take(token, data, left)


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
