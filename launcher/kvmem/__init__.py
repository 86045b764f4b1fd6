"""KVMem launcher: the ``kvmem`` CLI, the API server and the engine process."""

from __future__ import annotations

__version__ = "0.1.0"
