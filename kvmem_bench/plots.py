"""PNG plots of the quality benchmark (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvmem_bench import report


def plot_quality(outcomes: Sequence[dict[str, Any]], out_dir: Path, trained_ctx: int | None = None) -> list[Path]:
    """Accuracy and gold-block recall vs workspace size per config (method @ view; the trained context marked),
    and accuracy vs needle depth."""
    import matplotlib

    matplotlib.use("Agg")
    ticks = {size: str(size) for size in sorted({o["size"] for o in outcomes})}
    paths = [
        _lines(
            report.by(outcomes, "size"),
            "exact-match accuracy (%)",
            "Accuracy vs workspace size",
            out_dir / "accuracy_vs_size.png",
            ticks,
            trained_ctx,
        )
    ]
    recall = report.by(outcomes, "size", "gold_selected")
    if recall:
        paths.append(
            _lines(
                recall,
                "gold-block recall (%)",
                "Gold blocks selected vs workspace size",
                out_dir / "gold_recall_vs_size.png",
                ticks,
                trained_ctx,
            )
        )
    paths.append(
        _lines(
            report.by(outcomes, "depth"),
            "exact-match accuracy (%)",
            "Accuracy vs needle depth",
            out_dir / "accuracy_vs_depth.png",
        )
    )
    return paths


def _lines(
    series: dict[str, dict[float, float]],
    ylabel: str,
    title: str,
    path: Path,
    ticks: dict[int, str] | None = None,
    trained_ctx: int | None = None,
) -> Path:
    """One line per method; ``ticks`` puts a log-scale size axis under them with the trained context marked."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in sorted(series, key=lambda n: (not n.startswith("retrieval"), n)):
        xs = sorted(series[name])
        style = "-" if name.startswith("retrieval") else ":" if name.startswith("oracle") else "--"
        ax.plot(xs, [100 * series[name][x] for x in xs], style, marker="o", label=name)
    if ticks:
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(ticks), list(ticks.values()), fontsize=8)
        ax.minorticks_off()
        if trained_ctx:
            ax.axvline(trained_ctx, color="grey", linestyle="-.", label=f"trained context ({trained_ctx})")
    xlabel = "workspace tokens" if ticks else "needle depth (0 = start of the workspace)"
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title, ylim=(-5, 105))
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
