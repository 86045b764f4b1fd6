"""Server-sent events: the framing both OpenAI streaming APIs use."""

from __future__ import annotations

import contextlib
import json
from typing import Any, AsyncIterator, Awaitable, Callable

from aiohttp import web

from kvmem.output_parser import OutputParser
from kvmem.tool_syntax import Item
from kvmem_core.contract import StepResult

DONE = b"data: [DONE]\n\n"


def frame(data: dict[str, Any], event: str | None = None) -> bytes:
    """One event: an optional ``event:`` line, one ``data:`` line of compact JSON, a blank line."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


async def open_stream(request: web.Request) -> web.StreamResponse:
    """Start an SSE response; the status is 200 from here on, so later errors travel as events."""
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
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


async def relay(
    gen: AsyncIterator[Any], first: Any, emit: Callable[[Item], Awaitable[Any]], parser: OutputParser | None = None
) -> StepResult:
    """Pass a step stream's text to ``emit`` until its ``StepResult``, and return that.

    ``first`` is the stream's first item (already awaited). With ``parser`` the text is
    split into reasoning, content and tool-call items as soon as each is certain; without
    it every piece is a content item.
    """
    async with contextlib.aclosing(gen):
        item = first
        while not isinstance(item, StepResult):
            for out in parser.feed(item) if parser else [("content", item)]:
                await emit(out)
            item = await gen.__anext__()
    for out in parser.finish() if parser else []:
        await emit(out)
    return item
