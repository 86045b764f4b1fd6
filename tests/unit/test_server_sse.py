"""SSE framing."""

from __future__ import annotations

import json

from kvmem.server import sse


def test_frame_is_one_event_with_compact_json() -> None:
    assert sse.frame({"a": 1, "b": "x y"}) == b'data: {"a":1,"b":"x y"}\n\n'
    assert sse.frame({"type": "response.created"}, event="response.created") == (
        b'event: response.created\ndata: {"type":"response.created"}\n\n'
    )


def test_parse_inverts_frame_and_keeps_done() -> None:
    body = sse.frame({"x": "line\nbreak"}, event="e") + sse.frame({"y": 2}) + sse.DONE
    assert sse.parse(body) == [
        ("e", json.dumps({"x": "line\nbreak"}, separators=(",", ":"))),
        (None, '{"y":2}'),
        (None, "[DONE]"),
    ]
