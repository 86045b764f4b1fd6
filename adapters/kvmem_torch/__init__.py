"""KVMem's native torch engine: Llama, Qwen2 / Qwen2.5 and Qwen3.5 hybrid (Gated DeltaNet) models over paged KV.

``create_adapter`` is the ``kvmem.adapters`` entry point named ``torch``. The other names below are the engine's
public API for code outside it (benchmarks measure the engine through them); each loads its module, and torch, on
first use, so importing the package stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvmem_core.config import KVMemConfig
from kvmem_core.errors import ConfigError

_SIXTEEN_BIT = {"f16": "float16", "bf16": "bfloat16"}


def create_adapter(
    model_path: str, config: KVMemConfig, *, chat_template: str | None = None, **opts: Any
) -> "TorchAdapter":  # noqa: F821
    """Load ``model_path`` (GGUF file or HF directory) with a view of ``config.view_tokens`` cells; ``chat_template``
    replaces the model's own. ``config.kv_dtype``: ``fp8`` stores K/V as 8-bit rows; ``f16``/``bf16`` name the run
    dtype (KV is kept in it), which must then agree with ``opts["dtype"]``."""
    from kvmem_torch.adapter import TorchAdapter

    opts.update(kv_opts(config.kv_dtype, opts.get("dtype")))
    adapter = TorchAdapter(model_path, view_tokens=config.view_tokens, block_tokens=config.block_tokens, **opts)
    if chat_template:
        adapter.chat_template = adapter.tokenizer.chat_template = chat_template
    return adapter


def kv_opts(kv_dtype: str, dtype: str | None) -> dict[str, Any]:
    """The adapter options ``--kv-dtype`` asks for with run dtype ``dtype``; ConfigError where they disagree or
    the engine has no such KV."""
    if kv_dtype == "q8_0":
        raise ConfigError("--kv-dtype q8_0 is the llama.cpp engine's; the torch engine's 8-bit KV is fp8")
    if kv_dtype == "fp8":
        return {"kv_fp8": True}
    want = _SIXTEEN_BIT.get(kv_dtype)
    if want is None or dtype in (None, "auto", want):
        return {} if want is None else {"dtype": want}
    raise ConfigError(f"--kv-dtype {kv_dtype} keeps KV in the run dtype, but --dtype is {dtype}")


def plain_engine(
    model: Any, view_tokens: int, block_tokens: int = 128, cuda_graphs: bool | None = None, kv_fp8: bool = False
) -> Any:
    """The engine without KVMem over ``model`` (a ``Model``): one sequence's paged view of ``view_tokens`` cells
    with ``prefill``, ``forward``, ``insert_block``, ``clear``, ``drop_graphs`` and ``use_graphs`` (the plain
    engine a benchmark sets KVMem against)."""
    from kvmem_torch.runner import Runner

    return Runner(model, -(-view_tokens // block_tokens) + 2, block_tokens, cuda_graphs, kv_fp8=kv_fp8)


def set_dependent_launch(on: bool) -> None:
    """Let decode kernels launch as programmatic dependents (Hopper; the default) or make each wait for the one
    before to end (an A/B of what dependent launch saves). CUDA graphs captured before keep their launches."""
    from kvmem_torch import kernels

    kernels.DEPENDENT_LAUNCH = on


def quantize_fp8(x: Any) -> Any:
    """``x`` as the fp8 rows (codes and scales) an ``kv_fp8`` view stores."""
    from kvmem_torch.fp8 import quantize

    return quantize(x)


def prefill_attention_kernels(dtype: Any, head_dim: int, device: Any) -> dict[str, Any]:
    """The prefill attention kernels that run here, by name (``flash``; ``cudnn`` where cuDNN's runs and agrees),
    each ``(q [T, heads, hd], keys, values [S, kv, hd]) -> [T, heads, hd]``: q the last T of exactly S keys,
    causal (``layers.flash_prefill``, ``layers.cudnn_prefill``; docs/torch.md)."""
    import torch

    from kvmem_torch import layers

    def flash(q: Any, keys: Any, values: Any) -> Any:
        return layers.flash_prefill(q, keys, values, torch.full((1,), keys.shape[0], device=keys.device))

    kernels = {"flash": flash} if layers.flash_varlen_usable(dtype, head_dim, device) else {}
    if layers.cudnn_prefill_usable(dtype, head_dim, device):
        kernels["cudnn"] = layers.cudnn_prefill
    return kernels


_PUBLIC = {
    "TorchAdapter": "adapter",
    "prefill_chunk_for": "adapter",
    "Model": "model",
    "ModelSpec": "spec",
    "ATTENTION": "spec",
    "qwen35_kinds": "spec",
    "from_gguf_meta": "tokenizer",
    "BlockStager": "transfer",
    "TorchRetrievalHeads": "scoring",
    "fla_chunked_rule": "deltanet",
}


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'kvmem_torch' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kvmem_torch.{_PUBLIC[name]}"), name)


__all__ = [
    "create_adapter",
    "kv_opts",
    "plain_engine",
    "prefill_attention_kernels",
    "quantize_fp8",
    "set_dependent_launch",
    *_PUBLIC,
]
