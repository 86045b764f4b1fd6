"""How many CPU threads an engine computes with.

``--threads`` (env ``KVMEM_THREADS``) is for one-token decode steps, ``--threads-batch``
(env ``KVMEM_THREADS_BATCH``) for prefill batches. Unset, both are the cores this process
may run on (``os.sched_getaffinity``, so a container's or ``taskset``'s limit counts, not
the machine's core count), and ``auto``: the engine then follows the cores other processes
leave free (``kvmem_core.thread_governor``). Adapters resolve an unset count here too, so an
environment variable pins every engine a process tree starts (the tests pin 1).
"""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence, TypeVar

from kvmem_core.errors import ConfigError

T = TypeVar("T")
R = TypeVar("R")
THREADS_ENV = "KVMEM_THREADS"
THREADS_BATCH_ENV = "KVMEM_THREADS_BATCH"


@dataclass(frozen=True)
class Threads:
    """Resolved thread counts: ``decode`` for one-token steps, ``batch`` for prefill; ``auto`` when neither was
    given, so both may follow the cores other processes leave free, up to ``decode``."""

    decode: int
    batch: int
    auto: bool = False


def usable_cores() -> int:
    """The CPU cores this process may be scheduled on (at least 1)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # platforms without affinity masks (macOS)
        return max(1, os.cpu_count() or 1)


@functools.cache
def worker_pool(workers: int) -> ThreadPoolExecutor:
    """A process-wide pool of ``workers`` threads for host work split into pieces (numpy releases the GIL in its
    loops): scoring chunks, rotating blocks. One per count, kept for the process's life."""
    return ThreadPoolExecutor(workers, thread_name_prefix=f"kvmem-work{workers}")


def map_on(workers: int, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """``[fn(x) for x in items]``, in order, on ``worker_pool(workers)`` when ``workers`` > 1 and there is more than
    one item."""
    if workers > 1 and len(items) > 1:
        return list(worker_pool(workers).map(fn, items))
    return [fn(x) for x in items]


def parse_count(text: str, what: str) -> int:
    """A positive thread count from text; ConfigError naming ``what`` otherwise."""
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{what} must be a whole number of threads, got {text!r}") from None
    if value < 1:
        raise ConfigError(f"{what} must be at least 1, got {value}")
    return value


def resolve_threads(
    threads: int | None = None, threads_batch: int | None = None, env: Mapping[str, str] | None = None
) -> Threads:
    """Explicit counts win, then ``KVMEM_THREADS`` / ``KVMEM_THREADS_BATCH``, then every usable core (``auto``
    when both are unset); an unset batch count follows the decode count. ConfigError on a count below 1."""
    env = os.environ if env is None else env
    given_decode = _pick(threads, env.get(THREADS_ENV), THREADS_ENV)
    given_batch = _pick(threads_batch, env.get(THREADS_BATCH_ENV), THREADS_BATCH_ENV)
    decode = given_decode or usable_cores()
    return Threads(decode, given_batch or decode, auto=given_decode is None and given_batch is None)


def _pick(value: int | None, text: str | None, what: str) -> int | None:
    if value is not None:
        return parse_count(str(value), what)
    return parse_count(text, what) if text else None
