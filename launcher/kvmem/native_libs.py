"""llama.cpp's libraries load before numpy in a process that runs the llama.cpp engine.

A CUDA build of llama-cpp-python (0.3.36, CUDA 13.0, GCC 13.3, numpy 2.5.2 on the H200 image)
crashed inside its model load (SIGSEGV in ``llama_model_load_from_file``) in every process that
had imported numpy, or torch (which imports it), before ``llama_cpp``; the same build, model and
flags loaded and answered where ``llama_cpp`` came first (docs/llamacpp.md has the bisection).
KVMem's core imports numpy everywhere, so a process whose command line says it will run the
llama.cpp engine loads ``kvmem_llamacpp`` (which loads ``llama_cpp`` before anything of its own)
when the ``kvmem`` package is imported, before any numpy. A process that runs the torch engine
must not: torch failed to import after ``llama_cpp`` on that machine.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from typing import Sequence

IN_PROCESS_COMMANDS = ("run", "chat")  # the ``kvmem`` commands that load an engine in their own process
DEFAULT_BACKEND = "llama.cpp"  # ``kvmem run`` / ``kvmem chat``'s


def engine_backend(argv: Sequence[str]) -> str | None:
    """The engine a process started with the command line ``argv`` (``sys.orig_argv``: the interpreter first) runs in
    its own process: ``kvmem run`` / ``kvmem chat`` (``python -m kvmem``, the ``kvmem`` script) and the server's
    engine process (``python -m kvmem.engine_proc IN OUT SPEC_JSON``). None for any other process."""
    args = list(argv[1:])
    if "-m" in args:
        at = args.index("-m") + 1
        module_name, rest = (args[at] if at < len(args) else ""), args[at + 1 :]
    else:
        module_name, rest = ("kvmem" if args and os.path.basename(args[0]) == "kvmem" else ""), args[1:]
    if module_name == "kvmem.engine_proc":
        try:
            return str(json.loads(rest[2]).get("backend"))
        except (IndexError, ValueError, AttributeError):
            return None
    if module_name not in ("kvmem", "kvmem.__main__") or not rest or rest[0] not in IN_PROCESS_COMMANDS:
        return None
    for i, arg in enumerate(rest):
        if arg.startswith("--backend="):
            return arg.split("=", 1)[1]
        if arg == "--backend" and i + 1 < len(rest):
            return rest[i + 1]
    return DEFAULT_BACKEND


def load_llama_cpp_first(argv: Sequence[str]) -> bool:
    """Import ``kvmem_llamacpp`` (``llama_cpp`` first) when ``argv`` runs the llama.cpp engine and numpy is not loaded
    yet; True when it did."""
    if engine_backend(argv) != "llama.cpp" or "numpy" in sys.modules:
        return False
    if importlib.util.find_spec("kvmem_llamacpp") is None:
        return False
    import kvmem_llamacpp  # noqa: F401  (its __init__ loads llama_cpp before the core)

    return True
