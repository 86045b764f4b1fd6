"""Where KVMem keeps what it builds or downloads once per user (models, profiles, native helpers)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """The user cache folder: ``$KVMEM_CACHE_DIR`` when set, else ``$XDG_CACHE_HOME/kvmem``, else
    ``~/.cache/kvmem`` (the ``kvmem`` shell script resolves its wheel cache the same way). Empty
    variables count as unset; the folder is not created here."""
    explicit = os.environ.get("KVMEM_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvmem"
