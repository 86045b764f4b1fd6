"""Structured output in the one decode loop (kvmem_core.structured): whatever the logits, the answer parses and
validates against the schema within ``max_tokens``, on a byte-level vocabulary (one token per byte, one end token)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmem.server.formats import grammar
from kvmem_core.contract import SamplingParams
from kvmem_core.errors import GrammarError
from kvmem_core.sampling import decode
from kvmem_core.structured import Constraint
from kvmem_core.vocabulary import Vocabulary

pytest.importorskip("llguidance")
EOS = 256
CITY = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "unit": {"enum": ["c", "f"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "size": {"type": "integer"},
    },
    "required": ["name", "unit", "tags", "size"],
    "additionalProperties": False,
}


def byte_vocab() -> Vocabulary:
    return Vocabulary(
        257, lambda t: b"" if t == EOS else bytes([t]), lambda t: t == EOS, lambda text: list(text.encode())
    )


VOCAB = byte_vocab()


def run(grammar_text: str, logits_rows: np.ndarray, max_tokens: int, trigger: str | None = None) -> tuple[str, str]:
    """Decode greedily from ``logits_rows`` (one row per step, cycled) under the grammar; -> (text, finish)."""
    rows = iter(np.tile(logits_rows, (max_tokens // len(logits_rows) + 2, 1)))
    constraint = Constraint(grammar_text, VOCAB, trigger)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    text, _, finish = decode(
        params,
        next(rows),
        VOCAB._token_bytes,
        VOCAB._is_eog,
        lambda t: lambda: next(rows),
        lambda piece: True,
        None,
        constraint,
    )
    return text, finish


def schema_grammar(schema: dict | None, strict: bool = True) -> str:
    return grammar((schema, strict), None, None, "hermes")[0]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), max_tokens=st.integers(60, 400))
def test_any_logits_give_json_of_the_schema(seed: int, max_tokens: int) -> None:
    rows = np.random.default_rng(seed).standard_normal((7, 257)).astype(np.float32)
    text, finish = run(schema_grammar(CITY), rows, max_tokens)
    value = json.loads(text)
    assert finish == "stop" and set(value) == set(CITY["properties"]) and value["unit"] in ("c", "f")
    assert isinstance(value["size"], int) and all(isinstance(t, str) for t in value["tags"])


def test_a_model_that_loops_in_a_string_is_closed_early() -> None:
    rows = np.zeros((1, 257), dtype=np.float32)
    rows[0, ord("a")] = 5.0  # "aaaa..." forever, left alone
    text, finish = run(
        schema_grammar({"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}), rows, 4000
    )
    assert finish == "stop" and json.loads(text)["s"].strip("a") == "" and len(text) < 300


def test_json_object_is_any_object_and_strict_schemas_refuse_unknown_keywords() -> None:
    rows = np.random.default_rng(1).standard_normal((5, 257)).astype(np.float32)
    assert isinstance(json.loads(run(schema_grammar(None, False), rows, 200)[0]), dict)
    weird = {"type": "string", "format": "no-such-format"}
    with pytest.raises(GrammarError, match="Unknown format"):
        schema_grammar(weird)
    assert schema_grammar(weird, strict=False)  # lenient: the keyword is ignored


def test_a_lazy_tool_grammar_holds_only_the_call_after_its_marker() -> None:
    tools = [{"type": "function", "function": {"name": "f", "strict": True, "parameters": CITY}}]
    text_grammar, trigger = grammar(None, tools, "auto", "hermes")
    assert trigger == "<tool_call>"
    free = "Let me look.\n<tool_call>"
    rows = np.random.default_rng(2).standard_normal((len(free) + 9, 257)).astype(np.float32)
    for i, ch in enumerate(free.encode()):
        rows[i, ch] = 50.0  # the model writes the free text and the marker itself
    text, _ = run(text_grammar, rows, 400, trigger)
    head, call = text.split("<tool_call>\n", 1)
    body = json.loads(call.split("\n</tool_call>")[0])
    assert head == "Let me look.\n" and body["name"] == "f" and set(body["arguments"]) == set(CITY["properties"])


def test_required_tools_make_the_answer_calls() -> None:
    tools = [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "g", "strict": True, "parameters": CITY}},
    ]
    text_grammar, trigger = grammar(None, tools, {"type": "function", "function": {"name": "g"}}, "hermes")
    rows = np.random.default_rng(3).standard_normal((11, 257)).astype(np.float32)
    text, finish = run(text_grammar, rows, 400)
    assert trigger is None and text.startswith("<tool_call>\n") and finish == "stop"
    call = json.loads(text.split("\n")[1])
    assert call["name"] == "g" and set(call["arguments"]) == set(CITY["properties"])


class Thinks:
    """A steer whose first ``n`` tokens are a think block, free of the output format."""

    lead = ""

    def __init__(self, n: int) -> None:
        self.n, self.inside = n, n > 0

    def forced(self) -> int | None:
        return None

    def observe(self, data: bytes) -> None:
        self.n -= 1
        self.inside = self.n > 0


def test_a_think_block_is_outside_the_format() -> None:
    rows = np.full((1, 257), -1.0, dtype=np.float32)
    rows[0, ord("x")] = 5.0  # the model would write x forever
    rows = iter(np.tile(rows, (80, 1)))
    constraint = Constraint(grammar(({"type": "integer"}, True), None, None, "hermes")[0], VOCAB)
    text, _, finish = decode(
        SamplingParams(temperature=0, max_tokens=60),
        next(rows),
        VOCAB.token_bytes,
        VOCAB._is_eog,
        lambda t: lambda: next(rows),
        lambda piece: True,
        Thinks(6),
        constraint,
    )
    assert text[:6] == "xxxxxx" and isinstance(json.loads(text[6:]), int) and finish == "stop"
