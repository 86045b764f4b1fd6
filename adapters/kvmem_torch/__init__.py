"""KVMem's native torch engine: Llama, Qwen2 / Qwen2.5 and Qwen3.5 hybrid (Gated DeltaNet) models over paged KV.

``create_adapter`` is the ``kvmem.adapters`` entry point named ``torch``. The other names below are the engine's
public API for code outside it (benchmarks measure the engine through them); each loads its module, and torch, on
first use, so importing the package stays light.
"""
from __future__ import annotations

import importlib
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


def plain_engine(model: Any, view_tokens: int, block_tokens: int = 128, cuda_graphs: bool | None = None) -> Any:
    """The engine without KVMem over ``model`` (a ``Model``): one sequence's paged view of ``view_tokens`` cells
    with ``prefill``, ``forward``, ``insert_block``, ``clear``, ``drop_graphs`` and ``use_graphs`` (the plain
    engine a benchmark sets KVMem against)."""
    from kvmem_torch.runner import Runner

    return Runner(model, -(-view_tokens // block_tokens) + 2, block_tokens, cuda_graphs)


def set_dependent_launch(on: bool) -> None:
    """Let decode kernels launch as programmatic dependents (Hopper; the default) or make each wait for the one
    before to end (an A/B of what dependent launch saves). CUDA graphs captured before keep their launches."""
    from kvmem_torch import kernels

    kernels.DEPENDENT_LAUNCH = on


_PUBLIC = {"TorchAdapter": "adapter", "prefill_chunk_for": "adapter", "Model": "model", "ModelSpec": "spec",
           "ATTENTION": "spec", "qwen35_kinds": "spec", "from_gguf_meta": "tokenizer", "BlockStager": "transfer",
           "TorchRetrievalHeads": "scoring"}


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'kvmem_torch' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kvmem_torch.{_PUBLIC[name]}"), name)


__all__ = ["create_adapter", "plain_engine", "set_dependent_launch", *_PUBLIC]
