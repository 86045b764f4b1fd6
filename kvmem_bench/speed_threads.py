"""Prefill and decode speed against the CPU thread count (``kvmem bench speed``'s ``threads`` section).

One adapter is loaded once; for each count, its threads are switched (``set_threads``), a
prompt is prefilled into an empty view and single tokens are decoded after it. The best of
a few rounds is kept (the machine may be shared). With every layer on a GPU the CPU threads
mostly feed the device, so the rows there show how little they matter.

The ``busy`` rows (llama.cpp, ``kvmem_bench.speed_threads_busy``) compare decode with the default
thread setting against fixed ones, on the machine as it is and while a spinning process keeps one
core busy: llama.cpp's threads meet at a barrier after every operation, so a setting whose threads
hold the cores while they wait collapses.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from kvmem_core.config import KVMemConfig
from kvmem_core.errors import ConfigError, UnsupportedModelError
from kvmem_core.threads import Threads, usable_cores

TEXT = "The relay station logged every packet, its source, its size and the time it took to arrive. "
CONFIG = KVMemConfig(ctx=4096, budget=1536, gen_budget=512)


def thread_counts(cores: int) -> list[int]:
    """1, 2, 4, ... below ``cores``, then ``cores`` itself."""
    counts, n = [], 1
    while n < cores:
        counts.append(n)
        n *= 2
    return counts + [cores]


def run(
    backend: str, model: str | None, opts: dict[str, Any], *, quick: bool, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Rows of ``{threads, prefill_tok_s, decode_tok_s}`` for every count up to the usable cores, on ``model``
    (a known model's name or a path; None: the default model); ``skipped`` with the reason instead when the
    backend cannot load it."""
    from kvmem.engines import adapter_factory
    from kvmem.models import resolve_model

    path = resolve_model(model)
    try:
        adapter = adapter_factory(backend)(str(path), CONFIG, **opts)
    except (UnsupportedModelError, ConfigError) as exc:  # a tokenizer-only GGUF (the torch bench's), a backend not
        log(f"threads: not measured ({exc})")  # installed (a source tree on PYTHONPATH): the session's figures stand
        return {"model": path.name, "skipped": str(exc)}
    try:
        rows = [
            measure(adapter, n, prompt=256 if quick else 1024, decode=16 if quick else 64, rounds=2)
            for n in thread_counts(usable_cores())
        ]
        device = adapter.caps.devices[0]
    finally:
        adapter.close()
    result = {"model": path.name, "device": device, "usable_cores": usable_cores(), "rows": rows}
    if backend == "llama.cpp":
        from kvmem_bench.speed_threads_busy import busy_rows

        busy = busy_rows(str(path), decode=16 if quick else 32, rounds=1 if quick else 3, cores=usable_cores())
        result.update(busy=busy["rows"], default_vs_best_fixed=busy["default_vs_best_fixed"])
    for row in rows:
        log(
            f"threads {row['threads']:3d}: prefill {row['prefill_tok_s']:.1f} tok/s, "
            f"decode {row['decode_tok_s']:.1f} tok/s"
        )
    for row in result.get("busy", []):
        speed = f"decode {row['decode_tok_s']} tok/s (load {row['load_1min']})"
        log(f"{row['condition']}: threads {row['threads']}: {speed}")
    return result


def measure(adapter: Any, n: int | Threads, *, prompt: int, decode: int, rounds: int) -> dict[str, Any]:
    """Best-of-``rounds`` prefill and decode tok/s of ``adapter`` with ``n`` threads for both (or those counts)."""
    threads = n if isinstance(n, Threads) else Threads(n, n)
    adapter.set_threads(threads)
    ids = (adapter.tokenize(TEXT * (prompt // 16 + 1)))[:prompt]
    prefill, steps = [], []
    for _ in range(rounds):
        adapter.clear_view()
        t0 = time.perf_counter()
        _ = adapter.forward(ids, list(range(len(ids)))).logits  # a forward may return before the device is done
        prefill.append(len(ids) / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        for i in range(decode):
            _ = adapter.forward([ids[i]], [len(ids) + i]).logits
        steps.append(decode / (time.perf_counter() - t0))
    adapter.clear_view()
    return {
        "threads": threads.decode,
        "prefill_tok_s": round(max(prefill), 1),
        "decode_tok_s": round(max(steps), 1),
        "prompt_tokens": len(ids),
        "decode_tokens": decode,
    }
