"""Server-sent events: the framing both OpenAI streaming APIs use."""
from __future__ import annotations

import json
from typing import Any

from aiohttp import web

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
