"""Output formats as grammars: what a request asks the answer to be, in the Lark text the engine's decode loop
follows (``kvmem_core.structured``; ``%json {...}`` embeds a JSON schema).

- ``response_format`` (chat; ``text.format`` in Responses, ``output_format`` in Messages): ``json_schema`` makes
  the answer one JSON value of the schema, ``json_object`` any JSON object;
- tools: under ``tool_choice: "required"`` or a named function the answer is calls, in the model's own tool
  syntax (``kvmem.tool_syntax``), to the offered functions; under ``auto`` with a ``strict`` tool each call the
  model starts is held to it from its marker on (a lazy grammar), the text around calls stays free. A call's
  arguments follow its tool's ``parameters`` (any JSON object without them), strictly when every tool is strict.

JSON is written as ``json.dumps`` writes it (``", "`` and ``": "``, no other blanks), so a small model cannot
spend its tokens on whitespace. A schema that does not compile is a 400 (``invalid_response_format``) before any
work; a strict schema with a keyword the compiler does not know is refused, a non-strict one ignores it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from kvmem.server import schemas as S
from kvmem_core.contract import SamplingParams
from kvmem_core.structured import check

_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class CallText:
    """How one tool syntax writes calls: the marker a call starts with, the rule of an answer of calls, the rule
    of what follows a marker up to the call's end, the key of a call object's arguments."""

    marker: str
    calls: str
    after_marker: str
    args_key: str = "arguments"


CALL_TEXT = {
    "hermes": CallText(
        "<tool_call>",
        'one_call ("\\n" one_call)*\none_call: "<tool_call>" after_marker',
        '"\\n" call_json "\\n</tool_call>"',
    ),
    "llama3": CallText("<|python_tag|>", '"<|python_tag|>"? call_json ("; " call_json)*', "call_json", "parameters"),
    "mistral": CallText("[TOOL_CALLS]", '"[TOOL_CALLS]" after_marker', '"[" call_json (", " call_json)* "]"'),
}


def json_rule(schema: dict[str, Any], strict: bool) -> str:
    """``%json`` of ``schema`` written compactly; unknown keywords refused when ``strict``, else ignored."""
    guided = {**schema, "x-guidance": {**_JSON_STYLE, "lenient": not strict}}
    return "%json " + json.dumps(guided)


def call_schema(tools: list[dict[str, Any]], args_key: str) -> dict[str, Any]:
    """The JSON schema of one call object to any of ``tools`` (chat-style), its arguments of the tool's parameters."""
    options = []
    for tool in tools:
        fn = tool["function"]
        params = fn.get("parameters") or {"type": "object"}
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, args_key: params},
                "required": ["name", args_key],
                "additionalProperties": False,
            }
        )
    return options[0] if len(options) == 1 else {"anyOf": options}


def chosen(tools: list[dict[str, Any]], tool_choice: str | dict[str, Any] | None) -> list[dict[str, Any]]:
    """The tools a ``tool_choice`` naming one function (chat's or Responses' shape) leaves; all of them else."""
    if not isinstance(tool_choice, dict):
        return tools
    name = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
    return [t for t in tools if t["function"]["name"] == name] or tools


def call_rules(tools: list[dict[str, Any]], text: CallText) -> str:
    """The rules every tool grammar shares: what follows a marker, and one call object."""
    strict = all(t["function"].get("strict") for t in tools)
    return f"after_marker: {text.after_marker}\ncall_json: {json_rule(call_schema(tools, text.args_key), strict)}"


Format = tuple[dict[str, Any] | None, bool]  # a JSON response format: its schema (None: any object), strict


def grammar(
    fmt: Format | None, tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None, syntax: str | None
) -> tuple[str | None, str | None]:
    """(grammar, trigger) of a request's answer (see the module docstring): ``fmt`` its JSON response format
    (None: text), ``tools`` the chat-style tools it offers (None: none), ``syntax`` the model's tool syntax.
    (None, None) when nothing constrains the answer; ``GrammarError`` when a schema does not compile."""
    text = CALL_TEXT.get(syntax or "hermes", CALL_TEXT["hermes"])
    forced = bool(tools) and (tool_choice == "required" or isinstance(tool_choice, dict))
    lazy = bool(tools) and not forced and any(t["function"].get("strict") for t in tools or ())
    answer = f"answer: {json_rule(*_schema_of(fmt))}"
    if forced:
        out = f"start: calls\ncalls: {text.calls}\n{call_rules(chosen(tools or [], tool_choice), text)}", None
    elif lazy and fmt is not None:
        out = f"start: answer | calls\n{answer}\ncalls: {text.calls}\n{call_rules(tools or [], text)}", None
    elif lazy:
        out = f"start: after_marker\n{call_rules(tools or [], text)}", text.marker
    elif fmt is not None:
        out = f"start: answer\n{answer}", None
    else:
        return None, None
    check(out[0])
    return out


def requested(fmt: S.ResponseFormat | S.TextFormat | S.OutputFormat | None) -> Format | None:
    """A body's response format (chat's, Responses' or Messages') as a ``Format``; None for text."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return None, False
    if isinstance(fmt, S.ResponseFormat):
        inner = fmt.json_schema or S.JsonSchema()
        return inner.schema, bool(inner.strict)
    return fmt.schema, bool(getattr(fmt, "strict", True))  # Messages' output_format is always strict


def _schema_of(fmt: Format | None) -> tuple[dict[str, Any], bool]:
    schema, strict = fmt or (None, False)
    return (schema if schema is not None else {"type": "object"}), strict and schema is not None


def constrained(sampling: SamplingParams, grammar_text: str | None, trigger: str | None) -> SamplingParams:
    """``sampling`` with the answer's grammar and trigger."""
    return replace(sampling, grammar=grammar_text, grammar_trigger=trigger)
