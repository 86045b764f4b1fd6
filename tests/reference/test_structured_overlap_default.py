"""Structured output's planning ahead on the default model (152K vocabulary): the answers with the mask planned while
the model computes equal those with every mask made in line and those with every step's logits masked, and they
validate against their schema; the checks that stand in for the mask agree with it in every state."""

from __future__ import annotations

import json
from typing import Any, Iterator

import jsonschema
import numpy as np
import pytest

from kvmem_core.contract import SamplingParams, StepRequest
from kvmem_core.errors import ModelNotFoundError
from kvmem_core.structured import Constraint

pytest.importorskip("llguidance")
DEFAULT_MODEL = "qwen2.5-coder-0.5b"
TAKE = Constraint.take


SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "sights": {"type": "array", "items": {"type": "string"}},
        "people": {"type": "integer"},
    },
    "required": ["city", "sights", "people"],
    "additionalProperties": False,
}


def take_in_line(self: Constraint, token: int, data: bytes, left: int | None = None) -> None:
    """``Constraint.take`` without planning ahead: every mask made in line (the reference)."""
    TAKE(self, token, data)


def choose_masked(self: Constraint, logits: Any, left: int, sample: Any, greedy: bool) -> int:
    """``Constraint.choose`` with every step's logits masked before the pick (the reference for greedy picks)."""
    return sample(self.allow(logits, left))


def rome(max_tokens: int) -> StepRequest:
    from kvmem.server.formats import grammar

    sampling = SamplingParams(
        temperature=0, max_tokens=max_tokens, grammar=grammar((SCHEMA, True), None, None, None)[0]
    )
    return StepRequest(messages=({"role": "user", "content": "Describe Rome as JSON."},), sampling=sampling)


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    pytest.importorskip("llama_cpp")
    from kvmem.engines import load_engine
    from kvmem.models import resolve_model
    from kvmem_core.config import KVMemConfig

    try:
        path = resolve_model(DEFAULT_MODEL)
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))
    loaded = load_engine("llama.cpp", str(path), KVMemConfig(ctx=2048, budget=1024, gen_budget=256))
    yield loaded
    loaded.close()


@pytest.mark.llamacpp
@pytest.mark.parametrize("max_tokens", [32, pytest.param(60, marks=pytest.mark.slow)])  # 32: must close early
def test_the_default_model_answers_the_same_with_and_without_planning_ahead(
    engine: Any, max_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    request = rome(max_tokens)
    ahead = engine.step(request, lambda piece: True)
    monkeypatch.setattr(Constraint, "take", take_in_line)
    in_line = engine.step(request, lambda piece: True)
    monkeypatch.setattr(Constraint, "choose", choose_masked)
    masked = engine.step(request, lambda piece: True)
    assert ahead.token_ids == in_line.token_ids == masked.token_ids and ahead.text == in_line.text == masked.text
    jsonschema.validate(json.loads(ahead.text), SCHEMA)


@pytest.mark.llamacpp
def test_the_one_token_checks_allow_what_the_mask_allows(engine: Any) -> None:
    """At each state of an answer, the checks that stand in for the mask agree with it: where the grammar forces
    whole tokens the mask allows ``_forced`` alone; elsewhere ``_admits`` (the matcher's one-token check) agrees
    with it on every fifth token, every token it allows, the end tokens and the closers. Both kinds of forced
    state occur (keys; a value's opening quote, which a longer token may extend)."""
    request = rome(60)
    answer = engine.step(request, lambda piece: True)
    vocabulary = engine.formats.vocabulary
    constraint = Constraint(request.sampling.grammar, vocabulary)
    sample = {*range(0, vocabulary.n_vocab, 5), *vocabulary.ends, *vocabulary.closers(Constraint.CLOSERS).values()}
    kinds = []
    for taken in [*answer.token_ids, None]:
        matcher = constraint.matcher
        forced_bytes, forced = matcher.compute_ff_bytes(), Constraint._forced(matcher)
        allowed = constraint._allowed(matcher)
        if forced is not None:
            assert np.flatnonzero(allowed).tolist() == [forced]
        else:
            tokens = sorted(sample | {int(t) for t in np.flatnonzero(allowed[: vocabulary.n_vocab])})
            assert [constraint._admits(matcher, t) for t in tokens] == [bool(allowed[t]) for t in tokens]
        kinds.append("whole" if forced is not None else "extensible" if forced_bytes else "none")
        if taken is not None:
            constraint.take(taken, vocabulary.token_bytes(taken))
    assert {"whole", "extensible", "none"} <= set(kinds)
