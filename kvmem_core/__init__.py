"""KVMem's backend-neutral core: block store, tiers, retrieval and workspaces.

Imports numpy only (torch lazily, where tensors live on a GPU); engines bind to it through
the contract in ``kvmem_core.contract``.
"""

from __future__ import annotations

from kvmem_core.config import KVMemConfig
from kvmem_core.errors import (
    BudgetError,
    CapacityError,
    ConfigError,
    ContextLengthError,
    CorruptBlockError,
    KVMemError,
    ModelNotFoundError,
    UnsupportedModelError,
)
from kvmem_core.layout import BlockLayout

__all__ = [
    "BlockLayout",
    "BudgetError",
    "CapacityError",
    "ConfigError",
    "ContextLengthError",
    "CorruptBlockError",
    "KVMemConfig",
    "KVMemError",
    "ModelNotFoundError",
    "UnsupportedModelError",
]
