"""``kvmem serve`` as a child process: a child that fails to start is reported with its log, and stopped."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from kvmem.serve_process import ServeError, ServeProcess, free_port
from kvmem_core.config import KVMemConfig


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


PARENT = """
import subprocess, sys, time
from kvmem.serve_process import sigterm_as_interrupt
with sigterm_as_interrupt():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        print(child.pid, flush=True)
        time.sleep(120)
    finally:
        child.terminate()
        child.wait()
"""


def test_sigterm_unwinds_like_ctrl_c_so_children_are_stopped() -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    parent.send_signal(signal.SIGTERM)
    _, err = parent.communicate(timeout=30)
    assert "KeyboardInterrupt" in err
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)  # still there (or a zombie not yet reaped by init)
        except ProcessLookupError:
            return
        if open(f"/proc/{child}/stat").read().split()[2] == "Z":
            return
        time.sleep(0.1)
    raise AssertionError("the child outlived its parent's SIGTERM")


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (
            (),  # the auto host tier: half of this machine's memory
            "conversations are kept in host RAM only (up to AUTO GiB) and a restart loses them; "
            "--kvmem-nvme-dir DIR keeps them on disk",
        ),
        (
            ("--kvmem-cpu-gb", "4"),
            "conversations are kept in host RAM only (up to 4 GiB) and a restart loses them; "
            "--kvmem-nvme-dir DIR keeps them on disk",
        ),
        (
            ("--kvmem-nvme-dir", "NVME", "--kvmem-nvme-gb", "8"),
            "conversations survive a restart: their KV and workspaces are kept in NVME (up to 8 GiB, --kvmem-nvme-gb)",
        ),
    ],
)
def test_serve_says_whether_conversations_survive_a_restart(tmp_path: Path, flags: tuple[str, ...], says: str) -> None:
    """``serve`` prints this line at start, before loading; ``--dry-run`` shows it among the settings."""
    flags = tuple(str(tmp_path / "nvme") if f == "NVME" else f for f in flags)
    server = ServeProcess(tmp_path, ["--dry-run", "--backend", "llama.cpp", *flags])
    shown = subprocess.run(server.argv, env=server.env, capture_output=True, text=True, timeout=120, check=False)
    assert shown.returncode == 0, shown.stderr
    line = next(ln for ln in shown.stdout.splitlines() if ln.startswith("restart"))
    auto = KVMemConfig().with_host_tier().cpu_gb
    assert line.split(None, 1)[1] == says.replace("NVME", str(tmp_path / "nvme")).replace("AUTO", f"{auto:g}")
