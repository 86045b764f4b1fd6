"""Structured output's planning ahead on the default model (152K vocabulary): the answers with the mask planned while
the model computes equal those with every mask made in line, and they validate against their schema."""

from __future__ import annotations

import json
from typing import Any, Iterator

import jsonschema
import pytest

from kvmem_core.contract import SamplingParams, StepRequest
from kvmem_core.errors import ModelNotFoundError
from kvmem_core.structured import Constraint

pytest.importorskip("llguidance")
DEFAULT_MODEL = "qwen2.5-coder-0.5b"
TAKE = Constraint.take


def take_in_line(self: Constraint, token: int, data: bytes, left: int | None = None) -> None:
    """``Constraint.take`` without planning ahead: every mask made in line (the reference)."""
    TAKE(self, token, data)


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
def test_the_default_model_answers_the_same_with_and_without_planning_ahead(
    engine: Any, max_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvmem.server.formats import grammar

    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "sights": {"type": "array", "items": {"type": "string"}},
            "people": {"type": "integer"},
        },
        "required": ["city", "sights", "people"],
        "additionalProperties": False,
    }
    request = StepRequest(
        messages=({"role": "user", "content": "Describe Rome as JSON."},),
        sampling=SamplingParams(
            temperature=0, max_tokens=max_tokens, grammar=grammar((schema, True), None, None, None)[0]
        ),
    )
    ahead = engine.step(request, lambda piece: True)
    monkeypatch.setattr(Constraint, "take", take_in_line)
    in_line = engine.step(request, lambda piece: True)
    assert ahead.token_ids == in_line.token_ids and ahead.text == in_line.text
    jsonschema.validate(json.loads(ahead.text), schema)
