"""``kvmem bench quality``: exact-match accuracy of every selection method on one shared workspace.

Each session is prefilled once, by the first method's request; every other method then
answers the same question on the same stored workspace through the per-request ``kvmem``
override (a step that scores recomputes the question itself, so each retrieval scorer
reads the question's own query features). Diagnostics: the blocks that hold the answer
(located with ``/tokenize``), whether each selection took them all, and the *oracle*: the
answer when the selection is forced to hold them (``kvmem.blocks``).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kvmem.bench import plots, report
from kvmem.bench.api import Api, ApiError
from kvmem.bench.quality_plan import (
    FULL,
    GEN_RESERVE,
    METHODS,
    ORACLE,
    QUICK,
    QUICK_METHODS,
    Method,
    Phase,
    Plan,
    full_budget,
    phases,
)
from kvmem.bench.sessions import Session, fit_chars_per_token, is_correct
from kvmem.serve_process import ServeProcess, sigterm_as_interrupt
from kvmem_core.errors import ConfigError

REQUEST_TIMEOUT_S = 3600  # a 48K-token prefill on 2 CPU cores takes minutes


@dataclass(frozen=True)
class Outcome:
    """One method's answer on one session, with what its selection held."""

    session: str
    kind: str
    size: int
    depth: float
    prompt_tokens: int
    method: str
    scorer: str | None
    budget: int
    expected: str
    answer: str
    correct: bool
    gold_blocks: tuple[int, ...]
    selected_blocks: tuple[int, ...] | None
    gold_selected: bool | None
    cached_tokens: int
    seconds: float
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Layout:
    """A session's measured prompt: its tokens, the server's block size and the gold blocks."""

    prompt_tokens: int
    block_tokens: int
    gold: tuple[int, ...]

    @property
    def oracle(self) -> tuple[int, ...]:
        """The gold blocks the store holds (a partial last block is always in view as the tail)."""
        return tuple(b for b in self.gold if b < self.prompt_tokens // self.block_tokens)


def run_session(api: Api, session: Session, plan: Plan, methods: tuple[Method, ...], full_budget: int) -> list[Outcome]:
    """Every method on ``session`` over one stored workspace; the session's workspaces are deleted after.

    The first request prefills the workspace and measures the prompt; ``full`` runs only
    where the prompt fits ``full_budget``; the oracle runs last, where gold blocks are known.
    """
    seen: set[str] = set()
    out: list[Outcome] = []
    layout: Layout | None = None
    try:
        for m in sorted(methods, key=lambda m: m == ORACLE):
            if m.method == "full" and (not full_budget or layout and layout.prompt_tokens + plan.max_tokens > full_budget):
                continue
            if m == ORACLE and not (layout and layout.oracle):
                continue
            kvmem = plan.overrides(m, session.target_tokens, full_budget, layout.oracle if layout else ())
            resp, seconds, error = _ask(api, session, kvmem, plan.max_tokens)
            if resp is not None:
                seen.add(resp["kvmem"]["workspace_id"])
                layout = layout or measure(api, session, resp)
            out.append(_outcome(session, m, kvmem["budget"], resp, layout, seconds, error))
    finally:
        for ws in seen:
            api.delete_workspace(ws)
    return out


def _ask(api: Api, session: Session, kvmem: dict[str, Any], max_tokens: int) -> tuple[dict[str, Any] | None, float, str | None]:
    t0 = time.perf_counter()
    try:
        resp = api.chat(list(session.messages), kvmem, max_tokens)
    except ApiError as exc:
        if exc.status >= 500:
            raise
        return None, 0.0, str(exc)
    return resp, time.perf_counter() - t0, None


def _outcome(session: Session, m: Method, budget: int, resp: dict[str, Any] | None, layout: Layout | None,
             seconds: float, error: str | None) -> Outcome:
    answer, selected, prompt, cached = "", None, 0, 0
    if resp is not None:
        msg = resp["choices"][0]["message"]
        answer = "" if msg.get("tool_calls") else msg.get("content") or ""
        blocks = resp["kvmem"]["selection"].get("blocks")
        selected = None if blocks is None else tuple(blocks)
        prompt, cached = resp["usage"]["prompt_tokens"], resp["usage"]["prompt_tokens_details"]["cached_tokens"]
    gold = layout.gold if layout else ()
    hit = None if selected is None or not gold else set(gold) <= set(selected)
    return Outcome(session.id, session.fact.kind, session.target_tokens, session.depth, prompt, m.method,
                   m.scorer, budget, session.fact.answer, answer, error is None and is_correct(answer, session.fact),
                   gold, selected, hit, cached, seconds, error)


def measure(api: Api, session: Session, resp: dict[str, Any]) -> Layout:
    """The session's layout from its first response (prompt size, block size of the workspace it names)."""
    prompt, block = resp["usage"]["prompt_tokens"], block_tokens(api, resp)
    return Layout(prompt, block, gold_blocks(api, session, prompt, block))


def block_tokens(api: Api, resp: dict[str, Any]) -> int:
    """Tokens per stored block, read from the workspace the response names."""
    info = api.call("GET", f"/v1/kvmem/workspaces/{resp['kvmem']['workspace_id']}")
    first = info["blocks"][0]
    return first["end"] - first["start"]


def gold_blocks(api: Api, session: Session, prompt_tokens: int, block: int) -> tuple[int, ...]:
    """Indices of the blocks holding the answer's evidence statements (token positions estimated).

    The transcript (which ``prompt_tokens`` measured) is tokenized message by message as the
    server renders it for a template without tools; the template's per-message wrapper tokens
    are what the sum of the parts leaves over.
    """
    from kvmem.tools_format import render_plain

    turns = render_plain(list(session.messages), None)
    counts = [api.count_tokens(t["content"]) for t in turns]
    wrapper = max(0.0, (prompt_tokens - sum(counts)) / (len(turns) + 1))
    out: set[int] = set()
    for start, end in _evidence_spans(api, turns, counts, wrapper, session):
        out.update(range(start // block, (end - 1) // block + 1))
    return tuple(sorted(out))


def _evidence_spans(api: Api, turns: list[dict[str, Any]], counts: list[int], wrapper: float,
                    session: Session) -> Iterator[tuple[int, int]]:
    for index in session.fact.evidence:
        line = session.fact.statements[index]
        i = next(i for i, t in enumerate(turns) if line in t["content"])
        offset = turns[i]["content"].index(line)
        start = round(sum(counts[:i]) + wrapper * (i + 0.5)) + api.count_tokens(turns[i]["content"][:offset])
        yield start, start + api.count_tokens(line)


def run_all(api: Api, sessions: list[Session], plan: Plan, methods: tuple[Method, ...], full_budget: int,
            log: Callable[[str], None] = lambda line: None,
            on_session: Callable[[list[Outcome]], None] = lambda got: None) -> list[Outcome]:
    """``run_session`` over ``sessions``; one progress line per session through ``log``, each session's
    outcomes to ``on_session`` as it ends."""
    out: list[Outcome] = []
    t0 = time.perf_counter()
    for i, session in enumerate(sessions):
        got = run_session(api, session, plan, methods, full_budget)
        out += got
        on_session(got)
        marks = " ".join(f"{o.scorer or o.method}={'+' if o.correct else '-'}" for o in got)
        log(f"[{i + 1}/{len(sessions)} {time.perf_counter() - t0:.0f}s] {session.id}: {marks}")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``kvmem bench quality``."""
    from kvmem.models import MODEL_HELP

    quick = (f"{len(QUICK.session_sizes())} sessions of {'/'.join(map(str, QUICK.sizes))} tokens, view budget "
             f"{'/'.join(str(QUICK.budget(s)) for s in QUICK.sizes)}, methods {','.join(m.label for m in QUICK_METHODS)}"
             f"; about {QUICK.minutes(len(QUICK_METHODS))} minutes on 2 idle CPU cores with the default model (one "
             f"{QUICK.sizes[0]}-token prefill per session at ~150 tok/s, then a few seconds per method; about 20 with "
             f"other work on the second core); without it: "
             f"{len(FULL.session_sizes())} sessions of {FULL.sizes[0]}-{FULL.sizes[-1]} tokens, every method, hours")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object on the last line")
    p.add_argument("--quick", action="store_true", help=f"the small run: {quick}")
    p.add_argument("--url", help="benchmark this running server instead of starting one")
    p.add_argument("--api-key", default=os.environ.get("KVMEM_API_KEY"), help="bearer key for --url (env KVMEM_API_KEY)")
    p.add_argument("--out", type=Path, default=Path("bench-out/quality"), help="folder for JSON and plots")
    p.add_argument("--model", help=f"model of the servers this command starts: {MODEL_HELP}")
    p.add_argument("--backend", choices=("llama.cpp", "torch"), help="engine of the servers this command starts "
                   "(default: kvmem serve's choice)")
    p.add_argument("--seed", type=int, default=0, help="session generator seed (default 0)")
    p.add_argument("--methods", help="comma-separated subset, e.g. retrieval/retrieval-heads,recent (default: all; "
                   f"with --quick: {','.join(m.label for m in QUICK_METHODS)})")
    p.add_argument("--limit", type=int, help="run only the first N sessions")
    p.add_argument("--sizes", help="comma-separated workspace sizes of the plan to run, e.g. 4096,49152 (default: all)")
    p.add_argument("--block-tokens", type=int, help="tokens per KV block on the servers this command starts "
                   "(default: kvmem serve's --kvmem-block-tokens)")
    p.add_argument("--no-groups", action="store_true", help="select blocks without whole-message groups "
                   "(kvmem.groups false), to compare recall and accuracy with the default, which keeps a tool call "
                   "with its results and a turn whole")
    p.add_argument("--relevance", type=float, help="retrieval's relevance floor for every selecting request "
                   "(kvmem.relevance, 0-1; default: the server's --kvmem-relevance)")
    p.add_argument("--full-budget", type=int, help="view budget of method full (default on the servers this command "
                   "starts: the largest plan size within the model's trained context plus 25%%; with --url, full "
                   "runs only when this is given)")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark as the flags ask; write JSON and plots; print the tables (and the JSON line).

    Ctrl-C or SIGTERM stops the servers and still writes what the finished sessions measured
    (``"complete": false``), then exits 130.
    """
    plan = plan_for(args)
    methods = select_methods(args.methods, QUICK_METHODS if args.quick else METHODS)
    trained = None if args.url else trained_context(args.model or os.environ.get("KVMEM_MODEL"))
    budget = args.full_budget or (0 if trained is None else full_budget(plan.sizes, trained))
    args.out.mkdir(parents=True, exist_ok=True)
    measured = Measured()
    complete = True
    with sigterm_as_interrupt():
        try:
            measure_all(args, plan, methods, trained, budget, measured)
        except KeyboardInterrupt:
            complete = False
    outcomes = measured.outcomes
    if not outcomes:
        return 0 if complete else 130
    result = {"model": measured.model, "results": report.rows(outcomes), "summary": report.summary(outcomes, trained)}
    detail = {**result, "complete": complete, "plan": asdict(plan), "seed": args.seed, "trained_ctx": trained,
              "full_budget": budget, "chars_per_token": measured.chars_per_token, "machine": machine(),
              "outcomes": outcomes}
    (args.out / "quality.json").write_text(json.dumps(detail, indent=1))
    plots.plot_quality(outcomes, args.out, trained)
    print(report.table(outcomes, trained))
    print(f"wrote {args.out}/quality.json and plots" + ("" if complete else
          f" (interrupted: the {len({o['session'] for o in outcomes})} sessions finished)"))
    if args.json:
        print(json.dumps(result))
    return 0 if complete else 130


def plan_for(args: argparse.Namespace) -> Plan:
    """The plan the flags ask for: quick or full, its sizes, block size and whole-message groups."""
    plan = replace(QUICK if args.quick else FULL, groups=not args.no_groups, relevance=args.relevance)
    if args.block_tokens:
        plan = replace(plan, block_tokens=args.block_tokens)
    return plan.only_sizes(args.sizes) if args.sizes else plan


@dataclass
class Measured:
    """What a run has measured so far: the served model's name, the tokenizer's fit the sessions were sized
    with, and the outcomes of every finished session (appended as each ends, so an interrupted run keeps them)."""

    model: str = ""
    chars_per_token: float = 0.0
    outcomes: list[dict[str, Any]] = field(default_factory=list)


def measure_all(args: argparse.Namespace, plan: Plan, methods: tuple[Method, ...], trained: int | None,
                budget: int, measured: Measured) -> None:
    """Every session of the plan (the first ``--limit``), each on the server of its phase, into ``measured``."""
    sessions: list[Session] = []
    for phase in phases(plan.session_sizes()[:args.limit], trained):
        with _server(args, plan, phase, budget) as api:
            measured.model = api.model()
            if not sessions:
                measured.chars_per_token = fit_chars_per_token(api.count_tokens)
                sessions = plan.sessions(args.seed, measured.chars_per_token)[:args.limit]
            mine = [s for s in sessions if s.target_tokens in phase.sizes]
            run_all(api, mine, plan, methods, budget, _log, lambda got: measured.outcomes.extend(o.to_dict() for o in got))


def select_methods(spec: str | None, default: tuple[Method, ...] = METHODS) -> tuple[Method, ...]:
    """Methods named by label (``retrieval/mean-k``, ``recent``...), or ``default``."""
    if not spec:
        return default
    known = {m.label: m for m in METHODS}
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(f"--methods: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    if names == [ORACLE.label]:
        raise ConfigError("--methods: oracle needs another method, whose request measures the workspace first")
    return tuple(known[n] for n in names)


def server_flags(args: argparse.Namespace, plan: Plan, phase: Phase, full_budget: int) -> list[str]:
    """``kvmem serve`` flags of the server for ``phase``: its context, a view for every cell's budget and
    ``full``'s, the plan's view knobs, and the model and backend the command was given."""
    assert phase.ctx is not None, "a given server (--url) is not started"
    view = max(full_budget, *(plan.budget(size) for size in phase.sizes))
    flags = ["--no-ui", "--ctx", str(phase.ctx), "--kvmem-positions", "auto", "--kvmem-budget", str(view),
             "--kvmem-gen-budget", str(GEN_RESERVE), "--kvmem-sink-tokens", str(plan.sink_tokens),
             "--kvmem-recent-tokens", str(plan.recent_tokens),
             "--kvmem-retrieval-method", "key-direction"]  # key-direction needs its prototypes built at start
    flags += ["--kvmem-block-tokens", str(plan.block_tokens)] if plan.block_tokens else []
    flags += ["--model", args.model] if args.model else []
    return flags + (["--backend", args.backend] if args.backend else [])


@contextlib.contextmanager
def _server(args: argparse.Namespace, plan: Plan, phase: Phase, full_budget: int) -> Iterator[Api]:
    if phase.ctx is None:
        yield Api(args.url, args.api_key, REQUEST_TIMEOUT_S)
        return
    server = ServeProcess(args.out, server_flags(args, plan, phase, full_budget))
    _log(f"starting kvmem serve --ctx {phase.ctx} for sizes {sorted(phase.sizes)} (log: {server.log})")
    with server:
        yield Api(server.url, timeout=REQUEST_TIMEOUT_S)


def trained_context(model: str | None) -> int:
    """The context ``model`` (a name, file or folder; None: the default) was trained on: GGUF
    ``{arch}.context_length`` or config.json's ``max_position_embeddings``, as the engines read it."""
    from kvmem.models import resolve_model

    path = resolve_model(model)
    if path.is_dir():
        config = json.loads((path / "config.json").read_text())
        return int(config.get("text_config", config)["max_position_embeddings"])
    from kvmem_torch.gguf_file import GGUFFile

    gguf = GGUFFile(path)
    try:
        return int(gguf.meta[f"{gguf.meta['general.architecture']}.context_length"])
    finally:
        gguf.close()


def machine() -> str:
    """OS, architecture, CPU count and model (from /proc/cpuinfo where there is one), and the GPUs the vendors'
    tools list."""
    from kvmem.devices import probe_gpus

    cpu = platform.processor()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as info:
        cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), cpu)
    gpus = "".join(f", GPU {g.name} ({g.total_mib} MiB)" for g in probe_gpus())
    return f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, {cpu or 'unknown CPU'}{gpus}"


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
