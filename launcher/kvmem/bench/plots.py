"""PNG plots of the quality benchmark (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvmem.bench import report


def plot_quality(outcomes: Sequence[dict[str, Any]], budget: int, out_dir: Path) -> list[Path]:
    """Accuracy vs workspace/budget ratio per method, and vs needle depth on long workspaces."""
    import matplotlib

    matplotlib.use("Agg")
    by_size = report.by(outcomes, "size")
    ratio = {m: {size / budget: acc for size, acc in g.items()} for m, g in by_size.items()}
    long = [o for o in outcomes if o["size"] >= report.LONG_RATIO * budget]
    paths = [_lines(ratio, "workspace tokens / budget", f"Accuracy vs workspace size (budget {budget})",
                    out_dir / "accuracy_vs_ratio.png")]
    if long:
        paths.append(_lines(report.by(long, "depth"), "needle depth (0 = start of the workspace)",
                            f"Accuracy vs needle depth (workspaces >= {report.LONG_RATIO}x budget)",
                            out_dir / "accuracy_vs_depth.png"))
    return paths


def _lines(series: dict[str, dict[float, float]], xlabel: str, title: str, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in sorted(series, key=lambda n: (not n.startswith("retrieval"), n)):
        xs = sorted(series[name])
        style = "-" if name.startswith("retrieval") else ":" if name == "oracle" else "--"
        ax.plot(xs, [100 * series[name][x] for x in xs], style, marker="o", label=name)
    ax.set(xlabel=xlabel, ylabel="exact-match accuracy (%)", title=title, ylim=(-5, 105))
    return save_figure(fig, ax, path)


def save_figure(fig: Any, ax: Any, path: Path) -> Path:
    """Grid, legend and layout, then write ``path`` as PNG and free the figure."""
    import matplotlib.pyplot as plt

    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
