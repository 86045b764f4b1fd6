"""``kvmem serve`` bound off loopback without an API key warns on stderr (a real ``--dry-run`` process)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any


def test_serve_warns_on_stderr_when_exposed_without_a_key(tmp_path: Any) -> None:
    env = {"KVMEM_RUN_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-m", "kvmem", "serve", "--host", "0.0.0.0", "--dry-run", "--backend", "llama.cpp"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "WARNING" in done.stderr and "--api-key" in done.stderr
