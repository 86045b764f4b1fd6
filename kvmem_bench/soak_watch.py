"""What ``kvmem bench soak`` watches, and the disk it fills.

``engine_metric`` reads one of the server's engine figures from ``/metrics``. ``Watch``
samples, on a thread of its own, the resident memory of a server's whole process tree (the
API process and its engine, whichever engine is alive at the moment) and the bytes an NVMe
directory takes on disk, keeping the start and the peak of each. ``mount_tmpfs`` gives the
NVMe directory a small filesystem of its own (root only) so that ``fill_disk`` can fill it up
for a while without touching any other disk.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import psutil

MIB = 1024 * 1024
FILL_NAME = "soak-fill"


def tree_rss_bytes(pid: int) -> int:
    """Resident bytes of process ``pid`` and all its descendants; 0 once ``pid`` is gone. A child that exits
    while it is read counts as nothing."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def disk_bytes(directory: Path) -> int:
    """Bytes the files under ``directory`` take on disk (allocated blocks, as ``du``); 0 when it does not exist.
    Files removed while it is walked count as nothing."""
    total = 0
    for folder, _, names in os.walk(directory):
        for name in names:
            try:
                total += os.lstat(os.path.join(folder, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def engine_metric(url: str, name: str) -> float | None:
    """``kvmem_engine_<name>`` from ``/metrics`` (Prometheus text); None where the server does not report it."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    prefix = f"kvmem_engine_{name} "
    return next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)), None)


class Watch:
    """Samples ``tree_rss_bytes(pid)`` and ``disk_bytes(directory)`` every ``period`` seconds between ``start``
    and ``stop``; the figures are in MiB."""

    def __init__(self, pid: int, directory: Path, period: float = 0.5) -> None:
        self.pid, self.directory, self.period = pid, directory, period
        self.rss_start_mb = self.peak_rss_mb = 0.0
        self.disk_start_mb = self.peak_disk_mb = 0.0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="soak-watch", daemon=True)

    def start(self) -> Watch:
        """Take the first sample (the start figures) now, then keep sampling in the background."""
        self.rss_start_mb, self.disk_start_mb = self._sample()
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop sampling after one last sample; the peaks are final once it returns."""
        self._stop.set()
        self._thread.join()
        self._sample()

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            self._sample()

    def _sample(self) -> tuple[float, float]:
        rss, disk = tree_rss_bytes(self.pid) / MIB, disk_bytes(self.directory) / MIB
        self.peak_rss_mb, self.peak_disk_mb = max(self.peak_rss_mb, rss), max(self.peak_disk_mb, disk)
        self.samples += 1
        return rss, disk


def mount_tmpfs(mount: Path, size_mb: int) -> tuple[Path | None, str]:
    """Mount a tmpfs of ``size_mb`` MiB at ``mount``: ``(mount, "")``, or ``(None, why)`` where this process may
    not mount one (not root, no ``mount`` command, or the kernel refused)."""
    mount.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return None, "not injected: mounting a tmpfs needs root"
    if shutil.which("mount") is None:
        return None, "not injected: no mount command"
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
        check=False,
    )
    if made.returncode != 0:
        return None, f"not injected: cannot mount a tmpfs: {made.stderr.strip()}"
    return mount, ""


def unmount(mount: Path) -> None:
    """Detach a mount made by ``mount_tmpfs`` (lazily, so a file still open does not keep it)."""
    subprocess.run(["umount", "-l", str(mount)], capture_output=True, check=False)


def fill_disk(directory: Path, seconds: float, stop: threading.Event, limit_bytes: int) -> dict[str, float | bool]:
    """Fill ``directory``'s filesystem with one file until it is full (``ENOSPC``) or holds ``limit_bytes``, keep
    it for ``seconds`` (less when ``stop`` is set), then delete it. Returns ``filled_mb``, ``held_s`` and ``full``
    (whether the filesystem ran out of space). ``limit_bytes`` keeps a directory on a shared disk from filling it."""
    path = directory / FILL_NAME
    written, full = 0, False
    chunk = b"\0" * MIB
    try:
        with open(path, "wb", buffering=0) as fill:
            while written < limit_bytes:
                try:
                    written += fill.write(chunk[: limit_bytes - written])
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    full = True
                    break
        started = time.monotonic()
        stop.wait(seconds)
        held = time.monotonic() - started
    finally:
        path.unlink(missing_ok=True)
    return {"filled_mb": round(written / MIB, 1), "held_s": round(held, 1), "full": full}
