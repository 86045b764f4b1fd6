"""The memory this process may use: the machine's physical RAM, or less where a cgroup limits it.

``--kvmem-cpu-gb auto`` (the default) sizes the host tier as ``HOST_TIER_SHARE`` of it, so the workspaces a
server holds grow with the machine (a container's or a service's limit, not its host's RAM, is what the OOM killer
enforces). The limit is the lowest on the way from the process's own cgroup (``/proc/self/cgroup``) up to the root.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath
from typing import Iterator

HOST_TIER_SHARE = 0.5  # of the usable memory; the rest stays for weights, the engine and everything else
FALLBACK_BYTES = 8 << 30  # where the platform reports no memory size: a 4 GiB host tier
V2_LIMIT, V1_LIMIT = "memory.max", "memory/memory.limit_in_bytes"  # relative to the cgroup root
NO_LIMIT = 1 << 62


def usable_memory_bytes(
    cgroup_root: Path = Path("/sys/fs/cgroup"), own_cgroups: Path = Path("/proc/self/cgroup")
) -> int:
    """Physical memory, capped by every cgroup memory limit set on the process's cgroups and their ancestors
    (``max``, unreadable or absent files: none)."""
    try:
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # platforms without these sysconf names
        physical = FALLBACK_BYTES
    return min(physical, *(_limit(path) for path in _limit_files(cgroup_root, own_cgroups)))


def _limit_files(root: Path, own_cgroups: Path) -> Iterator[Path]:
    yield root / V2_LIMIT
    yield root / V1_LIMIT
    try:
        lines = own_cgroups.read_text().splitlines()
    except OSError:
        return
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) < 3 or (fields[1] and "memory" not in fields[1].split(",")):
            continue
        controllers, path = fields[1], fields[2]
        limit = PurePosixPath(V2_LIMIT if not controllers else V1_LIMIT)
        base = root / limit.parent
        cgroup = PurePosixPath(path.lstrip("/"))
        for level in (cgroup, *cgroup.parents):
            yield base / level / limit.name


def _limit(path: Path) -> int:
    try:
        text = path.read_text().strip()
    except OSError:
        return NO_LIMIT
    return int(text) if text.isdigit() else NO_LIMIT
