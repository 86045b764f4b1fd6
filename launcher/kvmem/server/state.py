"""What every route shares: the engine client, the config, counters, stored responses."""
from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

from aiohttp import web

from kvmem.server.convert import check_model
from kvmem.server.engine_client import EngineClient
from kvmem.server.errors import engine_unavailable
from kvmem.server.metrics import Metrics
from kvmem_core.config import KVMemConfig
from kvmem_core.contract import StepRequest, StepResult


class ResponseStore:
    """Stored Responses (``store: true``), newest kept, oldest dropped past ``capacity``."""

    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self._items: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()

    def put(self, response_id: str, response: dict[str, Any], transcript: list[dict[str, Any]]) -> None:
        """Keep a response and the full transcript (messages after it ran) for chaining."""
        self._items[response_id] = {"response": response, "transcript": transcript}
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> dict[str, Any] | None:
        return self._items.get(response_id)


@dataclass
class ServerState:
    """Mutable server-wide state; one per app."""

    engine: EngineClient
    config: KVMemConfig
    api_key: str | None = None
    ui_dir: Path | None = None
    fingerprint: str = ""
    metrics: Metrics = field(default_factory=Metrics)
    responses: ResponseStore = field(default_factory=ResponseStore)

    def served_model(self, requested: str | None) -> str:
        """The served model id; 503 while the engine is still loading, 404 if ``requested`` names another model."""
        model_id = self.engine.model_id
        if not model_id:
            raise engine_unavailable(f"the engine is {self.engine.state}")
        check_model(requested, model_id)
        return model_id

    async def stream(self, step: StepRequest) -> AsyncIterator[str | StepResult]:
        """The engine's pieces and result for ``step``, counted in the metrics."""
        async with contextlib.aclosing(self.engine.generate(step)) as gen:
            async for item in gen:
                if isinstance(item, StepResult):
                    self.metrics.observe_step(item)
                yield item

    async def run(self, step: StepRequest) -> StepResult:
        """Run ``step`` to its end and return its result."""
        async with contextlib.aclosing(self.stream(step)) as gen:
            async for item in gen:
                if isinstance(item, StepResult):
                    return item
        raise AssertionError("engine stream ended without a result")


STATE = web.AppKey("kvmem_state", ServerState)
