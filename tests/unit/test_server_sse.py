"""SSE framing and the Prometheus text."""
from __future__ import annotations

import json

from kvmem.server import sse
from kvmem.server.metrics import Metrics
from kvmem_core.contract import StepResult


def test_frame_is_one_event_with_compact_json() -> None:
    assert sse.frame({"a": 1, "b": "x y"}) == b'data: {"a":1,"b":"x y"}\n\n'
    assert sse.frame({"type": "response.created"}, event="response.created") == (
        b'event: response.created\ndata: {"type":"response.created"}\n\n')


def test_parse_inverts_frame_and_keeps_done() -> None:
    body = sse.frame({"x": "line\nbreak"}, event="e") + sse.frame({"y": 2}) + sse.DONE
    assert sse.parse(body) == [("e", json.dumps({"x": "line\nbreak"}, separators=(",", ":"))), (None, '{"y":2}'), (None, "[DONE]")]


def test_metrics_render_counts_steps_and_engine_gauges() -> None:
    m = Metrics()
    m.observe_request("/v1/chat/completions", 200)
    m.observe_request("/v1/chat/completions", 200)
    m.observe_step(StepResult("t", (1, 2), "stop", 30, 12, "w", {}, {"select_s": 0.25, "prefill_tokens": 30}))
    text = m.render({"blocks.host": 4, "bytes_nvme": 1.5e9}, queue=2, restarts=1, up=True)
    lines = set(text.splitlines())
    assert 'kvmem_requests_total{route="/v1/chat/completions",status="200"} 2' in lines
    assert 'kvmem_tokens_total{kind="prompt"} 30' in lines
    assert 'kvmem_tokens_total{kind="cached"} 12' in lines
    assert 'kvmem_tokens_total{kind="completion"} 2' in lines
    assert 'kvmem_step_seconds_total{phase="select"} 0.25' in lines
    assert not any("prefill_tokens" in ln for ln in lines)
    assert "kvmem_queue_length 2" in lines and "kvmem_engine_up 1" in lines
    assert "kvmem_engine_blocks_host 4" in lines and "kvmem_engine_bytes_nvme 1500000000" in lines
    assert all(ln.startswith("#") or " " in ln for ln in lines if ln)
