"""The benchmark's side of the wire: a small JSON client for a KVMem server.

The bench talks to KVMem exactly as clients do (``/v1/chat/completions`` with a per-request
``kvmem`` object, ``/tokenize``, ``/v1/kvmem/workspaces``), so it measures the served system.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from kvmem_core.errors import KVMemError


class BenchError(KVMemError):
    """The server refused or failed a request the benchmark depends on."""


class ApiError(BenchError):
    """An HTTP error answer: ``status`` and the OpenAI error object."""

    def __init__(self, status: int, error: dict[str, Any]) -> None:
        super().__init__(f"HTTP {status}: {error.get('message', error)}")
        self.status, self.error = status, error


class Api:
    """JSON over HTTP to one KVMem server at ``url`` (no trailing slash)."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 900) -> None:
        self.url, self.timeout = url.rstrip("/"), timeout
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """The decoded JSON answer; raises ApiError on an HTTP error status."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers=self.headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                error = json.loads(raw).get("error") or {}
            except (ValueError, AttributeError):
                error = {"message": raw.decode(errors="replace")[:200]}
            raise ApiError(exc.code, error) from None

    def chat(self, messages: list[dict[str, Any]], kvmem: dict[str, Any] | None, max_tokens: int) -> dict[str, Any]:
        """One greedy chat completion, with ``kvmem`` overrides unless None (the server's defaults)."""
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
        return self.call("POST", "/v1/chat/completions", body if kvmem is None else {**body, "kvmem": kvmem})

    def count_tokens(self, text: str) -> int:
        return len(self.call("POST", "/tokenize", {"content": text})["tokens"]) if text else 0

    def model(self) -> str:
        return self.call("GET", "/v1/models")["data"][0]["id"]

    def delete_workspace(self, workspace_id: str) -> None:
        try:
            self.call("DELETE", f"/v1/kvmem/workspaces/{workspace_id}")
        except ApiError as exc:
            if exc.status != 404:
                raise
