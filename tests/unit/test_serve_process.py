"""``kvmem serve`` as a child process: a child that fails to start is reported with its log, and stopped."""
from __future__ import annotations

from pathlib import Path

import pytest
from kvmem.serve_process import ServeError, ServeProcess, free_port


def test_a_child_that_exits_raises_with_its_log_tail(tmp_path: Path) -> None:
    server = ServeProcess(tmp_path / "run", ["--kvmem-budget", "banana"])
    with pytest.raises(ServeError, match=r"kvmem serve exited 2:\n(.|\n)*banana"):
        server.start(timeout=60)
    assert server.proc is not None and server.proc.returncode == 2
    assert server.log == tmp_path / "run" / f"serve-{server.port}.log" and "banana" in server.log.read_text()
    assert server.argv[-4:] == ["--port", str(server.port), "--kvmem-budget", "banana"]


def test_ports_and_run_dirs_are_the_childs_own(tmp_path: Path) -> None:
    port = free_port()
    server = ServeProcess(tmp_path, ["--no-ui"], port=port, env={"KVMEM_RECENT_TOKENS": "384"})
    assert server.url == f"http://127.0.0.1:{port}" and server.env["KVMEM_RUN_DIR"] == str(tmp_path)
    assert server.env["KVMEM_RECENT_TOKENS"] == "384"
    server.stop()  # never started: nothing to stop
