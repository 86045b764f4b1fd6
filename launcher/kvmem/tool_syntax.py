"""The tool-call syntaxes models emit, read back into OpenAI ``tool_calls``.

Each chat template teaches its model one syntax; ``detect`` names it from the template's
source, and ``SYNTAXES`` holds a reader for each:

- ``hermes`` (Qwen2.5, Hermes 2/3, and KVMem's own plain-text format):
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call;
- ``llama3`` (Llama 3.1/3.2 JSON tool calling): ``{"name": ..., "parameters": {...}}`` as
  the whole answer, optionally after ``<|python_tag|>``, several separated by ``;``;
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}`` (v3), or
  ``[TOOL_CALLS]name[ARGS]{...}`` per call (v11 and later).

Every syntax also reads a bare JSON call (``{"name": ..., "arguments"|"parameters": ...}``)
at the very start of an answer: small models often drop the tags their template asks for.

A call region starts at one of a syntax's ``markers`` (anywhere) or ``leading`` markers
(only before any other text); ``scan`` reads calls from the start of a region.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass
from typing import Any, Callable

Call = dict[str, Any]
Item = tuple[str, Any]  # ("content", str) or ("call", Call)
_DECODER = json.JSONDecoder()
_ALNUM = string.ascii_letters + string.digits
_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")
_MISTRAL_NAME = re.compile(r"\s*([A-Za-z0-9_.\-]+)(?:\[CALL_ID\]([A-Za-z0-9]+))?\[ARGS\]")


def openai_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def mistral_id() -> str:
    """Mistral templates refuse tool call ids that are not 9 letters or digits."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


def mistral_safe_id(call_id: str) -> str:
    """``call_id`` if it is 9 letters or digits, else 9 derived from it (stable, so prompts repeat)."""
    if _MISTRAL_ID.fullmatch(call_id):
        return call_id
    n = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
    return "".join(_ALNUM[(n // 62**i) % 62] for i in range(9))


def make_call(name: str, args: Any, new_id: Callable[[], str], call_id: str | None = None) -> Call:
    """An OpenAI tool call; ``args`` an object (sent as its JSON) or a string (sent as is)."""
    arguments = args if isinstance(args, str) else json.dumps(args)
    return {"id": call_id or new_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def json_call(obj: Any, new_id: Callable[[], str]) -> Call | None:
    """The call a decoded JSON value describes: an object with a string ``name`` and object ``arguments``
    (or ``parameters``); None for anything else."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, (dict, str)):
        return None
    return make_call(obj["name"], args, new_id)


def decode_json(text: str, start: int = 0) -> tuple[Any, int] | None:
    """(value, end) of the JSON value at ``text[start:]`` after blanks; None when there is none (yet)."""
    start = len(text) - len(text[start:].lstrip())
    try:
        return _DECODER.raw_decode(text, start)
    except (ValueError, RecursionError):  # not JSON (yet), or JSON too deep or too long a number to read
        return None


@dataclass(frozen=True)
class Syntax:
    """How one family of models writes calls; ``scan`` is its reader."""

    name: str
    markers: tuple[str, ...]
    leading: tuple[str, ...]
    scan: Callable[[str, bool, Callable[[], str]], tuple[list[Item], int]]
    new_id: Callable[[], str] = openai_id
    blanks: str = " \t\r\n"  # what may separate calls without being content

    def read(self, region: str, final: bool) -> tuple[list[Item], int]:
        """Items at the start of ``region`` and how many characters they took; ``([], 0)`` when more text
        is needed. With ``final`` (no more text comes) the whole region is taken, as content if it holds no call."""
        if not region.startswith(self.markers) and region.startswith(self.leading):
            return _bare(region, final, self.new_id)
        return self.scan(region, final, self.new_id)


def _bare(region: str, final: bool, new_id: Callable[[], str]) -> tuple[list[Item], int]:
    decoded = decode_json(region)
    if decoded is None:
        return ([("content", region)], len(region)) if final else ([], 0)
    call = json_call(decoded[0], new_id)
    return [("call", call) if call else ("content", region[: decoded[1]])], decoded[1]


def _scan_hermes(region: str, final: bool, new_id: Callable[[], str]) -> tuple[list[Item], int]:
    open_, close = "<tool_call>", "</tool_call>"
    end = region.find(close)
    if end < 0 and not final:
        return [], 0
    body = region[len(open_) : end if end >= 0 else len(region)]
    used = end + len(close) if end >= 0 else len(region)
    decoded = decode_json(body)
    call = json_call(decoded[0], new_id) if decoded and not body[decoded[1] :].strip() else None
    return [("call", call) if call else ("content", region[:used])], used


def _scan_llama3(region: str, final: bool, new_id: Callable[[], str]) -> tuple[list[Item], int]:
    tag = "<|python_tag|>"
    start = len(tag) if region.startswith(tag) else 0
    decoded = decode_json(region, start)
    if decoded is None:
        return ([("content", region)], len(region)) if final else ([], 0)
    call = json_call(decoded[0], new_id)
    return [("call", call) if call else ("content", region[: decoded[1]])], decoded[1]


def _scan_mistral(region: str, final: bool, new_id: Callable[[], str]) -> tuple[list[Item], int]:
    start = len("[TOOL_CALLS]")
    named = _MISTRAL_NAME.match(region, start)
    if named is not None:  # v11: name[ARGS]{...}
        decoded = decode_json(region, named.end())
        if decoded is not None:
            return [("call", make_call(named.group(1), decoded[0], new_id, named.group(2)))], decoded[1]
    else:  # v3: a JSON list (or one object) of calls
        decoded = decode_json(region, start)
        if decoded is not None:
            values = decoded[0] if isinstance(decoded[0], list) else [decoded[0]]
            calls = [json_call(v, new_id) for v in values]
            if calls and all(calls):
                return [("call", c) for c in calls], decoded[1]
            return [("content", region[: decoded[1]])], decoded[1]
    return ([("content", region)], len(region)) if final else ([], 0)


SYNTAXES = {
    "hermes": Syntax("hermes", ("<tool_call>",), ("{",), _scan_hermes),
    "llama3": Syntax("llama3", ("<|python_tag|>",), ("{",), _scan_llama3, blanks=" \t\r\n;"),
    "mistral": Syntax("mistral", ("[TOOL_CALLS]",), ("{",), _scan_mistral, new_id=mistral_id),
}


def detect(template: str) -> str | None:
    """The syntax a chat template teaches (a ``SYNTAXES`` key), or None when it renders no tools at all.
    A template that renders tools in a way not recognized here gets ``hermes``, the most common."""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|start_header_id|>" in template and ("<|python_tag|>" in template or "ipython" in template):
        return "llama3"
    if "<tool_call>" in template or "tools" in template:
        return "hermes"
    return None
