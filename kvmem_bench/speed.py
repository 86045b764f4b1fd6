"""``kvmem bench speed``: the agent-session speed benchmark of one backend.

``run_speed`` dispatches to the backend's module (``speed_llamacpp`` on the CPU or a GPU,
``speed_torch`` for the torch engine), sweeps the thread count (``speed_threads``), checks
the goals, and writes JSON and plots.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from kvmem_bench import speed_common
from kvmem_bench.provenance import run_meta


def run_speed(
    backend: str,
    model_path: str | None,
    *,
    quick: bool,
    out_dir: Path | None,
    log: Callable[[str], None] = print,
    compute: dict[str, Any] | None = None,
    **opts: Any,
) -> dict[str, Any]:
    """Every speed figure of ``backend`` as a JSON-ready dict: the contract's headline keys first, then ``points``
    (one per workspace size), ``transfer``, ``meta`` (commit, machine, date and command: ``provenance``),
    ``threads`` and ``goals``; JSON + PNGs go to ``out_dir``. ``compute``: the adapter's thread and GPU-layer
    options (``kvmem.compute``)."""
    from kvmem_bench import speed_threads

    compute = compute or {}
    if backend == "llama.cpp":
        from kvmem_bench import speed_llamacpp
        from kvmem.models import resolve_model

        result = speed_llamacpp.run(str(resolve_model(model_path)), quick=quick, log=log, compute=compute, **opts)
    else:
        from kvmem_bench import speed_torch

        result = speed_torch.run(quick=quick, log=log, **opts)
    result["meta"] = run_meta("speed")
    if out_dir is not None:  # the session's figures first: a later phase that fails must not take them along
        speed_common.write_json(result, out_dir)
    result["threads"] = speed_threads.run(backend, model_path, compute, quick=quick, log=log)
    result["goals"] = speed_common.goals(result, quick)
    if out_dir is not None:
        result["files"] = [str(p) for p in speed_common.write_outputs(result, out_dir)]
    return result
