"""``/metrics`` through ``prometheus_client``: request, token and step counters, latency histograms,
and the engine's own numbers as gauges.

Each ``Metrics`` has its own registry (several apps may live in one process, as in tests). The
latencies are seen from the API process: queue time runs from the request until the engine
starts the step, time to first token from the request until its first text, step time from
the step's start until its result.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvmem_core.contract import StepResult

if TYPE_CHECKING:
    from kvmem.server.engine_client import EngineClient
    from kvmem.server.replicas import ReplicaSet

CONTENT_TYPE = CONTENT_TYPE_LATEST
TOKEN_KINDS = ("prompt", "cached", "completion")
# a step on a CPU model takes seconds to minutes, on a GPU tens of milliseconds
BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_NAME = re.compile(r"[^a-zA-Z0-9_]")


@dataclass
class StepClock:
    """When a step was asked for, started in the engine and produced its first text (``time.monotonic``)."""

    asked: float = field(default_factory=time.monotonic)
    started: float | None = None
    first_text: float | None = None

    def start(self) -> None:
        self.started = time.monotonic()

    def text(self) -> None:
        if self.first_text is None:
            self.first_text = time.monotonic()


class Metrics:
    """The API process's counters and histograms; ``watch`` adds an engine's gauges at scrape time."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvmem_requests", "HTTP requests by route and status", ["route", "status"], registry=r)
        self.tokens = Counter(
            "kvmem_tokens", "prompt, cached (prefix hits) and completion tokens", ["kind"], registry=r
        )
        for kind in TOKEN_KINDS:
            self.tokens.labels(kind)
        self.steps = Counter("kvmem_steps", "engine steps completed", registry=r)
        self.phases = Counter(
            "kvmem_step_seconds", "time spent per step phase (selection, prefill, decode, ...)", ["phase"], registry=r
        )
        self.queue_time = Histogram(
            "kvmem_queue_time_seconds",
            "wait from the request until the engine starts its step",
            buckets=BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "kvmem_time_to_first_token_seconds", "from the request until its first text", buckets=BUCKETS, registry=r
        )
        self.step_time = Histogram(
            "kvmem_step_duration_seconds",
            "from the step's start in the engine until its result",
            buckets=BUCKETS,
            registry=r,
        )

    def watch(self, engine: EngineClient | ReplicaSet) -> None:
        """Report ``engine``'s queue, restarts, readiness and own metrics with every scrape."""
        self.registry.register(_EngineCollector(engine))

    def observe_request(self, route: str, status: int) -> None:
        self.requests.labels(route, str(status)).inc()

    def observe_step(self, result: StepResult, clock: StepClock) -> None:
        """Count a finished step's tokens and phases, and its latencies as ``clock`` saw them."""
        self.steps.inc()
        self.tokens.labels("prompt").inc(result.prompt_tokens)
        self.tokens.labels("cached").inc(result.cached_tokens)
        self.tokens.labels("completion").inc(result.completion_tokens)
        for key, value in result.timings.items():
            if key.endswith("_s"):
                self.phases.labels(key.removesuffix("_s")).inc(value)
        if clock.started is not None:
            self.queue_time.observe(clock.started - clock.asked)
            self.step_time.observe(time.monotonic() - clock.started)
        if clock.first_text is not None:
            self.ttft.observe(clock.first_text - clock.asked)

    def render(self) -> bytes:
        """The exposition text, of media type ``CONTENT_TYPE``."""
        return generate_latest(self.registry)


class _EngineCollector:
    """The engine client's state, read when ``/metrics`` is scraped."""

    def __init__(self, engine: EngineClient | ReplicaSet) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        engine = self.engine
        yield GaugeMetricFamily("kvmem_queue_length", "steps running or waiting", value=engine.busy)
        yield CounterMetricFamily("kvmem_engine_restarts", "engine process restarts", value=engine.restarts)
        yield GaugeMetricFamily("kvmem_engine_up", "1 when the engine is ready", value=int(engine.state == "ready"))
        for name, value in sorted(engine.metrics.items()):
            yield GaugeMetricFamily("kvmem_engine_" + _NAME.sub("_", name), f"engine metric {name}", value=value)
