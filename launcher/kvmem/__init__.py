"""KVMem launcher: the ``kvmem`` CLI, the API server and the engine process."""

from __future__ import annotations

import sys

from kvmem.native_libs import load_llama_cpp_first

__version__ = "0.1.0"

load_llama_cpp_first(sys.orig_argv)  # before anything imports numpy: see kvmem.native_libs
