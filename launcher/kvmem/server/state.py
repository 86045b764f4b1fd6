"""What every route shares: the engine client, the config, counters, stored responses."""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from aiohttp import web

from kvmem.server.engine_client import EngineClient
from kvmem.server.errors import APIError, engine_unavailable
from kvmem.server.metrics import Metrics, StepClock
from kvmem.server.replicas import ReplicaSet
from kvmem.server.security import Security
from kvmem_core.config import KVMemConfig
from kvmem_core.contract import StepRequest, StepResult

log = logging.getLogger("kvmem.server")


class ResponseStore:
    """Stored Responses (``store: true``) with the transcript each one ends, for ``previous_response_id``:
    the newest ``capacity`` are kept. In an SQLite file when given a path (so they outlive a restart,
    as the workspaces' KV on the NVMe tier does), in memory otherwise. A file SQLite cannot read is
    moved aside (``.corrupt``) and a new one started."""

    def __init__(self, path: Path | None = None, capacity: int = 1024) -> None:
        self.capacity = capacity
        try:
            self.db = self._open(path)
        except sqlite3.DatabaseError as e:
            log.error("stored responses in %s are unreadable (%s); moved aside, starting empty", path, e)
            path.replace(path.with_suffix(".corrupt"))
            self.db = self._open(path)

    @staticmethod
    def _open(path: Path | None) -> sqlite3.Connection:
        if path:
            path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(str(path) if path else ":memory:", isolation_level=None)  # autocommit
        db.execute(
            "CREATE TABLE IF NOT EXISTS responses (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE,"
            " body TEXT NOT NULL)"
        )
        return db

    def put(self, response_id: str, response: dict[str, Any], transcript: list[dict[str, Any]]) -> None:
        """Keep a response and the full transcript (messages after it ran) for chaining."""
        body = json.dumps({"response": response, "transcript": transcript})
        self.db.execute("INSERT OR REPLACE INTO responses (id, body) VALUES (?, ?)", (response_id, body))
        self.db.execute("DELETE FROM responses WHERE seq <= (SELECT MAX(seq) FROM responses) - ?", (self.capacity,))

    def get(self, response_id: str) -> dict[str, Any] | None:
        row = self.db.execute("SELECT body FROM responses WHERE id = ?", (response_id,)).fetchone()
        return json.loads(row[0]) if row else None

    def delete(self, response_id: str) -> bool:
        """Forget a stored response; False if there was none."""
        return self.db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0


@dataclass
class ServerState:
    """Mutable server-wide state; one per app."""

    engine: EngineClient | ReplicaSet
    config: KVMemConfig
    api_key: str | None = None
    ui_dir: Path | None = None
    fingerprint: str = ""
    metrics: Metrics = field(default_factory=Metrics)
    responses: ResponseStore = field(default_factory=ResponseStore)
    security: Security = field(default_factory=Security)
    model_names: tuple[str, ...] = ()  # --served-model-name
    max_tokens_default: int | None = None  # --max-tokens-default (None: room left, at most the trained context)

    def __post_init__(self) -> None:
        self.metrics.watch(self.engine)

    def served_names(self) -> list[str]:
        """What ``/v1/models`` lists and ``model`` may name: the ``--served-model-name`` aliases, then the
        engine's own model id (once it is loaded)."""
        names = list(self.model_names)
        if self.engine.model_id and self.engine.model_id not in names:
            names.append(self.engine.model_id)
        return names

    def served_model(self, requested: str | None) -> str:
        """The name a reply carries: ``requested`` when it is a served name, the first one when it is empty;
        503 while the engine is still loading, 404 if ``requested`` names another model."""
        if not self.engine.model_id:
            raise engine_unavailable(f"the engine is {self.engine.state}")
        names = self.served_names()
        if not requested:
            return names[0]
        if requested not in names:
            raise APIError(
                404,
                f"model {requested!r} is not served here; this server serves {', '.join(map(repr, names))}",
                "model_not_found",
                "model",
            )
        return requested

    async def stream(
        self, step: StepRequest, on_start: Callable[[str], None] | None = None
    ) -> AsyncIterator[str | StepResult]:
        """The engine's pieces and result for ``step``, counted and timed in the metrics; ``on_start`` gets
        the workspace id before the first piece."""
        clock = StepClock()

        def started(workspace_id: str) -> None:
            clock.start()
            if on_start is not None:
                on_start(workspace_id)

        async with contextlib.aclosing(self.engine.generate(step, started)) as gen:
            async for item in gen:
                if isinstance(item, StepResult):
                    self.metrics.observe_step(item, clock)
                else:
                    clock.text()
                yield item

    async def run(self, step: StepRequest) -> StepResult:
        """Run ``step`` to its end and return its result."""
        async with contextlib.aclosing(self.stream(step)) as gen:
            async for item in gen:
                if isinstance(item, StepResult):
                    return item
        raise AssertionError("engine stream ended without a result")


STATE = web.AppKey("kvmem_state", ServerState)
