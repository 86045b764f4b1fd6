"""Shared test setup: one compute thread per process (threads of one process share a vCPU here), and in CI a
skip for a missing model, browser or package is a failure (``skip_policy``)."""

from __future__ import annotations

import os
from typing import Iterator

import pytest

from skip_policy import fail_missing

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("KVMEM_THREADS", "1")  # engines default to every usable core; the tests pin one
os.environ.setdefault("KVMEM_THREADS_BATCH", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    fail_missing(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    fail_missing(outcome.get_result())


@pytest.fixture(scope="module")
def gpu_layers() -> int:
    """llama.cpp layers the reference tests offload: none (CPU); modules under tests/gpu override it with -1 (all)."""
    return 0
