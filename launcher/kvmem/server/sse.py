"""Server-sent events: the framing both OpenAI streaming APIs use."""
from __future__ import annotations

import contextlib
import json
from typing import Any, AsyncIterator, Awaitable, Callable

from aiohttp import web

from kvmem.tools_format import ToolCallFilter
from kvmem_core.contract import StepResult

DONE = b"data: [DONE]\n\n"


def frame(data: dict[str, Any], event: str | None = None) -> bytes:
    """One event: an optional ``event:`` line, one ``data:`` line of compact JSON, a blank line."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


async def open_stream(request: web.Request) -> web.StreamResponse:
    """Start an SSE response; the status is 200 from here on, so later errors travel as events."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    return resp


def parse(body: bytes) -> list[tuple[str | None, str]]:
    """(event, data) pairs of an SSE body; the inverse of ``frame`` for tests and tools."""
    events = []
    for block in body.decode().split("\n\n"):
        event, data = None, []
        for line in block.splitlines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
        if data:
            events.append((event, "\n".join(data)))
    return events



async def relay(gen: AsyncIterator[Any], first: Any, emit: Callable[[str], Awaitable[Any]],
                tool_filter: ToolCallFilter | None = None) -> tuple[StepResult, list[dict[str, Any]]]:
    """Pass a step stream's text pieces to ``emit`` until its ``StepResult``; return it and the tool calls.

    ``first`` is the stream's first item (already awaited). With ``tool_filter``, text that
    forms a tool call is held back and parsed; the filter's trailing text is emitted last.
    """
    async with contextlib.aclosing(gen):
        item = first
        while not isinstance(item, StepResult):
            piece = tool_filter.feed(item) if tool_filter else item
            if piece:
                await emit(piece)
            item = await gen.__anext__()
    rest, calls = tool_filter.finish() if tool_filter else ("", [])
    if rest:
        await emit(rest)
    return item, calls
