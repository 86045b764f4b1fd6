"""KVMem's llama.cpp binding (llama-cpp-python's low-level API, no patched llama.cpp).

``create_adapter`` is the ``kvmem.adapters`` entry point named ``llama.cpp``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvmem_core.config import KVMemConfig

if TYPE_CHECKING:
    from kvmem_llamacpp.adapter import LlamaCppAdapter


def create_adapter(model_path: str, config: KVMemConfig, **opts: Any) -> LlamaCppAdapter:
    """Load ``model_path`` with a view of ``config.view_tokens`` cells; ``opts`` go to ``LlamaCppAdapter``."""
    from kvmem_llamacpp.adapter import LlamaCppAdapter

    return LlamaCppAdapter(model_path, view_tokens=config.view_tokens, block_tokens=config.block_tokens, **opts)


__all__ = ["create_adapter"]
