"""The benchmark's side of the wire: a small JSON client, and ``kvmem serve`` as a child process.

The bench talks to KVMem exactly as clients do (``/v1/chat/completions`` with a per-request
``kvmem`` object, ``/tokenize``, ``/v1/kvmem/workspaces``), so it measures the served system.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Self

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

    def chat(self, messages: list[dict[str, Any]], kvmem: dict[str, Any], max_tokens: int) -> dict[str, Any]:
        """One greedy chat completion with ``kvmem`` overrides."""
        return self.call("POST", "/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens,
                                                          "temperature": 0, "kvmem": kvmem})

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """``python -m kvmem serve`` on a free port, its log and pidfile under ``run_dir``."""

    def __init__(self, run_dir: Path, args: list[str]) -> None:
        self.port = free_port()
        self.run_dir = run_dir
        self.log_path = run_dir / "serve.log"
        self.argv = [sys.executable, "-m", "kvmem", "serve", "--port", str(self.port), "--no-ui", *args]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 600) -> ServeProcess:
        """Start the server and wait until ``/health`` answers ok from this process."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "KVMEM_RUN_DIR": str(self.run_dir), "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"kvmem serve exited {self.proc.returncode}; see {self.log_path}")
            if self._healthy():
                return self
            time.sleep(0.5)
        self.stop()
        raise BenchError(f"kvmem serve was not ready in {timeout:.0f} s; see {self.log_path}")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                return json.loads(resp.read()).get("pid") == self.proc.pid
        except (OSError, ValueError):
            return False

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
