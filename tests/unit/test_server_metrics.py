"""``/metrics`` read back with prometheus_client's own text parser: counters, histograms, engine gauges."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable, Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families
from serving import AppClient

from kvmem.server.state import STATE
from kvmem_core.contract import StepRequest, StepResult

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(client: AppClient) -> tuple[dict[str, str], Samples]:
    """Family name -> type, and every sample by name and labels."""
    status, headers, body = client.request("GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=")
    types: dict[str, str] = {}
    samples: Samples = {}
    for family in text_string_to_metric_families(body.decode()):
        types[family.name] = family.type
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return types, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


@pytest.fixture()
def client() -> Iterator[AppClient]:
    c = AppClient()
    yield c
    c.close()


def fake_generate(texts: list[str], result: StepResult) -> Callable[..., AsyncIterator[str | StepResult]]:
    """An engine that starts the step, streams ``texts`` a little apart, then returns ``result``."""

    async def generate(
        step: StepRequest, on_start: Callable[[str], None] | None = None
    ) -> AsyncIterator[str | StepResult]:
        await asyncio.sleep(0.02)  # queued
        if on_start is not None:
            on_start(result.workspace_id)
        for text in texts:
            await asyncio.sleep(0.01)
            yield text
        yield result

    return generate


def run_step(client: AppClient, result: StepResult) -> None:
    state = client.server.app[STATE]
    client.engine.generate = fake_generate(["Par", "is"], result)

    async def drain() -> None:
        async for _ in state.stream(StepRequest(prompt="x")):
            pass

    client.loop.run_until_complete(drain())


def test_requests_are_counters_by_route_and_status(client: AppClient) -> None:
    client.request("GET", "/v1/models")
    client.request("GET", "/v1/models")
    client.request("GET", "/v1/nothing")
    types, samples = scrape(client)
    assert types["kvmem_requests"] == "counter"
    assert value(samples, "kvmem_requests_total", route="/v1/models", status="200") == 2
    assert value(samples, "kvmem_requests_total", route="/{tail}", status="404") == 1


def test_a_step_feeds_token_counters_and_latency_histograms(client: AppClient) -> None:
    result = StepResult(
        "Paris", (1, 2), "stop", 30, 12, "w1", {}, {"select_s": 0.25, "decode_s": 0.5, "prefill_tokens": 30}
    )
    run_step(client, result)
    types, samples = scrape(client)
    assert value(samples, "kvmem_steps_total") == 1
    assert [value(samples, "kvmem_tokens_total", kind=k) for k in ("prompt", "cached", "completion")] == [30, 12, 2]
    assert (
        types["kvmem_step_seconds"] == "counter" and value(samples, "kvmem_step_seconds_total", phase="select") == 0.25
    )
    assert not any("prefill_tokens" in str(key) for key in samples)
    for name in ("kvmem_queue_time_seconds", "kvmem_time_to_first_token_seconds", "kvmem_step_duration_seconds"):
        assert types[name] == "histogram"
        assert value(samples, name + "_count") == 1 and value(samples, name + "_bucket", le="+Inf") == 1
    queue = value(samples, "kvmem_queue_time_seconds_sum")
    ttft = value(samples, "kvmem_time_to_first_token_seconds_sum")
    assert 0.02 <= queue < ttft  # the first text comes after the step started, which comes after the wait
    assert value(samples, "kvmem_step_duration_seconds_sum") >= 0.02  # two pieces 10 ms apart


def test_engine_state_is_read_at_scrape_time(client: AppClient) -> None:
    _, samples = scrape(client)
    assert value(samples, "kvmem_engine_up") == 0 and value(samples, "kvmem_queue_length") == 0
    client.engine.metrics = {"blocks.host": 4, "bytes_nvme": 1.5e9}
    client.engine.restarts = 1
    types, samples = scrape(client)
    assert types["kvmem_engine_restarts"] == "counter" and value(samples, "kvmem_engine_restarts_total") == 1
    assert types["kvmem_engine_blocks_host"] == "gauge" and value(samples, "kvmem_engine_blocks_host") == 4
    assert value(samples, "kvmem_engine_bytes_nvme") == 1.5e9
    assert [value(samples, "kvmem_tokens_total", kind=k) for k in ("prompt", "cached", "completion")] == [0, 0, 0]
