"""The aiohttp application: routes, auth, error mapping, static web UI, and ``serve``.

Every request first passes ``security``'s Host, Origin and Content-Type checks. Every API
route needs the bearer key when one is set (``Authorization: Bearer KEY`` or
``X-Api-Key: KEY``); ``/health`` and the web UI's static files never do. Every failure
leaves through ``errors.error_response``, so clients always get the OpenAI error JSON.
"""

from __future__ import annotations

import asyncio
import hmac
import importlib.resources
import logging
import os
import signal
import time
from pathlib import Path
from typing import Awaitable, Callable

from aiohttp import web

import kvmem
from kvmem.server import chat, messages, responses, workspaces
from kvmem.server import schemas as S
from kvmem.server.errors import APIError, error_response
from kvmem.server.metrics import CONTENT_TYPE
from kvmem.server.replicas import ReplicaSet
from kvmem.server.security import API_PREFIXES, cors_hook, security_middleware
from kvmem.server.state import STATE, ServerState

log = logging.getLogger("kvmem.server")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
BODY_FLOOR = 8 << 20  # the body limit before an engine reports its workspace size, and the least after
# a transcript token's most bytes in a request body, rounded up: 11.9 measured for Chinese text in a tool call's
# arguments JSON-escaped twice (``ensure_ascii``), 10.2 as a message's content, 4.1-4.4 for code, 3.2 for prose
BODY_BYTES_PER_TOKEN = 16


def installed_ui_dir() -> Path | None:
    """The web UI's folder: the package ``kvmem_webui`` (webui/ of the checkout in an editable install);
    None when it is not installed."""
    try:
        return Path(str(importlib.resources.files("kvmem_webui")))
    except ModuleNotFoundError:
        return None


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn any exception into the error JSON and count every request."""
    try:
        resp = await handler(request)
    except Exception as exc:
        resp = messages.error_response(exc) if request.path.startswith("/v1/messages") else error_response(exc)
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "unmatched"
    request.app[STATE].metrics.observe_request(route, resp.status)
    return resp


def body_limit_middleware(fixed: int | None) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """Bodies up to ``fixed`` bytes (``--max-body-mb``), or, with None, up to what a transcript as long as the
    engine's workspace takes (``body_limit``): a 1M-token conversation is 3-12 MB of JSON."""

    @web.middleware
    async def limited(request: web.Request, handler: Handler) -> web.StreamResponse:
        limit = fixed if fixed is not None else body_limit(request.app[STATE].engine.ctx)
        return await handler(request.clone(client_max_size=limit))

    return limited


def body_limit(ctx: int | None) -> int:
    """The body limit for a workspace of ``ctx`` tokens (None: not known yet): ``BODY_BYTES_PER_TOKEN`` a token, at
    least ``BODY_FLOOR``."""
    return max(BODY_FLOOR, (ctx or 0) * BODY_BYTES_PER_TOKEN)


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    key = request.app[STATE].api_key
    if key and request.path.startswith(API_PREFIXES) and not _authorized(request, key):
        raise APIError(401, "missing or wrong API key (send Authorization: Bearer KEY)", "invalid_api_key")
    return await handler(request)


def _authorized(request: web.Request, key: str) -> bool:
    auth = request.headers.get("Authorization", "")
    given = auth[7:] if auth[:7].lower() == "bearer " else request.headers.get("X-Api-Key", "")
    return hmac.compare_digest(given.strip().encode(), key.encode())


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = state.engine
    body = {
        "status": "ok" if engine.state == "ready" else engine.state,
        "model": engine.model_id,
        "fingerprint": state.fingerprint,
        "pid": os.getpid(),
        "engine_pid": engine.pid,
        "version": kvmem.__version__,
    }
    if isinstance(engine, ReplicaSet):
        body["replicas"] = engine.describe()
    return web.json_response(body, status=200 if engine.state == "ready" else 503)


async def models(request: web.Request) -> web.Response:
    names = request.app[STATE].served_names()
    return web.json_response(
        {
            "object": "list",
            "data": [{"id": name, "object": "model", "created": 0, "owned_by": "kvmem"} for name in names],
        }
    )


async def tokenize(request: web.Request) -> web.Response:
    body = await chat.read_body(request, S.TokenizeRequest)
    return web.json_response({"tokens": await request.app[STATE].engine.call("tokenize", body.content)})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE, "X-Content-Type-Options": "nosniff"})


async def openapi(request: web.Request) -> web.Response:
    post = {
        "/v1/chat/completions": "ChatRequest",
        "/v1/completions": "CompletionRequest",
        "/v1/responses": "ResponsesRequest",
        "/tokenize": "TokenizeRequest",
        "/v1/tokenize": "TokenizeRequest",
        "/v1/messages": "MessagesRequest",
        "/v1/messages/count_tokens": "CountTokensRequest",
    }
    paths = {
        path: {
            "post": {
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}},
                },
                "responses": {"200": {"description": "OK"}},
            }
        }
        for path, name in post.items()
    }
    return web.json_response(
        {
            "openapi": "3.1.0",
            "info": {"title": "KVMem", "version": kvmem.__version__},
            "paths": paths,
            "components": {"schemas": S.openapi_components()},
        }
    )


async def static_ui(request: web.Request) -> web.StreamResponse:
    """Files of the web UI; ``/`` is its index.html. Nothing outside the UI folder is served."""
    ui_dir = request.app[STATE].ui_dir
    tail = request.match_info["tail"] or "index.html"
    if ui_dir is None or request.path.startswith(API_PREFIXES):
        raise APIError(404, f"no route {request.path}", "not_found")
    root = ui_dir.resolve()
    path = (root / tail).resolve()
    if not path.is_relative_to(root) or not path.is_file():
        raise APIError(404, f"no file {request.path}", "not_found")
    return web.FileResponse(path)


def build_app(state: ServerState, max_body_bytes: int | None = None) -> web.Application:
    """The application for ``state``; the engine client must be started separately. ``max_body_bytes``: the largest
    request body (None: as the engine's workspace needs, ``body_limit``)."""
    app = web.Application(
        middlewares=[
            errors_middleware,
            body_limit_middleware(max_body_bytes),
            security_middleware(state.security),
            auth_middleware,
        ]
    )
    app.on_response_prepare.append(cors_hook(state.security))
    app[STATE] = state
    r = app.router
    r.add_get("/health", health)
    r.add_get("/v1/models", models)
    r.add_post("/tokenize", tokenize)
    r.add_post("/v1/tokenize", tokenize)
    r.add_get("/metrics", metrics)
    r.add_get("/openapi.json", openapi)
    r.add_post("/v1/chat/completions", chat.chat_completions)
    r.add_post("/v1/completions", chat.completions)
    r.add_post("/v1/responses", responses.create_response)
    r.add_get("/v1/responses/{response_id}", responses.get_response)
    r.add_delete("/v1/responses/{response_id}", responses.delete_response)
    r.add_post("/v1/messages", messages.create_message)
    r.add_post("/v1/messages/count_tokens", messages.count_tokens)
    workspaces.add_routes(r)
    r.add_get("/{tail:.*}", static_ui)
    return app


async def serve(
    state: ServerState, host: str, port: int, on_ready: Callable[[], None], max_body_bytes: int | None = None
) -> None:
    """Bind, start the engine, call ``on_ready``, and serve until SIGINT/SIGTERM."""
    runner = web.AppRunner(build_app(state, max_body_bytes), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    started = time.monotonic()
    try:
        await state.engine.start()
        log.info("engine loaded in %.1f s", time.monotonic() - started)
        on_ready()
        await stop.wait()
    finally:
        await state.engine.close()
        await runner.cleanup()
