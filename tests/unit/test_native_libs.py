"""A process that runs the llama.cpp engine loads ``llama_cpp`` before numpy (a CUDA build crashed in its model load
otherwise, docs/llamacpp.md); one that runs torch or no engine does not load it at all."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvmem.native_libs import engine_backend

PY = "/usr/bin/python3"


@pytest.mark.parametrize(
    "argv, backend",
    [
        ([PY, "-m", "kvmem", "run", "-p", "hi"], "llama.cpp"),
        ([PY, "-m", "kvmem", "chat", "--backend", "torch"], "torch"),
        ([PY, "-m", "kvmem", "run", "--backend=llama.cpp", "-p", "hi"], "llama.cpp"),
        (["/venv/bin/python", "/venv/bin/kvmem", "run", "-p", "hi"], "llama.cpp"),
        ([PY, "-m", "kvmem.engine_proc", "ipc://a", "ipc://b", json.dumps({"backend": "torch"})], "torch"),
        ([PY, "-m", "kvmem.engine_proc", "ipc://a", "ipc://b", json.dumps({"backend": "llama.cpp"})], "llama.cpp"),
        ([PY, "-m", "kvmem.engine_proc", "ipc://a"], None),
        ([PY, "-m", "kvmem", "serve"], None),  # its engine runs in a process of its own
        ([PY, "-m", "kvmem", "bench", "speed"], None),
        ([PY, "-m", "pytest", "run"], None),
        ([PY, "-c", "import kvmem"], None),
    ],
)
def test_the_engine_a_command_line_runs_in_its_own_process(argv: list[str], backend: str | None) -> None:
    assert engine_backend(argv) == backend


def imports_of(*args: str) -> list[str]:
    """The modules ``python -X importtime -m kvmem ARGS`` imports, in the order their imports finish."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "kvmem", *args], capture_output=True, text=True, env=env, timeout=120
    )
    return [line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")]


def test_kvmem_run_loads_llama_cpp_before_numpy() -> None:
    pytest.importorskip("llama_cpp")
    modules = imports_of("run", "--help")
    assert modules.index("llama_cpp.llama_cpp") < modules.index("numpy")  # the native library is loaded first


def test_kvmem_run_on_torch_never_loads_llama_cpp() -> None:
    assert "llama_cpp" not in imports_of("run", "--backend", "torch", "--help")
