"""``kvmem bench``: benchmarks. ``speed``: agent-session speed (``kvmem_bench.speed``); ``quality``: answer accuracy;
``soak``: agent clients against one server for minutes with faults injected (``kvmem_bench.soak``)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
from types import ModuleType
from pathlib import Path
from typing import Any

from kvmem.cmd_run import BACKENDS
from kvmem.compute import add_compute_flags, compute_opts
from kvmem.models import MODEL_HELP
from kvmem_core.errors import ConfigError

SOAK_HELP = (
    "agent clients x turns against one live server with faults injected (engine SIGKILL, disk full, client "
    "disconnects): lost conversations, retries, recomputed blocks, peak RSS and disk against the budgets"
)
QUALITY_HELP = (
    "answer accuracy of retrieval, recent, the oracle and full on agent sessions, each view bounded from "
    "the first prefill"
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="benchmarks (speed, quality, soak)")
    suites = parser.add_subparsers(dest="suite", required=True)
    speed = suites.add_parser(
        "speed", help="agent-session speed: turn-N TTFT with reuse, decode vs workspace, transfers"
    )
    speed.add_argument("--backend", default="llama.cpp", choices=BACKENDS, help="engine backend (default: llama.cpp)")
    speed.add_argument(
        "--model",
        default=None,
        help=f"{MODEL_HELP}: the llama.cpp session, either backend's thread "
        "sweep, and the tokenizer and chat template of torch's random weights",
    )
    speed.add_argument("--shape", default=None, help="torch: random-weight qwen35 shape (27b on CUDA, tiny on CPU)")
    speed.add_argument(
        "--sizes",
        default=None,
        help="workspace sizes to measure, comma-separated tokens (default: the plan's; e.g. 16384,65536,262144; "
        "llama.cpp runs its dense baselines up to 16384)",
    )
    speed.add_argument(
        "--quick", action="store_true", help="smaller workspaces (llama.cpp: about 8 minutes on 2 CPU cores)"
    )
    speed.add_argument(
        "--default-knobs",
        action="store_true",
        help="the view a user gets (--kvmem-budget, --kvmem-gen-budget and the recent window at their defaults) "
        "instead of the plan's (torch: larger; llama.cpp --quick: smaller)",
    )
    speed.add_argument(
        "--out",
        type=Path,
        default=Path("bench-out/speed"),
        help="folder for speed.json and the PNG plots (default: bench-out/speed)",
    )
    speed.add_argument("--json", action="store_true", help="print the result as one JSON object on the last line")
    speed.add_argument(
        "--plot-from",
        nargs="+",
        type=Path,
        default=None,
        metavar="SPEED_JSON",
        help="instead: draw the plots of earlier runs' speed.json files (one size a run) together into --out",
    )
    speed.add_argument(
        "--replicas",
        type=int,
        default=None,
        metavar="N",
        help="instead: throughput of concurrent agent sessions on N engine replicas against one",
    )
    speed.add_argument("--sessions", type=int, default=8, help="--replicas: concurrent agent sessions (default 8)")
    speed.add_argument("--turns", type=int, default=4, help="--replicas: turns per session (default 4)")
    speed.add_argument("--gpus", default="", help="--replicas: GPU indexes, one per replica (default: the CPU, shared)")
    add_compute_flags(speed)
    speed.set_defaults(func=run_speed_cmd)
    quality = suites.add_parser("quality", add_help=False, help=QUALITY_HELP)
    quality.set_defaults(func=run_quality_cmd, passthrough=True)  # its flags live in kvmem_bench.quality_cli
    _add_soak(suites)


def _add_soak(suites: argparse._SubParsersAction) -> None:
    soak = suites.add_parser("soak", help=SOAK_HELP, description=SOAK_HELP)
    soak.add_argument("--model", default=None, help=f"{MODEL_HELP} (llama.cpp)")
    soak.add_argument("--clients", type=int, default=None, help="agent conversations at once (default 8; --quick 2)")
    soak.add_argument("--turns", type=int, default=None, help="turns per conversation (default 50; --quick 6)")
    soak.add_argument("--quick", action="store_true", help="2 clients x 6 turns (a few minutes on 2 CPU cores)")
    soak.add_argument(
        "--cpu-gb", type=float, default=None, help="the server's host tier budget in GiB (default 1; --quick 0.5)"
    )
    soak.add_argument(
        "--nvme-gb", type=float, default=None, help="the server's NVMe tier budget in GiB (default 1; --quick 0.5)"
    )
    soak.add_argument("--disk-full-s", type=float, default=None, help="how long the disk stays full (default 30)")
    soak.add_argument(
        "--turn-timeout-s",
        type=float,
        default=None,
        help="how long a turn is retried before its conversation counts as lost (default 300)",
    )
    soak.add_argument(
        "--disconnect-every",
        type=int,
        default=None,
        metavar="N",
        help="every Nth turn of a client is first a stream it drops (default 10; --quick 3; 0: none)",
    )
    soak.add_argument(
        "--out", type=Path, default=Path("bench-out/soak"), help="folder for soak.json (default: bench-out/soak)"
    )
    soak.add_argument("--json", action="store_true", help="print the result as one JSON object on the last line")
    soak.set_defaults(func=run_soak_cmd)


def run_soak_cmd(args: argparse.Namespace) -> int:
    """``kvmem bench soak``: the figures as lines, or one JSON object with ``--json``; the JSON in ``--out``."""
    soak = bench_module("soak")
    chosen = {"clients": args.clients, "turns": args.turns, "cpu_gb": args.cpu_gb, "nvme_gb": args.nvme_gb}
    chosen.update(disk_full_s=args.disk_full_s, disconnect_every=args.disconnect_every)
    chosen.update(turn_timeout_s=args.turn_timeout_s)
    plan = dataclasses.replace(
        soak.QUICK if args.quick else soak.SoakPlan(), **{k: v for k, v in chosen.items() if v is not None}
    )
    if plan.clients < 1 or plan.turns < 1:
        raise ConfigError("--clients and --turns take counts of 1 or more")
    if plan.turn_timeout_s <= 0:
        raise ConfigError("--turn-timeout-s takes a number of seconds above 0")
    log = (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else print
    result = soak.run(args.model, plan, log=log)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result) if args.json else soak.table(result))
    return 0


def bench_module(name: str) -> ModuleType:
    """``kvmem_bench.<name>``, imported only when a bench runs; a ConfigError (one line) when the package is absent."""
    try:
        return importlib.import_module(f"kvmem_bench.{name}")
    except ModuleNotFoundError as exc:
        if exc.name not in ("kvmem_bench", f"kvmem_bench.{name}"):
            raise
        raise ConfigError("kvmem bench needs the kvmem_bench package (pip install 'kvmem[bench]')") from None


def run_quality_cmd(args: argparse.Namespace) -> int:
    """``kvmem bench quality``: its flags are parsed here, from the words the top-level parser passed through."""
    quality_cli = bench_module("quality_cli")
    parser = argparse.ArgumentParser(prog="kvmem bench quality", description=QUALITY_HELP)
    quality_cli.add_arguments(parser)
    return quality_cli.run(parser.parse_args(args.extra))


def run_speed_cmd(args: argparse.Namespace) -> int:
    if args.replicas is not None:
        return run_replicas_cmd(args)
    if args.plot_from:
        return plot_runs_cmd(args.plot_from, args.out)
    run_speed, table = bench_module("speed").run_speed, bench_module("speed_common").table
    log = (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else print
    sizes = _sizes(args.sizes)
    if args.backend == "torch":
        opts = {"shape": args.shape, "tokenizer": args.model, "sizes": sizes, "default_knobs": args.default_knobs}
    elif sizes or args.default_knobs:
        opts = {"plan": bench_module("speed_llamacpp").resolve_plan(args.quick, sizes, args.default_knobs)}
    else:
        opts = {}
    result = run_speed(
        args.backend,
        args.model,
        quick=args.quick,
        out_dir=args.out,
        log=log,
        compute=compute_opts(args, args.backend),
        **opts,
    )
    if args.json:
        print(json.dumps(result))
        return 0
    print(table(result["points"]))
    for key in ("ttft_speedup", "decode_flatness", "host_vs_raw", "nvme_vs_raw"):
        value = result.get(key)
        print(f"{key:16s} {'not measured' if value is None else f'{value:.3f}'}")
    print(thread_table(result["threads"]))
    verdict = {None: "not measured", True: "met", False: "MISSED"}
    print("goals  " + "  ".join(f"{k}: {verdict[v]}" for k, v in result["goals"].items()))
    print("wrote  " + ", ".join(result.get("files", [])))
    return 0


def plot_runs_cmd(paths: list[Path], out_dir: Path) -> int:
    """``kvmem bench speed --plot-from A.json B.json``: the runs' points as one table and one set of plots."""
    common = bench_module("speed_common")
    try:
        merged = common.merge_runs(paths)
    except ValueError as exc:
        raise ConfigError(f"--plot-from: {exc}") from None
    out_dir.mkdir(parents=True, exist_ok=True)
    files = common.plot_speed(merged["points"], merged["backend"], out_dir)
    print(common.table(merged["points"]))
    print("wrote  " + ", ".join(str(p) for p in files))
    return 0


def _sizes(text: str | None) -> list[int] | None:
    """``--sizes``: positive token counts, comma-separated; a ``ConfigError`` naming the bad one otherwise."""
    if not text:
        return None
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"--sizes takes comma-separated token counts, got {text!r}") from None
    if not sizes or min(sizes) <= 0:
        raise ConfigError(f"--sizes takes positive token counts, got {text!r}")
    return sizes


def run_replicas_cmd(args: argparse.Namespace) -> int:
    """``kvmem bench speed --replicas N``: the table, or one JSON object with ``--json``; the JSON in ``--out``."""
    speed_replicas = bench_module("speed_replicas")
    if args.replicas < 2:
        raise ConfigError("--replicas compares N replicas against one: give N of 2 or more")
    log = (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else print
    gpus = [int(g) for g in args.gpus.split(",") if g.strip()]
    result = speed_replicas.run(
        args.model, args.replicas, sessions=args.sessions, turns=args.turns, gpus=gpus, threads=args.threads, log=log
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "replicas.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result) if args.json else speed_replicas.table(result))
    return 0


def thread_table(threads: dict[str, Any]) -> str:
    """Prefill and decode tok/s against the thread count, one row per count (or why the sweep did not run)."""
    if "skipped" in threads:
        return f"threads  not measured: {threads['skipped']}"
    lines = [
        f"threads on {threads['device']} ({threads['model']}, {threads['usable_cores']} usable cores)",
        "threads  prefill tok/s  decode tok/s",
    ]
    lines += [f"{r['threads']:7d}  {r['prefill_tok_s']:13.1f}  {r['decode_tok_s']:12.1f}" for r in threads["rows"]]
    if threads.get("busy"):
        lines.append(bench_module("speed_threads_busy").table(threads["busy"], threads.get("default_vs_best_fixed")))
    return "\n".join(lines)
