"""KVMem's llama.cpp binding (llama-cpp-python's low-level API, no patched llama.cpp).

``create_adapter`` is the ``kvmem.adapters`` entry point named ``llama.cpp``. Importing the
package shortens the spin of llama.cpp's OpenMP threads (``kvmem_llamacpp.openmp``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvmem_llamacpp.openmp import set_spin_default

set_spin_default()  # before any module of this package loads llama_cpp, and with it libgomp
try:  # before the core's numpy where that is not loaded yet (kvmem.native_libs)
    import llama_cpp  # noqa: F401
except ImportError:  # an install without llama-cpp-python: create_adapter says so when the engine is asked for
    pass

from kvmem_core.config import KVMemConfig  # noqa: E402
from kvmem_core.errors import ConfigError  # noqa: E402

if TYPE_CHECKING:
    from kvmem_llamacpp.adapter import LlamaCppAdapter


def create_adapter(model_path: str, config: KVMemConfig, **opts: Any) -> LlamaCppAdapter:
    """Load ``model_path`` with a view of ``config.view_tokens`` cells; ``opts`` go to ``LlamaCppAdapter``.
    ``config.kv_dtype``: ``q8_0`` caches and stores 8-bit KV; ``auto`` and ``f16`` the 16-bit KV."""
    from kvmem_llamacpp.adapter import LlamaCppAdapter

    if config.kv_dtype not in ("auto", "f16", "q8_0"):
        raise ConfigError(f"--kv-dtype {config.kv_dtype} is not available on the llama.cpp engine: choose f16 or q8_0")
    return LlamaCppAdapter(
        model_path,
        view_tokens=config.view_tokens,
        block_tokens=config.block_tokens,
        kv_q8_0=config.kv_dtype == "q8_0",
        **opts,
    )


def fill_sequence(ctx: Any, seq: int, n_tokens: int) -> None:
    """Make sequence ``seq`` of a llama.cpp context (a ``llama_context`` pointer, such as llama-cpp-python's
    ``Llama._ctx.ctx``) hold ``n_tokens`` cells at positions 0.. whose K and V repeat the cells it holds now (at
    least one): what a resident prefix of that length costs a forward, whatever its values, without computing it
    (``kvmem bench speed``'s dense prefix cache past a whole-transcript prefill's reach)."""
    from kvmem_llamacpp.lowlevel import fill_sequence as fill

    fill(ctx, seq, n_tokens)


__all__ = ["create_adapter", "fill_sequence"]
