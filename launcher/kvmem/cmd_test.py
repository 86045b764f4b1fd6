"""``kvmem test``: the project's test suite (``--slow`` adds the long checks; other arguments go to pytest).

Each test has pytest-timeout's limit from pyproject.toml (5 minutes); ``--slow`` raises it to 30 for the long checks.
"""

from __future__ import annotations

import argparse
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parents[2] / "tests"
SLOW_TIMEOUT_S = 1800


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("test", help="run the test suite (everything not marked slow)")
    parser.add_argument("--slow", action="store_true", help="also run tests marked slow")
    parser.set_defaults(func=run, passthrough=True)


def run(args: argparse.Namespace) -> int:
    """Run pytest on the checkout's tests; zero collected tests is a failure."""
    import pytest

    if not TESTS_DIR.is_dir():
        print(f"kvmem test: no tests folder at {TESTS_DIR} (run from a source checkout)")
        return 2
    marker = "not gpu" if args.slow else "not slow and not gpu"
    limit = ["-o", f"timeout={SLOW_TIMEOUT_S}"] if args.slow else []
    code = pytest.main([str(TESTS_DIR), "-m", marker, *limit, *args.extra])
    return 1 if code == pytest.ExitCode.NO_TESTS_COLLECTED else int(code)
