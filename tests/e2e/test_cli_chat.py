"""``kvmem chat`` resends the transcript each turn: turn 2 hits the cache of turn 1."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from model_support import SMALL_MODEL, small_model

pytestmark = pytest.mark.llamacpp


def test_second_turn_reuses_the_first(tmp_path):
    pytest.importorskip("llama_cpp")
    small_model()
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from kvmem.cli import main; sys.exit(main(sys.argv[1:]))",
            "chat",
            "--model",
            SMALL_MODEL,
            "-n",
            "6",
            "--kvmem-block-tokens",
            "16",
        ],
        input="Name three fruits.\nAnd three colours?\n/exit\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    stats = re.findall(r"prompt (\d+) tok \(cache hit (\d+)\)", proc.stderr)
    assert len(stats) == 2
    (p1, h1), (p2, h2) = [(int(a), int(b)) for a, b in stats]
    assert h1 == 0 and p2 > p1 and h2 > p1
