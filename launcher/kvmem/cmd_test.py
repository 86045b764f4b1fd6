"""``kvmem test``: the project's test suite (``--slow`` adds the long checks; other arguments go to pytest).

Each test has pytest-timeout's limit from pyproject.toml (5 minutes); ``--slow`` raises it to 30 for the long checks.
Test files run in parallel on up to ``MAX_WORKERS`` of the usable cores (pytest-xdist, one file to one worker, so a
module's fixtures start once); tests marked ``serial`` (they read wall-clock costs, which other workers would move)
run after that pass, in one process. ``-n`` among the other arguments runs everything in one pass as it says.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parents[2] / "tests"
SLOW_TIMEOUT_S = 1800
MAX_WORKERS = 4  # each worker runs engines on one thread; more would mostly add model loads


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
    parallel = workers(args.extra)
    passes = [(" and not serial", parallel), (" and serial", [])] if parallel else [("", [])]
    return combined(
        [pytest.main([str(TESTS_DIR), "-m", marker + which, *limit, *xdist, *args.extra]) for which, xdist in passes]
    )


def combined(codes: list[int]) -> int:
    """One exit code for several pytest passes: the first failure's; 1 where no pass collected a test."""
    import pytest

    empty = pytest.ExitCode.NO_TESTS_COLLECTED
    failed = [c for c in codes if c not in (0, empty)]
    return int(failed[0]) if failed else int(all(c == empty for c in codes))


def workers(extra: list[str]) -> list[str]:
    """pytest-xdist's arguments for the usable cores (none where it is missing, one core is usable, or ``extra``
    names its own ``-n``)."""
    cores = min(MAX_WORKERS, len(os.sched_getaffinity(0)))
    chosen = any(a.startswith(("-n", "--numprocesses")) for a in extra)
    if chosen or cores < 2 or importlib.util.find_spec("xdist") is None:
        return []
    return ["-n", str(cores), "--dist", "loadfile"]
