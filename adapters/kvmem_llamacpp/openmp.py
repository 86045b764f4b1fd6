"""How long llama.cpp's threads spin before they sleep, set before its OpenMP runtime loads.

llama-cpp-python's Linux builds compute with OpenMP (``llama_print_system_info``: ``OPENMP = 1``);
there ggml's barrier after every operation of a step is ``#pragma omp barrier``, and ggml's own
threadpool settings (``poll``) are not read. A thread that reaches the barrier first spins there
for libgomp's ``GOMP_SPINCOUNT`` rounds (300,000 unless set: about 3 ms) before it sleeps. While
another process keeps a core busy, the thread that shares that core waits for its turn for
milliseconds, and the one that spins meanwhile holds the other core, which the scheduler could
otherwise have handed to the waiting thread: decode collapses (``kvmem bench speed``'s ``busy``
rows). A short spin (``SPIN_ROUNDS``, some microseconds) costs a quiet machine nothing measurable,
and lets a waiting thread give its core up.

libgomp reads its environment once, when it is loaded (with ``llama_cpp``), so this runs when
``kvmem_llamacpp`` is imported. A ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` already set wins.
"""

from __future__ import annotations

import logging
import os
from typing import Mapping, MutableMapping

SPIN_ENV, POLICY_ENV = "GOMP_SPINCOUNT", "OMP_WAIT_POLICY"
SPIN_ROUNDS = 300
log = logging.getLogger("kvmem.llamacpp")


def spin_settings(env: Mapping[str, str]) -> dict[str, str]:
    """The OpenMP variables to add to ``env``: a short ``GOMP_SPINCOUNT``, or none where the user set the spin
    count or the wait policy."""
    if env.get(SPIN_ENV) or env.get(POLICY_ENV):
        return {}
    return {SPIN_ENV: str(SPIN_ROUNDS)}


def openmp_loaded(maps_path: str = "/proc/self/maps") -> bool:
    """Whether this process has loaded libgomp already (Linux; False where that cannot be read)."""
    try:
        with open(maps_path) as f:
            return "libgomp" in f.read()
    except OSError:
        return False


def set_spin_default(env: MutableMapping[str, str] = os.environ) -> None:
    """Put ``spin_settings`` into the environment, which libgomp reads when it loads; a warning when it has
    loaded already (something imported ``llama_cpp`` or another OpenMP library first), since the setting then
    takes effect only in processes started from here."""
    settings = spin_settings(env)
    env.update(settings)
    if settings and openmp_loaded():
        log.warning(
            "OpenMP was loaded before kvmem_llamacpp: llama.cpp's threads keep libgomp's long spin "
            "(set %s=%d before starting Python to shorten it)",
            SPIN_ENV,
            SPIN_ROUNDS,
        )
