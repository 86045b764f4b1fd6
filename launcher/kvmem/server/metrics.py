"""Prometheus text for ``/metrics``: request and token counters here, memory gauges from the engine."""
from __future__ import annotations

import collections
import re

from kvmem_core.contract import StepResult

_NAME = re.compile(r"[^a-zA-Z0-9_]")


class Metrics:
    """Counters the API process keeps; the engine's own numbers arrive with each step."""

    def __init__(self) -> None:
        self.requests: collections.Counter[tuple[str, int]] = collections.Counter()
        self.tokens: collections.Counter[str] = collections.Counter()
        self.timings: collections.Counter[str] = collections.Counter()
        self.steps = 0

    def observe_request(self, route: str, status: int) -> None:
        self.requests[(route, status)] += 1

    def observe_step(self, result: StepResult) -> None:
        self.steps += 1
        self.tokens["prompt"] += result.prompt_tokens
        self.tokens["cached"] += result.cached_tokens
        self.tokens["completion"] += result.completion_tokens
        for key, value in result.timings.items():
            if key.endswith("_s"):
                self.timings[key.removesuffix("_s")] += value

    def render(self, engine_metrics: dict[str, float], queue: int, restarts: int, up: bool) -> str:
        """The exposition text (format 0.0.4)."""
        lines = [
            *_family("kvmem_requests_total", "counter", "HTTP requests by route and status",
                     [(f'{{route="{r}",status="{s}"}}', n) for (r, s), n in sorted(self.requests.items())]),
            *_family("kvmem_tokens_total", "counter", "prompt, cached (prefix hits) and completion tokens",
                     [(f'{{kind="{k}"}}', self.tokens[k]) for k in ("prompt", "cached", "completion")]),
            *_family("kvmem_steps_total", "counter", "engine steps completed", [("", self.steps)]),
            *_family("kvmem_step_seconds_total", "counter", "time spent per step phase (selection, prefill, decode, ...)",
                     [(f'{{phase="{p}"}}', v) for p, v in sorted(self.timings.items())]),
            *_family("kvmem_queue_length", "gauge", "steps running or waiting", [("", queue)]),
            *_family("kvmem_engine_restarts_total", "counter", "engine process restarts", [("", restarts)]),
            *_family("kvmem_engine_up", "gauge", "1 when the engine is ready", [("", int(up))]),
        ]
        for name, value in sorted(engine_metrics.items()):
            lines += _family("kvmem_engine_" + _NAME.sub("_", name), "gauge", f"engine metric {name}", [("", value)])
        return "\n".join(lines) + "\n"


def _family(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *(f"{name}{labels} {_num(v)}" for labels, v in samples)]


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))
