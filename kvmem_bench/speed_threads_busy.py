"""``kvmem bench speed``'s ``busy`` rows: llama.cpp decode with the default thread setting against fixed ones, on the
machine as it is and while a spinning process keeps one core busy.

Each candidate is a thread count (``KVMEM_THREADS``; unset: ``auto``, which follows the cores other processes leave
free, ``kvmem_core.thread_governor``) and a spin setting of llama.cpp's OpenMP threads (``GOMP_SPINCOUNT`` /
``OMP_WAIT_POLICY``, ``kvmem_llamacpp.openmp``). libgomp reads those once, when it loads, so each candidate runs in a
process of its own (``python -m kvmem_bench.speed_threads_busy --child``): it loads the model, decodes with the machine
as it is, starts a spinning process, decodes again, and prints its figures with the 1-minute load average before each.
The rounds run the candidates in a rotated order, so load that comes and goes on a shared machine falls on all of them.

    python -m kvmem_bench.speed_threads_busy --rounds 5       # only these rows (kvmem bench speed runs 3 rounds)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator

from kvmem_core.threads import THREADS_BATCH_ENV, THREADS_ENV, resolve_threads

CONDITIONS = ("as is", "one core busy")
SPIN_ENV, POLICY_ENV = "GOMP_SPINCOUNT", "OMP_WAIT_POLICY"  # libgomp's, as kvmem_llamacpp.openmp sets them
LIBGOMP_SPIN = "300000"  # libgomp's own spin count (about 3 ms), what llama.cpp's threads did before
DEFAULT = "auto"  # the candidate that is the engine's default: nothing set


def candidates(cores: int) -> list[tuple[str, dict[str, str]]]:
    """(label, environment) of each setting compared: the default first, then the others; a label that starts
    with a number is a fixed count."""
    long_spin = {SPIN_ENV: LIBGOMP_SPIN}
    every = {THREADS_ENV: str(cores)}
    found = [
        (DEFAULT, {}),
        ("auto, spin 300000", long_spin),
        (f"{cores}", every),
        (f"{cores}, spin 300000", {**every, **long_spin}),
        (f"{cores}, passive", {**every, POLICY_ENV: "passive"}),
    ]
    return found + ([("1", {THREADS_ENV: "1"})] if cores > 1 else [])


def busy_rows(
    model_path: str, *, decode: int, rounds: int, cores: int, run_child: Callable[..., dict[str, Any]] | None = None
) -> dict[str, Any]:
    """``rows`` of ``{condition, threads, decode_tok_s, load_1min}`` (one figure per round, in round order) and
    ``default_vs_best_fixed``: per condition, the default's median over the best fixed candidate's median."""
    run_child = run_child or child_figures
    settings = candidates(cores)
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in settings}
    for r in range(rounds):
        shift = r % len(settings)
        for label, env in settings[shift:] + settings[:shift]:
            runs[label].append(run_child(model_path, env, decode=decode))
    rows = [
        {
            "condition": condition,
            "threads": label,
            "decode_tok_s": [run[condition] for run in runs[label]],
            "load_1min": [run["load_1min"][condition] for run in runs[label]],
        }
        for condition in CONDITIONS
        for label, _ in settings
    ]
    return {"rows": rows, "default_vs_best_fixed": default_vs_best_fixed(rows)}


def default_vs_best_fixed(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Per condition: the median decode tok/s of the default over that of the best fixed count (1.0: as fast)."""
    out = {}
    for condition in CONDITIONS:
        medians = {r["threads"]: statistics.median(r["decode_tok_s"]) for r in rows if r["condition"] == condition}
        best_fixed = max(v for label, v in medians.items() if label[0].isdigit())
        out[condition] = round(medians[DEFAULT] / best_fixed, 3)
    return out


def child_figures(model_path: str, env: dict[str, str], *, decode: int) -> dict[str, Any]:
    """Run one candidate in a fresh process with ``env`` over this one's environment (less every thread and spin
    variable); its figures."""
    base = {k: v for k, v in os.environ.items() if k not in (THREADS_ENV, THREADS_BATCH_ENV, SPIN_ENV, POLICY_ENV)}
    cmd = [sys.executable, "-m", "kvmem_bench.speed_threads_busy", "--child", model_path, str(decode)]
    done = subprocess.run(cmd, env={**base, **env}, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"busy rows: {' '.join(cmd)} failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@contextmanager
def one_core_busy() -> Iterator[subprocess.Popen]:
    """A process that spins on one core for as long as the block runs."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)  # running, and seen by the governor's next look
        yield spinner
    finally:
        spinner.kill()
        spinner.wait()


def measure_here(model_path: str, decode: int) -> dict[str, Any]:
    """This process's figures: decode tok/s (best of 2 rounds, 32-token prompt) with the machine as it is, then
    with one core busy, at the thread setting the environment gives; the 1-minute load average before each."""
    from kvmem_bench.speed_threads import CONFIG, measure
    from kvmem.engines import adapter_factory

    adapter = adapter_factory("llama.cpp")(model_path, CONFIG)
    figures: dict[str, Any] = {"load_1min": {}}
    try:
        measure(adapter, resolve_threads(), prompt=32, decode=4, rounds=1)  # warm: weights paged in, buffers made
        for condition in CONDITIONS:
            with one_core_busy() if condition != "as is" else nullcontext():
                figures["load_1min"][condition] = round(os.getloadavg()[0], 2)
                row = measure(adapter, resolve_threads(), prompt=32, decode=decode, rounds=2)
                figures[condition] = row["decode_tok_s"]
    finally:
        adapter.close()
    return figures


def table(rows: list[dict[str, Any]], ratios: dict[str, float] | None) -> str:
    """The busy rows as text: one line per condition and candidate, each round's tok/s and load average."""
    lines = ["machine        threads            decode tok/s (each round)   load average (1 min)"]
    lines += [
        f"{r['condition']:13s}  {r['threads']:17s}  {' '.join(f'{v:5.1f}' for v in r['decode_tok_s']):26s}"
        f"  {' '.join(f'{v:.2f}' for v in r['load_1min'])}"
        for r in rows
    ]
    if ratios:
        lines.append("default / best fixed (medians): " + ", ".join(f"{c} {v:.2f}" for c, v in ratios.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """``--child MODEL DECODE``: one candidate's figures as JSON (what ``child_figures`` runs); otherwise the busy
    rows of ``--model`` (default: the default model) as a table, or JSON with ``--json``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m kvmem_bench.speed_threads_busy")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "DECODE"))
    parser.add_argument("--model", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure_here(args.child[0], int(args.child[1]))))
        return
    from kvmem.models import resolve_model
    from kvmem_core.threads import usable_cores

    busy = busy_rows(str(resolve_model(args.model)), decode=args.decode, rounds=args.rounds, cores=usable_cores())
    print(json.dumps(busy) if args.json else table(busy["rows"], busy["default_vs_best_fixed"]))


if __name__ == "__main__":
    main()
