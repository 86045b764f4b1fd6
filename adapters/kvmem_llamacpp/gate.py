"""A native front for the query-capture eval callback.

llama.cpp asks the eval callback about every node of every graph it computes (936 nodes per
decode step of SmolLM2-135M), and each call into Python costs about 0.2 µs. On a CPU that is
~3% of a decode step; on a GPU, where a step of a small model takes a millisecond or two,
it is far more. The C function below answers "not needed" without entering Python unless
capture is armed and the node is a ``Qcur-*`` tensor. It is compiled once with the system C
compiler (the one llama-cpp-python was built with) into the user cache; without a compiler
the Python callback is installed directly: same results, slower decode.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path
from typing import Callable

import llama_cpp as L

from kvmem_core.paths import cache_root
from kvmem_llamacpp.ggml import GgmlTensor

log = logging.getLogger("kvmem.llamacpp")

SOURCE = r"""
#include <stdbool.h>
#include <stddef.h>
#include <string.h>

typedef bool (*eval_cb)(void * tensor, bool ask, void * user_data);

struct gate {
    volatile int armed;  /* written by Python between llama_decode calls */
    size_t name_offset;  /* offsetof(struct ggml_tensor, name) */
    eval_cb inner;       /* the Python callback */
};

bool kvmem_gate(void * tensor, bool ask, void * user_data) {
    const struct gate * g = user_data;
    if (!g->armed || strncmp((const char *) tensor + g->name_offset, "Qcur-", 5) != 0) {
        return !ask;
    }
    return g->inner(tensor, ask, NULL);
}
"""

PyEval = Callable[[int, bool, int], bool]


class _GateState(ctypes.Structure):
    _fields_ = [
        ("armed", ctypes.c_int),
        ("name_offset", ctypes.c_size_t),
        ("inner", L.ggml_backend_sched_eval_callback),
    ]


class EvalGate:
    """The ``cb_eval`` / ``cb_eval_user_data`` pair for a context; ``armed`` lets ``Qcur-*`` nodes reach ``inner``.

    ``inner`` must itself ignore calls while disarmed (the Python fallback calls it for every node).
    """

    def __init__(self, inner: PyEval) -> None:
        self._inner = L.ggml_backend_sched_eval_callback(inner)  # kept alive as long as the context
        lib = native_library()
        self.native = lib is not None
        self._state = _GateState(0, GgmlTensor.name.offset, self._inner)
        self.callback = L.ggml_backend_sched_eval_callback(("kvmem_gate", lib)) if lib is not None else self._inner
        self.user_data = ctypes.cast(ctypes.pointer(self._state), ctypes.c_void_p) if lib is not None else None

    @property
    def armed(self) -> bool:
        return bool(self._state.armed)

    @armed.setter
    def armed(self, value: bool) -> None:
        self._state.armed = int(value)


def cache_dir() -> Path:
    return cache_root() / "native"


@cache
def native_library() -> ctypes.CDLL | None:
    """The compiled gate (built on first use, keyed by its source), or None when no C compiler works."""
    path = cache_dir() / f"kvmem_gate-{hashlib.sha256(SOURCE.encode()).hexdigest()[:12]}.so"
    if not path.is_file() and not _compile(path):
        return None
    lib = ctypes.CDLL(str(path))
    lib.kvmem_gate.restype = ctypes.c_bool
    return lib


def _compile(path: Path) -> bool:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        log.warning("no C compiler found: query capture falls back to a Python eval callback (slower decode)")
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        src, out = Path(tmp) / "gate.c", Path(tmp) / path.name
        src.write_text(SOURCE)
        done = subprocess.run(
            [compiler, "-O2", "-shared", "-fPIC", "-o", str(out), str(src)], capture_output=True, text=True
        )
        if done.returncode != 0:
            log.warning("compiling the eval gate failed (%s): Python eval callback instead", done.stderr.strip()[:200])
            return False
        os.replace(out, path)  # atomic: a concurrent process sees no half-written library
    return True
