"""The grammar mask planned ahead (kvmem_core.structured.Constraint.take with ``left``): the decode loop starts the
next step's mask on the planner thread while the model computes that step's logits, and the answers are the same,
token for token, as with every mask made in line: on random logits over a byte vocabulary (closing near the budget
included), and on the default model with its 152K vocabulary."""
from __future__ import annotations

import json
import threading
from typing import Any, Iterator

import jsonschema
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_structured import CITY, VOCAB, schema_grammar

from kvmem_core.contract import SamplingParams, StepRequest
from kvmem_core.errors import ModelNotFoundError
from kvmem_core.sampling import decode
from kvmem_core.structured import Constraint

pytest.importorskip("llguidance")
DEFAULT_MODEL = "qwen2.5-coder-0.5b"


TAKE = Constraint.take


class InLine(Constraint):
    """A constraint that makes every mask in line, on the decode's critical path (the reference)."""

    def take(self, token: int, data: bytes, left: int | None = None) -> None:
        TAKE(self, token, data)


def answer(constraint: Constraint, rows: np.ndarray, max_tokens: int, temperature: float) -> tuple[str, list[int], str]:
    feed = iter(np.tile(rows, (max_tokens // len(rows) + 2, 1)))
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=7)
    return decode(params, next(feed), VOCAB._token_bytes, VOCAB._is_eog, lambda t: lambda: next(feed), lambda piece: True,
                  None, constraint)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), max_tokens=st.integers(60, 300), temperature=st.sampled_from([0.0, 1.0]))
def test_planning_ahead_gives_the_same_answers_as_masking_in_line(seed: int, max_tokens: int, temperature: float) -> None:
    rows = np.random.default_rng(seed).standard_normal((5, 257)).astype(np.float32)
    text = schema_grammar(CITY)
    ahead = answer(Constraint(text, VOCAB), rows, max_tokens, temperature)
    assert ahead == answer(InLine(text, VOCAB), rows, max_tokens, temperature)
    jsonschema.validate(json.loads(ahead[0]), CITY)


def test_the_masks_are_made_on_the_planner_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[str] = []
    plan = Constraint._plan

    def watched(self: Constraint, left: int) -> Any:
        threads.append(threading.current_thread().name)
        return plan(self, left)

    monkeypatch.setattr(Constraint, "_plan", watched)
    text, ids, _ = answer(Constraint(schema_grammar(CITY), VOCAB), np.zeros((1, 257), np.float32), 200, 0.0)
    assert len(threads) == len(ids) + 1  # one plan per token sampled under the mask, the end token's included
    assert threads[0] == threading.current_thread().name  # the first step's: nothing ran ahead of it
    assert all(name.startswith("kvmem-grammar") for name in threads[1:])


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
@pytest.mark.parametrize("max_tokens", [32, 60])  # 32: the answer must close early, under the dry-run closing
def test_the_default_model_answers_the_same_with_and_without_planning_ahead(engine: Any, max_tokens: int,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from kvmem.server.formats import grammar

    schema = {"type": "object", "properties": {"city": {"type": "string"}, "sights": {"type": "array", "items": {"type": "string"}},
                                               "people": {"type": "integer"}}, "required": ["city", "sights", "people"],
              "additionalProperties": False}
    request = StepRequest(messages=({"role": "user", "content": "Describe Rome as JSON."},),
                          sampling=SamplingParams(temperature=0, max_tokens=max_tokens, grammar=grammar((schema, True), None, None, None)[0]))
    ahead = engine.step(request, lambda piece: True)
    monkeypatch.setattr("kvmem_core.structured.Constraint.take", InLine.take)
    in_line = engine.step(request, lambda piece: True)
    assert ahead.token_ids == in_line.token_ids and ahead.text == in_line.text
    jsonschema.validate(json.loads(ahead.text), schema)
