"""kvmem_core stays backend-neutral: importing every module pulls in no server or engine library."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import kvmem_core

FORBIDDEN = ("zmq", "aiohttp", "llama_cpp", "transformers", "msgspec")


def test_core_imports_no_engine_or_server_library():
    root = Path(kvmem_core.__file__).parent
    modules = sorted(
        "kvmem_core." + ".".join(p.relative_to(root).with_suffix("").parts)
        for p in root.rglob("*.py")
        if p.name != "__init__.py"
    )
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"bad = [m for m in {FORBIDDEN!r} if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"kvmem_core imported {out.stdout.strip()}"
    assert len(modules) >= 3
