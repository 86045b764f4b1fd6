"""A quality run as ``docs/results`` keeps it: ``quality.json`` (meta, plan, per-cell results, summary) and plots as
the run wrote them, and the raw per-session outcomes as gzip-compressed JSON lines (``outcomes.jsonl.gz``, one
outcome a line, the format of the run's own ``outcomes.jsonl``).

``python -m kvmem_bench.results bench-out/quality docs/results/quality-NAME`` keeps a run that way;
``read_outcomes`` (or ``zcat outcomes.jsonl.gz``) reads the outcomes back.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
from pathlib import Path
from typing import Any

OUTCOMES = "outcomes.jsonl.gz"


def read_outcomes(path: Path) -> list[dict[str, Any]]:
    """The outcomes of a kept run's ``outcomes.jsonl.gz``, in the order the run wrote them."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def keep_run(run: Path, dest: Path) -> list[Path]:
    """Write ``run``'s quality.json without its outcomes, the outcomes (from quality.json, else the run's
    outcomes.jsonl) compressed, and its plots into ``dest`` (``run`` itself allowed); the paths written."""
    detail = json.loads((run / "quality.json").read_text())
    outcomes = detail.pop("outcomes", None)
    if outcomes is None and (run / "outcomes.jsonl").is_file():
        outcomes = [json.loads(line) for line in (run / "outcomes.jsonl").read_text().splitlines() if line.strip()]
    dest.mkdir(parents=True, exist_ok=True)
    written = [dest / "quality.json"]
    written[0].write_text(json.dumps(detail, indent=1))
    if outcomes is not None:
        written.append(dest / OUTCOMES)
        with gzip.GzipFile(written[-1], "wb", compresslevel=9, mtime=0) as f:  # mtime 0: the same run, the same bytes
            f.write("".join(json.dumps(o) + "\n" for o in outcomes).encode())
    for plot in sorted(run.glob("*.png")):
        if plot.resolve() != (dest / plot.name).resolve():
            written.append(Path(shutil.copy2(plot, dest / plot.name)))
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvmem_bench.results", description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="the run's --out folder (quality.json, outcomes.jsonl, plots)")
    parser.add_argument("dest", type=Path, help="where to keep it (docs/results/quality-NAME; the run's own folder)")
    args = parser.parse_args(argv)
    for path in keep_run(args.run, args.dest):
        print(path)


if __name__ == "__main__":
    main()
