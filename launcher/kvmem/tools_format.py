"""Tool calls as plain text, for chat templates that know nothing of tools.

The default SmolLM2 template only concatenates ``role`` and ``content``, so an agent
transcript (tool schemas, assistant ``tool_calls``, ``tool`` results) is rewritten into
ordinary turns in one fixed format (the widely used Hermes style, documented in
docs/server.md):

- tool schemas: appended to the first system message inside ``<tools>...</tools>``, one
  JSON object per line, with an instruction to answer with ``<tool_call>`` blocks;
- an assistant call: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``;
- a tool result: a ``user`` turn ``<tool_response>\\n...\\n</tool_response>``.

``parse_tool_calls`` reads calls back out of generated text; ``ToolCallFilter`` does the
same for a stream, holding back text once a call may have begun.
"""
from __future__ import annotations

import json
import re
import uuid
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
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
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    if msg["role"] == "assistant" and msg.get("tool_calls"):
        calls = [call_text(c["function"]["name"], c["function"].get("arguments", "{}")) for c in msg["tool_calls"]]
        return {"role": "assistant", "content": "\n".join(filter(None, [content, *calls]))}
    return {"role": msg["role"], "content": content}


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """Split generated ``text`` into its plain content and OpenAI ``tool_calls`` dicts.

    A block whose body is not a JSON object with a string ``name`` stays in the content.
    """
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    pos = 0
    for match in _CALL.finditer(text):
        call = _parse_call(match.group(1))
        if call is None:
            continue
        kept.append(text[pos:match.start()])
        pos = match.end()
        calls.append(call)
    kept.append(text[pos:])
    return "".join(kept).strip() if calls else text, calls


def _parse_call(body: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", {})
    arguments = args if isinstance(args, str) else json.dumps(args)
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": obj["name"], "arguments": arguments}}


class ToolCallFilter:
    """Streams text through, holding it back from the first possible ``<tool_call>`` on."""

    def __init__(self) -> None:
        self.text = ""
        self.sent = 0
        self.holding = False

    def feed(self, piece: str) -> str:
        """Add a piece; return the text that is safe to stream as content now."""
        self.text += piece
        if self.holding:
            return ""
        start = self.text.find(OPEN, self.sent)
        if start >= 0:
            self.holding = True
            return self._emit(start)
        return self._emit(len(self.text) - _partial_open(self.text))

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """At the end: (content not yet streamed, parsed tool calls)."""
        return parse_tool_calls(self.text[self.sent:])

    def _emit(self, end: int) -> str:
        out = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return out


def _partial_open(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``<tool_call>``."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
