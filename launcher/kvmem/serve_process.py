"""``kvmem serve`` as a child process on a free port: what the benchmarks and the end-to-end tests start.

The child gets its own ``KVMEM_RUN_DIR`` (pidfile and log there, away from the user's) and
counts as ready when ``/health`` answers with the child's own pid, so a server already on
the port is never mistaken for it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

from kvmem_core.errors import KVMemError


class ServeError(KVMemError):
    """The child server exited or did not become ready; the message ends with its log's tail."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Inside, SIGTERM raises KeyboardInterrupt as Ctrl-C does, so the ``with ServeProcess`` blocks it unwinds
    stop their servers (Python's default SIGTERM would leave them running). Main thread only."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class ServeProcess:
    """``python -m kvmem serve --port PORT ARGS``, logging to ``run_dir/serve-PORT.log``."""

    def __init__(
        self,
        run_dir: Path,
        args: Sequence[str],
        port: int | None = None,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.port = port or free_port()
        self.run_dir, self.cwd = run_dir, cwd
        self.args = ["--port", str(self.port), *args]
        self.env = {**os.environ, "KVMEM_RUN_DIR": str(run_dir), "PYTHONUNBUFFERED": "1", **(env or {})}
        self.log = run_dir / f"serve-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def argv(self) -> list[str]:
        return [sys.executable, "-m", "kvmem", "serve", *self.args]

    def start(self, timeout: float = 600) -> Self:
        """Start the child and wait until it is ready; on failure it is stopped and ServeError raised."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=self.cwd)
        try:
            self.wait_ready(timeout)
        except ServeError:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        """``/health``'s answer once the started child gives it; ServeError if it exits or ``timeout`` passes."""
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServeError(f"kvmem serve exited {self.proc.returncode}:\n{self._tail()}")
            try:
                body = self.health(timeout=2)
                if body.get("status") == "ok" and body.get("pid") == self.proc.pid:
                    return body
            except (OSError, ValueError):
                pass
            time.sleep(0.3)
        raise ServeError(f"kvmem serve was not ready in {timeout:.0f} s:\n{self._tail()}")

    def health(self, timeout: float = 5) -> dict[str, Any]:
        """The decoded ``/health`` answer, also while it is a 503 (``status`` then says why); raises
        OSError when nothing answers."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return json.loads(exc.read())

    def stop(self) -> None:
        """SIGTERM the child and wait for it (SIGKILL after 30 s); a no-op once it has exited."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
