"""No Python file of the tree passes 400 lines: a module that would is split along a seam first (a cohesive group
of functions or classes in a well-named module of its own)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 400
NOT_SOURCE = {"build", "dist", "node_modules", "__pycache__", "bench-out", "test-artifacts"}
# path -> why it may pass MAX_LINES for now; an entry leaves as soon as its file is short again
ALLOWED: dict[str, str] = {}


def _python_files() -> Iterator[Path]:
    """The tree's .py files, relative to the root: hidden folders (.git, .venv) and build outputs left out."""
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = sorted(
            name
            for name in subfolders
            if not (name.startswith(".") or name in NOT_SOURCE or name.endswith(".egg-info"))
        )
        yield from (Path(folder, name).relative_to(ROOT) for name in sorted(files) if name.endswith(".py"))


def _lines(path: Path) -> int:
    return len((ROOT / path).read_text(encoding="utf-8").splitlines())


def test_no_python_file_passes_400_lines() -> None:
    long = {str(path): _lines(path) for path in _python_files() if _lines(path) > MAX_LINES}
    over = {path: n for path, n in long.items() if path not in ALLOWED}
    assert over == {}, f"split these along a seam (at most {MAX_LINES} lines a file): {over}"


def test_the_allow_list_holds_only_files_still_too_long() -> None:
    lines = {path: _lines(Path(path)) if (ROOT / path).is_file() else 0 for path in ALLOWED}
    short = {path: n for path, n in lines.items() if n <= MAX_LINES}
    assert short == {}, f"take these off ALLOWED: {short}"


def test_the_walk_sees_the_packages_and_the_tests() -> None:
    files = {str(path) for path in _python_files()}
    assert {"kvmem_core/store.py", "launcher/kvmem/cli.py", "tests/unit/test_file_length.py"} <= files
    assert not any(name.startswith(".venv/") for name in files)
