"""The memory this process may use: the machine's physical RAM, or less where a cgroup limits it.

``--kvmem-cpu-gb auto`` (the default) sizes the host tier as ``HOST_TIER_SHARE`` of it, so the workspaces a
server holds grow with the machine (a container's limit, not its host's RAM, is what the OOM killer enforces).
"""

from __future__ import annotations

import os
from pathlib import Path

HOST_TIER_SHARE = 0.5  # of the usable memory; the rest stays for weights, the engine and everything else
FALLBACK_BYTES = 8 << 30  # where the platform reports no memory size: a 4 GiB host tier
CGROUP_LIMITS = ("memory.max", "memory/memory.limit_in_bytes")  # cgroup v2, v1 (relative to the cgroup root)
NO_LIMIT = 1 << 62


def usable_memory_bytes(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """Physical memory, capped by the process's cgroup limit where one is set (``max`` or an absent file: none)."""
    try:
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # platforms without these sysconf names
        physical = FALLBACK_BYTES
    return min(physical, *(_cgroup_limit(cgroup_root / name) for name in CGROUP_LIMITS))


def _cgroup_limit(path: Path) -> int:
    try:
        text = path.read_text().strip()
    except OSError:
        return NO_LIMIT
    return int(text) if text.isdigit() else NO_LIMIT
