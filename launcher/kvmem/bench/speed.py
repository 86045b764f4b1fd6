"""``kvmem bench speed``: the agent-session speed benchmark of one backend.

``run_speed`` dispatches to the backend's module (``speed_llamacpp`` on the CPU,
``speed_torch`` for the torch engine), checks the goals, and writes JSON and plots.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from kvmem.bench import speed_common


def run_speed(backend: str, model_path: str | None, *, quick: bool, out_dir: Path | None,
              log: Callable[[str], None] = print, **opts: Any) -> dict[str, Any]:
    """Every speed figure of ``backend`` as a JSON-ready dict: the contract's headline keys first,
    then ``points`` (one per workspace size), ``transfer`` and ``goals``; JSON + PNGs go to ``out_dir``."""
    if backend == "llama.cpp":
        from kvmem.bench import speed_llamacpp
        from kvmem.models import resolve_model

        result = speed_llamacpp.run(str(resolve_model(model_path)), quick=quick, log=log, **opts)
    else:
        from kvmem.bench import speed_torch

        result = speed_torch.run(quick=quick, log=log, **opts)
    result["goals"] = speed_common.goals(result, quick)
    if out_dir is not None:
        result["files"] = [str(p) for p in speed_common.write_outputs(result, out_dir)]
    return result
