"""``load_engine``: a backend's adapter (found through the ``kvmem.adapters`` entry points) plus KVMem memory."""

from __future__ import annotations

import importlib.metadata
import logging
from typing import Any, Callable

from kvmem_core.adapter import WarmUp
from kvmem_core.config import KVMemConfig
from kvmem_core.contract import Engine
from kvmem_core.engine import KVMemEngine
from kvmem_core.errors import ConfigError, UnsupportedModelError
from kvmem.models import resolve_model
from kvmem.profiles import retrieval_heads

ENTRY_POINT_GROUP = "kvmem.adapters"
log = logging.getLogger("kvmem.engine")


def adapter_factory(backend: str) -> Callable[..., Any]:
    """The ``create_adapter`` callable registered for ``backend`` (e.g. ``llama.cpp``, ``torch``)."""
    eps = {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    if backend not in eps:
        raise ConfigError(f"unknown backend {backend!r}; installed: {', '.join(sorted(eps)) or 'none'}")
    try:
        return eps[backend].load()
    except ImportError as exc:
        raise UnsupportedModelError(f"backend {backend!r} is not usable here: {exc}") from None


def load_engine(backend: str, model: str | None, config: KVMemConfig, *, progress: bool = False, **opts: Any) -> Engine:
    """Load ``model`` (a known model's name, a path; None: the default) on ``backend`` and wrap it in a ``KVMemEngine``.

    The retrieval heads come from ``config.retrieval_heads``, else the model's cached or
    shipped profile, else a calibration run now (cached for next time; ``progress`` shows
    a progress bar). ``opts`` go to the backend's ``create_adapter``. An adapter whose kernels compile on first
    use runs a step's shapes once first (``WarmUp``), so that no request waits for the compiler.
    """
    path = resolve_model(model)
    adapter = adapter_factory(backend)(str(path), config, **opts)
    try:
        heads = config.retrieval_heads or retrieval_heads(adapter, progress=progress)
        if isinstance(adapter, WarmUp) and (seconds := adapter.warm_up()):
            log.info("kernels warmed up in %.1f s", seconds)
        return KVMemEngine(adapter, config, heads=heads)
    except BaseException:
        adapter.close()
        raise
