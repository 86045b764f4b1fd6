"""KVMem's native torch engine: Llama, Qwen2 / Qwen2.5 and Qwen3.5 hybrid (Gated DeltaNet) models over paged KV.

``create_adapter`` is the ``kvmem.adapters`` entry point named ``torch``.
"""
from __future__ import annotations

from typing import Any

from kvmem_core.config import KVMemConfig


def create_adapter(model_path: str, config: KVMemConfig, *, chat_template: str | None = None,
                   **opts: Any) -> "TorchAdapter":  # noqa: F821
    """Load ``model_path`` (GGUF file or HF directory) with a view of ``config.view_tokens`` cells; ``chat_template``
    replaces the model's own."""
    from kvmem_torch.adapter import TorchAdapter

    adapter = TorchAdapter(model_path, view_tokens=config.view_tokens, block_tokens=config.block_tokens, **opts)
    if chat_template:
        adapter.chat_template = adapter.tokenizer.chat_template = chat_template
    return adapter


__all__ = ["create_adapter"]
