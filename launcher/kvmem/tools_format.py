"""Tool calls as plain text, for chat templates that know nothing of tools.

The default SmolLM2 template only concatenates ``role`` and ``content``, so an agent
transcript (tool schemas, assistant ``tool_calls``, ``tool`` results) is rewritten into
ordinary turns in one fixed format (the widely used Hermes style, documented in
docs/server.md):

- tool schemas: appended to the first system message inside ``<tools>...</tools>``, one
  JSON object per line, with an instruction to answer with ``<tool_call>`` blocks;
- an assistant call: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``;
- a tool result: a ``user`` turn ``<tool_response>\\n...\\n</tool_response>`` that keeps its
  ``tool_call_id`` (templates read only role and content; ``kvmem_core.groups`` reads the id
  to keep a result with its call).

Templates that render tools themselves get the transcript as it is, in the shape
Hugging Face templates expect (``native_messages``). Generated calls are read back by
``kvmem.output_parser`` in the syntax the template taught (``kvmem.tool_syntax``).
"""

from __future__ import annotations

import json
from typing import Any

from kvmem.tool_syntax import mistral_safe_id

OPEN, CLOSE = "<tool_call>", "</tool_call>"
TOOLS_PREAMBLE = (
    "You may call functions to help answer. The functions are listed in <tools></tools>, "
    "one JSON schema per line:\n<tools>\n{schemas}\n</tools>\n"
    "To call a function, answer only with one block per call:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <arguments-object>}}\n</tool_call>'
)


def tools_text(tools: list[dict[str, Any]]) -> str:
    """The system-prompt block that lists ``tools`` (OpenAI chat tool dicts)."""
    schemas = "\n".join(json.dumps(t["function"], sort_keys=True) for t in tools)
    return TOOLS_PREAMBLE.format(schemas=schemas)


def call_text(name: str, arguments: str) -> str:
    """One call block; ``arguments`` is the JSON string a client sent (kept verbatim if not JSON)."""
    try:
        args: Any = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        args = arguments
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': args})}\n{CLOSE}"


def render_plain(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """``messages`` (OpenAI chat dicts with string content) rewritten as plain role/content turns."""
    out = [_plain_turn(m) for m in messages]
    if tools:
        block = tools_text(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _plain_turn(msg: dict[str, Any]) -> dict[str, Any]:
    content = msg.get("content") or ""
    if msg["role"] == "tool":
        return {
            "role": "user",
            "content": f"<tool_response>\n{content}\n</tool_response>",
            "tool_call_id": msg.get("tool_call_id", ""),
        }
    if msg["role"] == "assistant" and msg.get("tool_calls"):
        calls = [call_text(c["function"]["name"], c["function"].get("arguments", "{}")) for c in msg["tool_calls"]]
        return {"role": "assistant", "content": "\n".join(filter(None, [content, *calls]))}
    return {"role": msg["role"], "content": content}


def native_messages(messages: list[dict[str, Any]], syntax: str | None) -> list[dict[str, Any]]:
    """``messages`` for a template that renders tools itself: each call's ``arguments`` as the object its
    JSON string holds (templates write it with ``tojson``, as the model wrote it), and for ``mistral``
    templates, which refuse other ids, every call id as 9 letters or digits (the same id each time)."""
    out = []
    for msg in messages:
        msg = dict(msg)
        if msg.get("tool_calls"):
            msg["tool_calls"] = [_native_call(c, syntax) for c in msg["tool_calls"]]
        if syntax == "mistral" and msg.get("tool_call_id") is not None:
            msg["tool_call_id"] = mistral_safe_id(msg["tool_call_id"])
        out.append(msg)
    return out


def _native_call(call: dict[str, Any], syntax: str | None) -> dict[str, Any]:
    fn = call["function"]
    try:
        args: Any = json.loads(fn.get("arguments") or "{}")
    except (ValueError, RecursionError):  # not JSON: the template gets the string as sent
        args = fn["arguments"]
    call_id = mistral_safe_id(call["id"]) if syntax == "mistral" else call["id"]
    return {**call, "id": call_id, "function": {**fn, "arguments": args}}
