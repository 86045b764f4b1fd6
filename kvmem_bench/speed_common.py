"""What every ``kvmem bench speed`` backend shares: the headline ratios, physical floors, the
goal check, memory readings, the table and the PNG plots.

A backend produces ``points`` (one per workspace size, ascending) with at least
``workspace_tokens``, ``reuse_ttft_s``, ``reprefill_ttft_s`` and ``kvmem_tok_s`` (plus
``full_tok_s`` where dense attention over the whole workspace ran; ``prefix_ttft_s`` and
``suffix_floor_s`` where the fair baselines ran: ``speed_baselines``), and a ``transfer``
dict with the tier and raw throughputs of the same bytes. ``headline`` turns them into the
output contract's ratios.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Sequence

from kvmem_bench.plots import save_figure

GOALS = {
    "ttft_speedup": 30.0,
    "quick_ttft_speedup": 10.0,
    "decode_flatness_tolerance": 0.10,
    "nvme_vs_raw": 0.8,
    "decode_vs_plain": 0.95,
    "vs_prefix_cache": 1.2,
    "vs_floor": 1.25,
    "floor_slack_s": 0.05,
}


def decode_rate(result: Any) -> float | None:
    """A step's one-token forwards per second of its decode phase, or None without any: the first token comes
    from the prefill's logits, so n tokens take n - 1 forwards (as a plain loop that evaluates each token after
    the prompt's last). The forwards' own wall times say nothing: the phase streams each token's text while the
    device runs the next forward."""
    forwards = len(result.token_ids) - 1
    return forwards / result.timings["decode_s"] if forwards > 0 else None


def ratio(num: float | None, den: float | None) -> float | None:
    """``num / den``; None when either is missing, not finite or the denominator is not positive."""
    if num is None or den is None or not math.isfinite(num) or not math.isfinite(den) or den <= 0:
        return None
    return num / den


def shown(value: float | None, fmt: str, missing: str) -> str:
    """A figure for a log line: ``fmt`` of ``value``, or ``missing`` (why it was not measured) for None."""
    return missing if value is None else fmt.format(value)


def floor_s(nbytes: float, gbps: float) -> float:
    """Seconds that moving ``nbytes`` takes at ``gbps`` (10^9 bytes/s): the physical floor of a step."""
    assert gbps > 0, "bandwidth must be positive"
    return nbytes / (gbps * 1e9)


def headline(backend: str, model: str, points: Sequence[dict[str, Any]], transfer: dict[str, Any]) -> dict[str, Any]:
    """The contract's ratios: TTFT re-prefill / reuse at the largest workspace, reuse / the dense prefix cache
    and reuse / the suffix floor there (None where not measured), decode tok/s at the largest / at the smallest
    workspace, and tier / raw throughput of the same bytes."""
    assert points, "no workspace sizes were measured"
    first, last = points[0], points[-1]
    return {
        "backend": backend,
        "model": model,
        "ttft_speedup": ratio(last["reprefill_ttft_s"], last["reuse_ttft_s"]),
        "ttft_vs_prefix_cache": ratio(last["reuse_ttft_s"], last.get("prefix_ttft_s")),
        "ttft_vs_suffix_floor": ratio(last["reuse_ttft_s"], last.get("suffix_floor_s")),
        "decode_flatness": ratio(last["kvmem_tok_s"], first["kvmem_tok_s"]),
        "nvme_vs_raw": transfer.get("nvme_vs_raw"),
        "host_vs_raw": transfer.get("host_vs_raw"),
        "workspace_growth": ratio(last["workspace_tokens"], first["workspace_tokens"]),
        "largest_workspace_tokens": last["workspace_tokens"],
    }


def goals(result: dict[str, Any], quick: bool) -> dict[str, bool | None]:
    """Each speed goal of the issue: met (True), missed (False) or not measured (None)."""
    ttft, flat, nvme = result.get("ttft_speedup"), result.get("decode_flatness"), result.get("nvme_vs_raw")
    need = GOALS["quick_ttft_speedup"] if quick else GOALS["ttft_speedup"]
    out = {
        f"ttft_speedup>={need:g}": None if ttft is None else ttft >= need,
        "decode_flat_within_10pct": None if flat is None else abs(flat - 1) <= GOALS["decode_flatness_tolerance"],
        "nvme_vs_raw>=0.8": None if nvme is None else nvme >= GOALS["nvme_vs_raw"],
    }
    if "ttft_vs_prefix_cache" in result:  # the fair baselines: within 1.2x the prefix cache, 1.25x (floor + 50 ms)
        out.update(fair_goals(result))
    if "decode_vs_plain" in result:  # backends with a plain engine to compare against (llama.cpp)
        plain = result["decode_vs_plain"]
        out["decode_vs_plain>=0.95"] = None if plain is None else plain >= GOALS["decode_vs_plain"]
    return out


def fair_goals(result: dict[str, Any]) -> dict[str, bool | None]:
    """The fair-baseline goals at the largest workspace: reuse TTFT ≤ 1.2 × the dense prefix cache's, and
    ≤ 1.25 × (suffix floor + 50 ms); None where not measured."""
    cache, last = result.get("ttft_vs_prefix_cache"), (result.get("points") or [{}])[-1]
    reuse, floor = last.get("reuse_ttft_s"), last.get("suffix_floor_s")
    near_floor = (
        None if reuse is None or floor is None else reuse <= GOALS["vs_floor"] * (floor + GOALS["floor_slack_s"])
    )
    return {
        "ttft_vs_prefix_cache<=1.2": None if cache is None else cache <= GOALS["vs_prefix_cache"],
        "ttft<=1.25x(suffix_floor+50ms)": near_floor,
    }


def gpu_memory_mb() -> dict[str, float]:
    """This process's CUDA memory in MB (torch's allocator: ``gpu_allocated_mb`` live tensors, graph outputs and
    pools' live blocks included; ``gpu_reserved_mb`` all it holds from the driver), where torch is already loaded
    and has a GPU; empty otherwise (llama.cpp, the CPU)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    cuda = torch.cuda
    return {"gpu_allocated_mb": cuda.memory_allocated() / 1e6, "gpu_reserved_mb": cuda.memory_reserved() / 1e6}


def rss_mb() -> tuple[float, float]:
    """(current, peak) resident set size of this process in MB, from /proc/self/status."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                fields[name] = int(value.split()[0]) * 1024 / 1e6
    return fields["VmRSS"], fields["VmHWM"]


def table(points: Sequence[dict[str, Any]]) -> str:
    """Plain-text table of the per-workspace figures."""
    cols = [
        ("workspace_tokens", "workspace", "{:d}"),
        ("reuse_ttft_s", "ttft reuse s", "{:.3f}"),
        ("reprefill_ttft_s", "ttft re-prefill s", "{:.2f}"),
        ("ttft_speedup", "speedup", "{:.1f}x"),
        ("prefix_ttft_s", "ttft prefix cache s", "{:.3f}"),
        ("ttft_vs_prefix_cache", "vs cache", "{:.2f}x"),
        ("suffix_floor_s", "suffix floor s", "{:.3f}"),
        ("ttft_vs_suffix_floor", "vs floor", "{:.2f}x"),
        ("kvmem_tok_s", "kvmem tok/s", "{:.1f}"),
        ("full_tok_s", "full tok/s", "{:.1f}"),
        ("select_share", "select share", "{:.0%}"),
        ("rss_mb", "rss MB", "{:.0f}"),
        ("gpu_reserved_mb", "gpu MB", "{:.0f}"),
    ]
    cols = [c for c in cols if any(p.get(c[0]) is not None for p in points)]
    rows = [[c[1] for c in cols]]
    for p in points:
        rows.append(["-" if p.get(key) is None else fmt.format(p[key]) for key, _, fmt in cols])
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows)


def write_json(result: dict[str, Any], out_dir: Path) -> Path:
    """``speed.json`` in ``out_dir`` (made if missing); -> its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "speed.json"
    path.write_text(json.dumps(result, indent=1))
    return path


def write_outputs(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """``speed.json`` plus the PNG plots in ``out_dir``; returns the paths written. A separate ``ttft`` list
    (history_tokens, reuse_ttft_s, reprefill_ttft_s), as the torch backend measures it, feeds the TTFT plot."""
    path = write_json(result, out_dir)
    ttft = [{"workspace_tokens": t["history_tokens"], **t} for t in result.get("ttft", ())] or result["points"]
    return [path, *plot_speed(result["points"], result["backend"], out_dir, ttft)]


def merge_runs(paths: Sequence[Path]) -> dict[str, Any]:
    """One result from the ``speed.json`` files of several runs of one backend (a large workspace is measured one
    size a run): ``backend``, ``sources`` and every run's ``points`` by workspace size. ``ValueError`` names a file
    that is missing, not a speed result, or of another backend."""
    runs = []
    for path in paths:
        try:
            run = json.loads(Path(path).read_text())
            runs.append((path, run["backend"], list(run["points"])))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}: not a kvmem bench speed result ({type(exc).__name__}: {exc})") from None
    backends = {backend for _, backend, _ in runs}
    if len(backends) != 1:
        raise ValueError(f"the runs are of different backends ({', '.join(sorted(backends))}): plot each apart")
    points = sorted((p for _, _, pts in runs for p in pts), key=lambda p: p["workspace_tokens"])
    return {"backend": backends.pop(), "sources": [str(path) for path, _, _ in runs], "points": points}


def plot_speed(
    points: Sequence[dict[str, Any]], backend: str, out_dir: Path, ttft: Sequence[dict[str, Any]] | None = None
) -> list[Path]:
    """TTFT (reuse vs re-prefill; ``ttft`` points, default ``points``), decode tok/s (KVMem vs full) and RSS
    against the workspace size."""
    import matplotlib

    matplotlib.use("Agg")
    series = [
        (
            "ttft.png",
            "time to first token (s)",
            True,
            ttft or points,
            {
                "KVMem reuse": "reuse_ttft_s",
                "stateless re-prefill": "reprefill_ttft_s",
                "dense prefix cache": "prefix_ttft_s",
                "suffix floor": "suffix_floor_s",
            },
        ),
        (
            "decode.png",
            "decode tok/s",
            False,
            points,
            {"KVMem (fixed budget)": "kvmem_tok_s", "full attention": "full_tok_s"},
        ),
        ("memory.png", "memory (MB)", False, points, {"engine RSS": "rss_mb", "GPU, held by torch": "gpu_reserved_mb"}),
    ]
    return [
        _plot(pts, ylabel, logy, keys, f"{backend}: {ylabel} vs workspace", out_dir / name)
        for name, ylabel, logy, pts, keys in series
        if any(p.get(k) is not None for k in keys.values() for p in pts)
    ]


def _plot(
    points: Sequence[dict[str, Any]], ylabel: str, logy: bool, keys: dict[str, str], title: str, path: Path
) -> Path:
    import matplotlib.pyplot as plt

    xs = [p["workspace_tokens"] for p in points]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, key in keys.items():
        pairs = [(x, p[key]) for x, p in zip(xs, points) if p.get(key) is not None]
        if pairs:
            ax.plot(*zip(*pairs), marker="o", label=label)
    ax.set(xlabel="workspace tokens", ylabel=ylabel, title=title, xscale="log")
    if logy:
        ax.set_yscale("log")
    return save_figure(fig, ax, path)
