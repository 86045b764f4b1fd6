"""In CI a skip for something missing fails the run; elsewhere it stays a skip; every test has a time limit."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
SKIPPING = """
import pytest

def test_needs_a_browser():
    pytest.skip("chromium is not installed (apt-get install chromium)")

def test_needs_a_gpu():
    pytest.skip("needs a GPU build of llama-cpp-python and a GPU")

def test_passes():
    pass
"""
IMPORT_SKIP = 'import pytest\n\npytest.importorskip("kvmem_no_such_package")\n\ndef test_never_runs():\n    pass\n'


def run_suite(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess[str]:
    """pytest on two small modules beside copies of the real conftest and skip policy."""
    for name in ("conftest.py", "skip_policy.py"):
        shutil.copy(TESTS / name, tmp_path / name)
    (tmp_path / "test_skips.py").write_text(SKIPPING)
    (tmp_path / "test_import_skip.py").write_text(IMPORT_SKIP)
    env = {k: v for k, v in os.environ.items() if k != "CI"} | ({} if ci is None else {"CI": ci})
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rfEs",
            "-p",
            "no:cacheprovider",
            "--continue-on-collection-errors",
            "--rootdir",
            str(tmp_path),
            str(tmp_path),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_in_ci_a_missing_browser_or_package_fails_but_a_missing_gpu_skips(tmp_path: Path) -> None:
    done = run_suite(tmp_path, "true")
    assert done.returncode == 1, done.stdout
    assert "FAILED test_skips.py::test_needs_a_browser" in done.stdout
    assert "ERROR test_import_skip.py" in done.stdout and "kvmem_no_such_package" in done.stdout
    assert "1 failed, 1 passed, 1 skipped, 1 error" in done.stdout


@pytest.mark.parametrize("ci", [None, "false"])
def test_outside_ci_skips_stay_skips(tmp_path: Path, ci: str | None) -> None:
    done = run_suite(tmp_path, ci)
    assert done.returncode == 0, done.stdout
    assert "1 passed, 3 skipped" in done.stdout


def test_every_test_has_a_time_limit_of_minutes(pytestconfig: pytest.Config) -> None:
    assert pytestconfig.pluginmanager.hasplugin("timeout"), "pytest-timeout is part of the test extra"
    assert 60 <= float(pytestconfig.getini("timeout")) <= 300
