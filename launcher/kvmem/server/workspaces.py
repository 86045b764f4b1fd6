"""``/v1/kvmem/workspaces``: list, inspect, delete, pin, export and import the engine's workspaces.

Export and import move one portable file (``kvmem_core.portable``) between servers that run
the same model: the engine writes or reads it in a temporary folder of this machine, and the
file streams to or from the client in pieces, so its size is bounded by the store, not by
``--max-body-mb``.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

from aiohttp import web

from kvmem.server.errors import APIError
from kvmem.server.state import STATE
from kvmem_core.config import GIB, KVMemConfig

CHUNK = 1 << 20


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_get("/v1/kvmem/workspaces", list_workspaces)
    router.add_post("/v1/kvmem/workspaces/import", import_workspace)
    router.add_get("/v1/kvmem/workspaces/{workspace_id}", workspace_info)
    router.add_delete("/v1/kvmem/workspaces/{workspace_id}", delete_workspace)
    router.add_post("/v1/kvmem/workspaces/{workspace_id}/pin", pin_workspace)
    router.add_delete("/v1/kvmem/workspaces/{workspace_id}/pin", unpin_workspace)
    router.add_get("/v1/kvmem/workspaces/{workspace_id}/export", export_workspace)


def not_found(ws_id: str) -> APIError:
    return APIError(404, f"workspace {ws_id!r} not found", "workspace_not_found")


async def list_workspaces(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": await request.app[STATE].engine.call("list_workspaces")})


async def workspace_info(request: web.Request) -> web.Response:
    ws_id = request.match_info["workspace_id"]
    info = await request.app[STATE].engine.call("workspace_info", ws_id)
    if info is None:
        raise not_found(ws_id)
    return web.json_response(info)


async def delete_workspace(request: web.Request) -> web.Response:
    ws_id = request.match_info["workspace_id"]
    if not await request.app[STATE].engine.call("delete_workspace", ws_id):
        raise not_found(ws_id)
    return web.json_response({"id": ws_id, "object": "kvmem.workspace.deleted", "deleted": True})


async def pin_workspace(request: web.Request) -> web.Response:
    """Pinned: retention never evicts the workspace (``DELETE`` still does)."""
    return await _set_pin(request, "pin_workspace")


async def unpin_workspace(request: web.Request) -> web.Response:
    return await _set_pin(request, "unpin_workspace")


async def _set_pin(request: web.Request, op: str) -> web.Response:
    ws_id = request.match_info["workspace_id"]
    summary = await request.app[STATE].engine.call(op, ws_id)
    if summary is None:
        raise not_found(ws_id)
    return web.json_response(workspace_object(summary))


async def export_workspace(request: web.Request) -> web.StreamResponse:
    """The workspace as one file (``application/x-tar``) to import on a server running the same model."""
    ws_id = request.match_info["workspace_id"]
    with tempfile.TemporaryDirectory(prefix="kvmem-export-") as tmp:
        path = Path(tmp) / "workspace.tar"
        if await request.app[STATE].engine.call("export_workspace", ws_id, path=str(path)) is None:
            raise not_found(ws_id)
        resp = web.StreamResponse(
            headers={
                "Content-Type": "application/x-tar",
                "Content-Length": str(path.stat().st_size),
                "Content-Disposition": f'attachment; filename="{ws_id}.kvmem.tar"',
            }
        )
        await resp.prepare(request)
        with open(path, "rb") as f:
            while chunk := await asyncio.to_thread(f.read, CHUNK):
                await resp.write(chunk)
        await resp.write_eof()
        return resp


async def import_workspace(request: web.Request) -> web.Response:
    """Add the workspace an exported file holds (the body, ``application/x-tar``); 201 with its summary."""
    state = request.app[STATE]
    with tempfile.TemporaryDirectory(prefix="kvmem-import-") as tmp:
        path = Path(tmp) / "workspace.tar"
        await receive_file(request, path, store_bytes(state.config))
        summary = await state.engine.call("import_workspace", path=str(path))
    return web.json_response(workspace_object(summary), status=201)


async def receive_file(request: web.Request, path: Path, limit: int) -> None:
    """Write the request body to ``path`` as it arrives; 413 past ``limit`` bytes."""
    size = 0
    with open(path, "wb") as f:
        async for chunk in request.content.iter_chunked(CHUNK):
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"the workspace file is larger than the store ({limit} bytes)", "body_too_large")
            await asyncio.to_thread(f.write, chunk)


def store_bytes(config: KVMemConfig) -> int:
    """What the store can hold: no workspace file larger than that can be imported."""
    return int((config.nvme_gb if config.nvme_dir else config.cpu_gb) * GIB)


def workspace_object(summary: dict[str, Any]) -> dict[str, Any]:
    return {"object": "kvmem.workspace", **summary}
