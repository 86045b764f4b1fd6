"""KVMem's native torch engine: Llama, Qwen2 / Qwen2.5 and Qwen3.5 hybrid (Gated DeltaNet) models over paged KV.

``create_adapter`` is the ``kvmem.adapters`` entry point named ``torch``.
"""
from __future__ import annotations

from typing import Any

from kvmem_core.config import KVMemConfig
from kvmem_core.errors import ConfigError

_SIXTEEN_BIT = {"f16": "float16", "bf16": "bfloat16"}


def create_adapter(model_path: str, config: KVMemConfig, *, chat_template: str | None = None,
                   **opts: Any) -> "TorchAdapter":  # noqa: F821
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


__all__ = ["create_adapter"]
