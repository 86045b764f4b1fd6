"""Test helpers for the server: the app in-process, and ``kvmem serve`` as a live subprocess."""

from __future__ import annotations

import asyncio
import json
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer
from kvmem import protocol as P
from kvmem.serve_process import ServeProcess
from kvmem.server.app import build_app
from kvmem.server.engine_client import EngineClient
from kvmem.server.state import ServerState
from model_support import SMALL_MODEL

from kvmem_core.config import KVMemConfig

ROOT = Path(__file__).resolve().parents[1]


def error_of(body: bytes) -> dict[str, Any]:
    """The ``error`` object of an OpenAI error body, checked to hold exactly the four fields OpenAI sends."""
    data = json.loads(body)
    assert set(data) == {"error"} and set(data["error"]) == {"message", "type", "param", "code"}
    return data["error"]


class AppClient:
    """The app on a private event loop with a synchronous ``request``; the engine starts only if asked;
    ``state_fields`` go to ``ServerState``."""

    def __init__(
        self,
        api_key: str | None = None,
        ui_dir: Path | None = None,
        start_engine: bool = False,
        config: KVMemConfig | None = None,
        max_body_bytes: int = 4096,
        **state_fields: Any,
    ) -> None:
        self.loop = asyncio.new_event_loop()
        config = config or KVMemConfig()
        spec = P.EngineSpec(backend="llama.cpp", model=SMALL_MODEL, config=P.config_to_wire(config))
        self.engine = self.loop.run_until_complete(self._make_engine(spec))
        if start_engine:
            self.loop.run_until_complete(self.engine.start())
        state = ServerState(engine=self.engine, config=config, api_key=api_key, ui_dir=ui_dir, **state_fields)
        self.server = TestServer(build_app(state, max_body_bytes=max_body_bytes))
        self.loop.run_until_complete(self.server.start_server())

    @staticmethod
    async def _make_engine(spec: P.EngineSpec) -> EngineClient:
        return EngineClient(spec)

    def request(self, method: str, path: str, **kwargs: Any) -> tuple[int, dict[str, str], bytes]:
        async def go() -> tuple[int, dict[str, str], bytes]:
            async with aiohttp.ClientSession() as session:
                async with session.request(method, self.server.make_url(path), **kwargs) as resp:
                    return resp.status, dict(resp.headers), await resp.read()

        return self.loop.run_until_complete(go())

    def close(self) -> None:
        self.loop.run_until_complete(self.server.close())
        self.loop.run_until_complete(self.engine.close())
        self.loop.close()


def get_json(url: str, headers: dict[str, str] | None = None, timeout: float = 5) -> tuple[int, Any]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


class LiveServer(ServeProcess):
    """``python -m kvmem serve --model SMALL_MODEL`` on a free port, run from the repository root; ``run_dir``
    keeps its pidfile away from the user's. A ``--model`` in ``args`` comes later and wins."""

    def __init__(self, run_dir: Path, *args: str, port: int | None = None, env: dict[str, str] | None = None) -> None:
        super().__init__(run_dir, ("--model", SMALL_MODEL, *args), port=port, env=env, cwd=ROOT)

    def command(self, *extra: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run another ``kvmem serve`` with this server's flags plus ``extra`` and wait for it."""
        return subprocess.run(
            [*self.argv, *extra], env=self.env, capture_output=True, text=True, timeout=timeout, check=False, cwd=ROOT
        )


def exercise(base_url: str, api_key: str = "none") -> dict[str, Any]:
    """One client script for any KVMem server: chat, streamed chat, a stored Responses chain.

    Returns what it saw; raises AssertionError when the server breaks the API.
    """
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Name one planet."}]
    plain = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
    assert plain.choices[0].message.role == "assistant" and plain.choices[0].finish_reason in ("stop", "length")
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == plain.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert chunks[0].kvmem["workspace_id"] == chunks[-1].kvmem["workspace_id"]  # known from the first chunk on
    first = client.responses.create(model=model, input="Name one ocean.", max_output_tokens=6, temperature=0)
    second = client.responses.create(
        model=model, input="Another one?", previous_response_id=first.id, max_output_tokens=6, temperature=0
    )
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0
    return {"model": model, "chat": plain, "responses": (first, second)}
