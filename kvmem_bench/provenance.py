"""What produced a bench's numbers: the commit, the machine, the date and the command that re-runs the run.

Every bench result carries these (``run_meta``), so a number read later names its code and machine.
"""

from __future__ import annotations

import contextlib
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence


def commit() -> str:
    """The checkout's commit (``-dirty`` with local changes), else ``KVMEM_COMMIT``, else "unknown"."""
    root = Path(__file__).resolve().parents[1]  # the checkout holding kvmem_bench/
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("KVMEM_COMMIT", "unknown")


def machine() -> str:
    """OS, architecture, CPU count and model (from /proc/cpuinfo where there is one), and the GPUs the vendors'
    tools list."""
    from kvmem.devices import probe_gpus

    cpu = platform.processor()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as info:
        cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), cpu)
    gpus = "".join(f", GPU {g.name} ({g.total_mib} MiB)" for g in probe_gpus())
    return f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, {cpu or 'unknown CPU'}{gpus}"


def command(bench: str, fallback: Sequence[str] = ()) -> str:
    """``kvmem bench BENCH`` with this process's arguments where the CLI runs it, else with ``fallback``'s."""
    argv = sys.argv[1:] if sys.argv[1:3] == ["bench", bench] else ["bench", bench, *fallback]
    return " ".join(["kvmem", *map(shlex.quote, argv)])


def run_meta(bench: str, fallback: Sequence[str] = ()) -> dict[str, str]:
    """The commit, the machine, today's date and the command (``command``) of a run of ``kvmem bench BENCH``."""
    return {
        "commit": commit(),
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "command": command(bench, fallback),
    }
