"""Shared test setup: one compute thread per process (threads of one process share a vCPU here)."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("KVMEM_THREADS", "1")  # engines default to every usable core; the tests pin one
os.environ.setdefault("KVMEM_THREADS_BATCH", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def gpu_layers() -> int:
    """llama.cpp layers the reference tests offload: none (CPU); modules under tests/gpu override it with -1 (all)."""
    return 0
