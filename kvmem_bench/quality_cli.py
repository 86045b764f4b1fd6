"""The ``kvmem bench quality`` command: flags, the run, and what it writes (``quality.json``, plots, tables).

Every result names what produced it (``meta``): plan and split, engine, dtype, each view's server flags, the
commit, the machine and the command that re-runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvmem_bench import plots, report
from kvmem_bench.api import Api
from kvmem_bench.provenance import run_meta
from kvmem_bench.quality import Journal, RunOptions, run_queues
from kvmem_bench.quality_plan import PLANS, Plan, Queue, View, fit_kinds, only_sizes, parse_shards, plan_named, queues
from kvmem.serve_process import ServeProcess, sigterm_as_interrupt
from kvmem_core.errors import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``kvmem bench quality``."""
    from kvmem.models import MODEL_HELP

    plans = "; ".join(f"{name}: {plan.note}" for name, plan in PLANS.items())
    p.add_argument("--plan", default="report", help=f"what to run ({plans}; default report)")
    p.add_argument("--quick", action="store_true", help="the same as --plan quick")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object on the last line")
    p.add_argument("--url", help="benchmark this running server as the default view (no other view runs)")
    p.add_argument(
        "--api-key", default=os.environ.get("KVMEM_API_KEY"), help="bearer key for --url (env KVMEM_API_KEY)"
    )
    p.add_argument("--out", type=Path, default=Path("bench-out/quality"), help="folder for JSON and plots")
    p.add_argument("--model", help=f"model of the servers this command starts: {MODEL_HELP}")
    p.add_argument(
        "--backend",
        choices=("llama.cpp", "torch"),
        help="engine of the servers this command starts (default: kvmem serve's choice)",
    )
    p.add_argument("--seed", type=int, default=0, help="plan seed within the plan's split (default 0)")
    p.add_argument("--sizes", help="comma-separated workspace sizes of the plan to run (default: all)")
    p.add_argument("--views", help="comma-separated views to run: default,1/8,full (default: all)")
    p.add_argument("--limit", type=int, help="run only the first N sessions of each size (they cover the kinds evenly)")
    p.add_argument("--parallel", type=int, default=1, help="servers that run at once (default 1)")
    p.add_argument("--shards", help="split a size's sessions over several servers per view, e.g. 262144=4")
    p.add_argument(
        "--deadline", type=float, help="seconds after which no new session starts (the run then writes what finished)"
    )
    p.add_argument(
        "--change",
        default="",
        help="kvmem serve flags every server of the run gets, e.g. "
        '"--kvmem-groups off" or "--kvmem-retrieval-method mean-k": the change the run measures against a '
        "run without it (quality.json names it)",
    )
    p.add_argument(
        "--chars-per-token",
        help="the tokenizer's fit per kind for sizing sessions, as a JSON object "
        "(default: measured on a short-lived server; quality.json's meta records it)",
    )
    p.add_argument("--resume", action="store_true", help="keep --out's outcomes.jsonl and run only what it lacks")


def run(args: argparse.Namespace) -> int:
    """Run the plan as the flags ask; write ``quality.json`` and plots; print the tables (and the JSON line).

    Exit 0 when every queue ran to its end (errors are outcomes, counted wrong), 130 when interrupted or stopped
    at ``--deadline`` with sessions left."""
    plan = _plan(args)
    args.out.mkdir(parents=True, exist_ok=True)
    journal = Journal(args.out / "outcomes.jsonl", args.resume)
    deadline = None if args.deadline is None else time.monotonic() + args.deadline
    opts = RunOptions(
        args.out, args.model, args.backend, deadline, args.url, args.api_key, tuple(shlex.split(args.change))
    )
    trained, cpt = _model_facts(args, opts)
    work = _queues(args, plan, trained, cpt)
    with sigterm_as_interrupt():
        finished = run_queues(work, opts, journal, args.parallel)
    complete = finished and all(journal.has(q, s) for q in work for s in q.sessions)
    return _write(args, plan, work, journal.outcomes, trained, cpt, complete)


def _plan(args: argparse.Namespace) -> Plan:
    plan = plan_named("quick" if args.quick else args.plan)
    return only_sizes(plan, args.sizes) if args.sizes else plan


def _queues(args: argparse.Namespace, plan: Plan, trained: int, cpt: dict[str, float]) -> list[Queue]:
    sessions = {c.size: plan.sessions(c, args.seed, cpt)[: args.limit] for c in plan.cells}
    work = queues(plan, trained, sessions, parse_shards(args.shards))
    if args.url:
        return [Queue(q.cell, View("default", None), 0, q.sessions) for q in work if q.view.label == "default"]
    wanted = set(args.views.split(",")) if args.views else None
    if wanted and not wanted <= {"default", "1/8", "full"}:
        raise ConfigError(f"--views: choose from default, 1/8, full (got {args.views})")
    return [q for q in work if wanted is None or q.view.label in wanted]


def _model_facts(args: argparse.Namespace, opts: RunOptions) -> tuple[int, dict[str, float]]:
    """The model's trained context and its tokenizer's fit per kind for sizing sessions (``--chars-per-token``, else
    measured on a short-lived server or ``--url``'s)."""
    given = _fits_flag(args.chars_per_token)
    if args.url:
        return 1 << 30, given or fit_kinds(Api(args.url, args.api_key).count_tokens)
    trained = trained_context(args.model or os.environ.get("KVMEM_MODEL"))
    if given:
        return trained, given
    with ServeProcess(args.out / "servers" / "probe", opts.server_flags(View("probe", None))) as server:
        return trained, fit_kinds(Api(server.url).count_tokens)


def _fits_flag(value: str | None) -> dict[str, float] | None:
    """``--chars-per-token``: a JSON object {kind: chars per token} (as quality.json's meta records it)."""
    if not value:
        return None
    try:
        fits = json.loads(value)
        if isinstance(fits, dict) and all(isinstance(v, (int, float)) and v > 0 for v in fits.values()):
            return {str(k): float(v) for k, v in fits.items()}
    except ValueError:
        pass
    raise ConfigError(f"--chars-per-token: {value[:80]!r} is not a JSON object of kind: chars per token")


def trained_context(model: str | None) -> int:
    """The context ``model`` (a name, file or folder; None: the default) was trained on: GGUF
    ``{arch}.context_length`` or config.json's ``max_position_embeddings``, as the engines read it."""
    from kvmem.models import resolve_model

    path = resolve_model(model)
    if path.is_dir():
        config = json.loads((path / "config.json").read_text())
        return int(config.get("text_config", config)["max_position_embeddings"])
    from kvmem_core.gguf_file import GGUFFile

    gguf = GGUFFile(path)
    try:
        return int(gguf.meta[f"{gguf.meta['general.architecture']}.context_length"])
    finally:
        gguf.close()


def meta(
    args: argparse.Namespace, plan: Plan, work: list[Queue], trained: int, cpt: dict[str, float]
) -> dict[str, Any]:
    """What produced the numbers: plan, split and seed, engine, dtype, every view's server flags, commit,
    machine, and the command that re-runs the run."""
    opts = RunOptions(args.out, args.model, args.backend, change=tuple(shlex.split(args.change)))
    views = {f"{q.cell.size}/{q.view.label}": " ".join(["kvmem serve", *opts.server_flags(q.view)]) for q in work}
    return {
        "plan": plan.name,
        "split": plan.split,
        "seed": args.seed,
        "note": plan.note,
        "engine": args.backend or "kvmem serve's choice",
        "dtype": os.environ.get("KVMEM_DTYPE", "auto"),
        "model": args.model or os.environ.get("KVMEM_MODEL") or "the default model",
        "servers": views,
        "change": args.change or "none: default knobs",
        "trained_ctx": trained,
        "chars_per_token": cpt,
        **run_meta("quality", ("--plan", plan.name)),
    }


def _write(
    args: argparse.Namespace,
    plan: Plan,
    work: list[Queue],
    outcomes: list[dict[str, Any]],
    trained: int,
    cpt: dict[str, float],
    complete: bool,
) -> int:
    info = meta(args, plan, work, trained, cpt)
    result = {"meta": info, "results": report.rows(outcomes), "summary": report.summary(outcomes)}
    detail = {**result, "complete": complete, "plan": asdict(plan), "outcomes": outcomes}
    (args.out / "quality.json").write_text(json.dumps(detail, indent=1))
    if outcomes:
        plots.plot_quality(outcomes, args.out, trained)
    print(report.table(outcomes))
    print(f"wrote {args.out}/quality.json" + ("" if complete else " (incomplete: --resume continues it)"))
    if args.json:
        print(json.dumps(result))
    return 0 if complete else 130
