"""A recording proxy between a client library and a live server: it forwards every request unchanged and checks
every reply of the OpenAI routes, whole or streamed, against the openai SDK's own types (``sdk_types``), so a test
driving a framework sees protocol errors the framework itself would smooth over or swallow."""

from __future__ import annotations

import asyncio
import json
import threading

import aiohttp
from aiohttp import web
from sdk_types import check_body, check_event, checked_routes

_HOP = {"host", "content-length", "transfer-encoding", "connection", "accept-encoding"}


class WireTap:
    """Listens on ``url`` and forwards to ``upstream``; ``problems`` lists each reply that broke the protocol
    (a non-2xx status or a body or event the SDK's types refuse), ``seen`` counts the replies checked per route."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.problems: list[str] = []
        self.seen: dict[str, int] = {}
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)

    async def _start(self) -> str:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600), auto_decompress=False)
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{port}"

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        async with self.session.request(
            request.method, self.upstream + request.path_qs, data=body, headers=headers
        ) as up:
            resp = web.StreamResponse(status=up.status, headers={"Content-Type": up.headers.get("Content-Type", "")})
            await resp.prepare(request)
            captured = b""
            async for chunk in up.content.iter_any():
                captured += chunk
                await resp.write(chunk)
            # checked before the reply ends: a client that has its whole reply may read ``seen`` at once
            self._check(request.path, body, up.status, captured)
            await resp.write_eof()
        return resp

    def _check(self, path: str, request: bytes, status: int, reply: bytes) -> None:
        if path not in checked_routes():
            return
        self.seen[path] = self.seen.get(path, 0) + 1
        if status != 200:
            self.problems.append(f"{path}: {status} {reply[:300]!r} for {request[:300]!r}")
            return
        try:
            if json.loads(request).get("stream"):
                for line in reply.decode().splitlines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        data = json.loads(line[6:])
                        if data.get("type") == "error" or ("error" in data and "choices" not in data):
                            raise ValueError(f"an error event: {data}")
                        check_event(path, data)
            else:
                check_body(path, json.loads(reply))
        except Exception as exc:  # any refusal by the SDK's types is the server's protocol error
            self.problems.append(f"{path}: {type(exc).__name__}: {str(exc)[:600]}")

    def close(self) -> None:
        async def stop() -> None:
            await self.session.close()
            await self.runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
