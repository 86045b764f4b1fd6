"""A small real filesystem for disk-fault tests: a tmpfs mounted by the test (root only, else skipped)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import pytest


@contextlib.contextmanager
def small_tmpfs(mount: Path, size: str) -> Iterator[Path]:
    """Mount a tmpfs of ``size`` (``mount -o size=``) at ``mount`` for the block; skip the test where this process
    may not mount one."""
    mount.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True, text=True, check=False
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def remount(mount: Path, mode: str) -> None:
    """Remount ``mount`` read-only (``ro``) or writable (``rw``)."""
    subprocess.run(["mount", "-o", f"remount,{mode}", str(mount)], check=True)
