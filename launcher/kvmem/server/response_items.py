"""Responses output items, whole or streamed: reasoning, message text and function calls.

A streamed response opens each item when its first piece arrives and finishes it when
another kind of item starts or the answer ends, with the events the SDK's
``responses.stream()`` helper expects (``output_item.added`` / ``done`` around the
deltas; message text inside an ``output_text`` content part; reasoning as
``response.reasoning_text.delta`` / ``done``; a function call's arguments in one
``function_call_arguments.delta`` once the call is complete).
"""

from __future__ import annotations

import uuid
from typing import Any

from aiohttp import web

from kvmem.output_parser import Parsed
from kvmem.server import sse
from kvmem.tool_syntax import Item


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [output_text(text)] if status != "in_progress" else []
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def call_item(call: dict[str, Any]) -> dict[str, Any]:
    fn = call["function"]
    return {
        "id": "fc_" + call["id"].removeprefix("call_"),
        "type": "function_call",
        "call_id": call["id"],
        "name": fn["name"],
        "arguments": fn["arguments"],
        "status": "completed",
    }


def output_items(out: Parsed) -> list[dict[str, Any]]:
    """A whole answer's items: its reasoning, its message (also an empty one, unless the answer only calls
    functions) and its function calls."""
    items = [reasoning_item(new_id("rs"), out.reasoning, "completed")] if out.reasoning else []
    if out.content or not out.calls:
        items.append(message_item(new_id("msg"), out.content, "completed"))
    return items + [call_item(c) for c in out.calls]


class Events:
    """Writes Responses stream events with increasing ``sequence_number``."""

    def __init__(self, resp: web.StreamResponse) -> None:
        self.resp = resp
        self.seq = 0

    async def send(self, kind: str, **fields: Any) -> None:
        await self.resp.write(sse.frame({"type": kind, "sequence_number": self.seq, **fields}, event=kind))
        self.seq += 1


class OutputWriter:
    """Streams one answer's output items as the parser's items arrive (see the module docstring);
    ``parsed`` gathers the answer, ``close`` ends the last item and returns them all."""

    def __init__(self, ev: Events) -> None:
        self.ev = ev
        self.items: list[dict[str, Any]] = []  # finished, by output index
        self.parsed = Parsed()
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.text = ""

    async def write(self, item: Item) -> None:
        self.parsed.add(item)
        kind, value = item
        if kind == "call":
            await self._finish_open()
            await self._call(call_item(value))
            return
        kind = "message" if kind == "content" else "reasoning"
        if self.open is None or self.open["type"] != kind:
            await self._finish_open()
            await self._start(kind)
        self.text += value
        where = {"item_id": self.open["id"], "output_index": len(self.items), "content_index": 0}
        if kind == "message":
            await self.ev.send("response.output_text.delta", **where, delta=value, logprobs=[])
        else:
            await self.ev.send("response.reasoning_text.delta", **where, delta=value)

    async def close(self) -> list[dict[str, Any]]:
        await self._finish_open()
        if not any(item["type"] in ("message", "function_call") for item in self.items):
            await self._start("message")  # a response without calls has a message, be it empty
            await self._finish_open()
        return self.items

    async def _start(self, kind: str) -> None:
        if kind == "message":
            self.open = message_item(new_id("msg"), "", "in_progress")
        else:
            self.open = reasoning_item(new_id("rs"), "", "in_progress")
        self.text = ""
        await self.ev.send("response.output_item.added", output_index=len(self.items), item=self.open)
        if kind == "message":
            await self.ev.send(
                "response.content_part.added",
                item_id=self.open["id"],
                output_index=len(self.items),
                content_index=0,
                part=output_text(""),
            )

    async def _finish_open(self) -> None:
        item, self.open = self.open, None
        if item is None:
            return
        where = {"item_id": item["id"], "output_index": len(self.items), "content_index": 0}
        if item["type"] == "message":
            done = message_item(item["id"], self.text, "completed")
            await self.ev.send("response.output_text.done", **where, text=self.text, logprobs=[])
            await self.ev.send("response.content_part.done", **where, part=output_text(self.text))
        else:
            done = reasoning_item(item["id"], self.text, "completed")
            await self.ev.send("response.reasoning_text.done", **where, text=self.text)
        await self.ev.send("response.output_item.done", output_index=len(self.items), item=done)
        self.items.append(done)

    async def _call(self, item: dict[str, Any]) -> None:
        index = len(self.items)
        await self.ev.send(
            "response.output_item.added", output_index=index, item={**item, "arguments": "", "status": "in_progress"}
        )
        await self.ev.send(
            "response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=item["arguments"]
        )
        await self.ev.send(
            "response.function_call_arguments.done",
            item_id=item["id"],
            output_index=index,
            arguments=item["arguments"],
            name=item["name"],
        )
        await self.ev.send("response.output_item.done", output_index=index, item=item)
        self.items.append(item)
