"""In CI (``CI=true``) a test skipped because something is missing -- a model, Chromium, an optional
package -- fails instead, so a green CI run is a run of the whole suite.

Skips for what a CI machine legitimately lacks (a GPU, a second network interface) stay skips:
only the reasons below count as missing. ``pytest.importorskip`` says ``could not import``, a known
model's ``ModelNotFoundError`` says ``is not installed``, and so does the Chromium check.
"""

from __future__ import annotations

import os
import re
from typing import Any, Mapping

import pytest

MISSING = re.compile(r"could not import|is not installed|No module named")
TRUE = ("1", "true", "yes", "on")


def in_ci(env: Mapping[str, str] | None = None) -> bool:
    """True when ``CI`` holds a true value (GitHub Actions, GitLab and most others set ``CI=true``)."""
    return (os.environ if env is None else env).get("CI", "").strip().lower() in TRUE


def skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str | None:
    """The reason of a skipped report (pytest keeps it as ``(path, line, "Skipped: reason")``), else None."""
    if not report.skipped or not isinstance(report.longrepr, tuple):
        return None
    return str(report.longrepr[2]).removeprefix("Skipped: ")


def fail_missing(report: Any, env: Mapping[str, str] | None = None) -> None:
    """Turn ``report`` into a failure when CI is on and it was skipped for something missing."""
    reason = skip_reason(report)
    if reason is not None and in_ci(env) and MISSING.search(reason):
        report.outcome = "failed"
        report.longrepr = f"CI=true and this was skipped for something missing (install it): {reason}"
