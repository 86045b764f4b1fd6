"""``kvmem bench quality``: exact-match accuracy of retrieval, recent and the gold-block oracle on agent sessions,
each view on its own server from the first prefill on (``quality_plan``), against ``full`` where it fits.

On each bounded-view server a session's first request (retrieval, the server's default) prefills the
workspace through that view; ``recent`` and the oracle then answer the same question on the same stored
workspace. Every request is counted: an error is a wrong answer, listed with its message. Each finished
session's outcomes are appended to ``outcomes.jsonl`` at once, so a run that stops for any reason keeps
them (``--resume`` continues it).
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.error
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvmem_bench.api import Api, ApiError
from kvmem_bench.quality_plan import MAX_TOKENS, ORACLE, Method, Queue, View
from kvmem_bench.sessions import Session, is_correct
from kvmem.serve_process import ServeError, ServeProcess

REQUEST_TIMEOUT_S = 3600  # a 256K-token prefill through a small view takes minutes


@dataclass(frozen=True)
class Outcome:
    """One method's answer on one session in one view, with what its selection held."""

    session: str
    kind: str
    size: int
    depth: float
    view: str
    budget: int | None
    method: str
    prompt_tokens: int
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


def run_session(api: Api, session: Session, view: View) -> list[Outcome]:
    """Every method of ``view`` on ``session`` over one stored workspace, deleted after.

    The first request prefills the workspace and measures the prompt; the oracle runs where gold blocks are
    known. A failed request is an outcome with its error (and counts as wrong); the others still run.
    """
    seen: set[str] = set()
    out: list[Outcome] = []
    layout: Layout | None = None
    try:
        for m in view.methods:
            if m == ORACLE and not (layout and layout.oracle):
                out.append(_outcome(session, view, m, None, layout, 0.0, "no gold blocks measured"))
                continue
            resp, seconds, error = _ask(api, session, m.overrides(layout.oracle if layout else ()))
            if resp is not None:
                seen.add(resp["kvmem"]["workspace_id"])
                if layout is None:
                    layout, error = _measure(api, session, resp)
            out.append(_outcome(session, view, m, resp, layout, seconds, error))
    finally:
        for ws in seen:
            _quietly(lambda: api.delete_workspace(ws))
    return out


def _ask(api: Api, session: Session, kvmem: dict[str, Any] | None) -> tuple[dict[str, Any] | None, float, str | None]:
    t0 = time.perf_counter()
    try:
        return api.chat(list(session.messages), kvmem, MAX_TOKENS), time.perf_counter() - t0, None
    except (ApiError, OSError, urllib.error.URLError, ValueError) as exc:
        return None, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}"


def _measure(api: Api, session: Session, resp: dict[str, Any]) -> tuple[Layout | None, str | None]:
    try:
        return measure(api, session, resp), None
    except (ApiError, OSError, urllib.error.URLError, ValueError, StopIteration) as exc:
        return None, f"measuring the gold blocks failed: {type(exc).__name__}: {exc}"


def _quietly(call: Callable[[], Any]) -> None:
    try:
        call()
    except (ApiError, OSError, urllib.error.URLError):
        pass  # a workspace left behind is deleted with the server


def _outcome(
    session: Session,
    view: View,
    m: Method,
    resp: dict[str, Any] | None,
    layout: Layout | None,
    seconds: float,
    error: str | None,
) -> Outcome:
    answer, selected, prompt, cached = "", None, 0, 0
    if resp is not None:
        msg = resp["choices"][0]["message"]
        answer = "" if msg.get("tool_calls") else msg.get("content") or ""
        blocks = resp["kvmem"]["selection"].get("blocks")
        selected = None if blocks is None else tuple(blocks)
        prompt, cached = resp["usage"]["prompt_tokens"], resp["usage"]["prompt_tokens_details"]["cached_tokens"]
    gold = layout.gold if layout else ()
    hit = None if selected is None or not gold else set(gold) <= set(selected)
    return Outcome(
        session.id,
        session.fact.kind,
        session.target_tokens,
        session.depth,
        view.label,
        view.budget,
        m.label,
        prompt,
        session.fact.answer,
        answer,
        error is None and is_correct(answer, session.fact),
        gold,
        selected,
        hit,
        cached,
        round(seconds, 3),
        error,
    )


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


def _evidence_spans(
    api: Api, turns: list[dict[str, Any]], counts: list[int], wrapper: float, session: Session
) -> Iterator[tuple[int, int]]:
    for index in session.fact.evidence:
        line = session.fact.statements[index]
        i = next(i for i, t in enumerate(turns) if line in t["content"])
        offset = turns[i]["content"].index(line)
        start = round(sum(counts[:i]) + wrapper * (i + 0.5)) + api.count_tokens(turns[i]["content"][:offset])
        yield start, start + api.count_tokens(line)


class Journal:
    """``outcomes.jsonl`` in the output folder: one line per outcome, appended (and flushed) as each session ends,
    from any thread; ``done`` holds the (size/view, session) pairs already there (``--resume``), whichever shard
    answered them, so a resumed run may split its cells over another number of servers."""

    def __init__(self, path: Path, resume: bool) -> None:
        self.path, self.lock = path, threading.Lock()
        self.outcomes: list[dict[str, Any]] = []
        if resume and path.exists():
            self.outcomes = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        elif path.exists():
            path.unlink()
        self.done = {(f"{o['size']}/{o['view']}", o["session"]) for o in self.outcomes}

    def add(self, queue: str, got: list[Outcome]) -> None:
        rows = [{**o.to_dict(), "queue": queue} for o in got]
        with self.lock, self.path.open("a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
            f.flush()
            self.outcomes += rows
            self.done.update((f"{r['size']}/{r['view']}", r["session"]) for r in rows)

    def has(self, queue: Queue, session: Session) -> bool:
        """Whether ``session`` was answered in ``queue``'s cell and view (by any shard)."""
        return (queue.cell_view, session.id) in self.done


@dataclass(frozen=True)
class RunOptions:
    """How queues run: the model and backend of their servers, where logs go, when to stop starting sessions."""

    out: Path
    model: str | None = None
    backend: str | None = None
    deadline: float | None = None  # time.monotonic() after which no session starts
    url: str | None = None  # a running server instead (one queue only)
    api_key: str | None = None
    change: tuple[str, ...] = ()  # kvmem serve flags every server gets: the change a run measures

    def server_flags(self, view: View) -> list[str]:
        flags = ["--no-ui", *view.flags(), *self.change]
        flags += ["--model", self.model] if self.model else []
        return flags + (["--backend", self.backend] if self.backend else [])


def run_queue(
    queue: Queue, opts: RunOptions, journal: Journal, stop: threading.Event, log: Callable[[str], None]
) -> None:
    """``queue``'s sessions on its own server, each appended to ``journal`` as it ends. A server that cannot start
    turns every session of the queue into an error outcome (counted wrong), never a lost row."""
    todo = [s for s in queue.sessions if not journal.has(queue, s)]
    if not todo:
        return
    try:
        with _server(queue, opts, log) as api:
            _answer_all(api, queue, todo, opts, journal, stop, log)
    except ServeError as exc:
        log(f"[{queue.name}] server failed: {exc}")
        for s in todo:
            if not journal.has(queue, s):
                journal.add(
                    queue.name,
                    [_outcome(s, queue.view, m, None, None, 0.0, server_error(exc)) for m in queue.view.methods],
                )


def server_error(exc: ServeError) -> str:
    """A server that could not start, as its sessions' error: the first line (how it ended) and the log's last one
    (the cause; the log opens with the server's config, which would hide it)."""
    lines = [line for line in str(exc).splitlines() if line.strip()] or ["no message"]
    return "server: " + lines[0] + (f" ... {lines[-1][-300:]}" if len(lines) > 1 else "")


def _answer_all(
    api: Api,
    queue: Queue,
    todo: list[Session],
    opts: RunOptions,
    journal: Journal,
    stop: threading.Event,
    log: Callable[[str], None],
) -> None:
    t0 = time.perf_counter()
    for i, session in enumerate(todo):
        if stop.is_set() or (opts.deadline is not None and time.monotonic() > opts.deadline):
            log(f"[{queue.name}] stopped before {len(todo) - i} sessions")
            return
        got = run_session(api, session, queue.view)
        journal.add(queue.name, got)
        marks = " ".join(f"{o.method}={'+' if o.correct else ('E' if o.error else '-')}" for o in got)
        log(f"[{queue.name} {i + 1}/{len(todo)} {time.perf_counter() - t0:.0f}s] {session.id}: {marks}")


class _server:
    """The queue's own ``kvmem serve`` (or the ``--url`` server) as an ``Api``."""

    def __init__(self, queue: Queue, opts: RunOptions, log: Callable[[str], None]) -> None:
        self.queue, self.opts, self.log = queue, opts, log
        self.process: ServeProcess | None = None

    def __enter__(self) -> Api:
        if self.opts.url:
            return Api(self.opts.url, self.opts.api_key, REQUEST_TIMEOUT_S)
        run_dir = self.opts.out / "servers" / self.queue.name.replace("/", "_")
        run_dir.mkdir(parents=True, exist_ok=True)
        self.process = ServeProcess(run_dir, self.opts.server_flags(self.queue.view))
        self.log(
            f"[{self.queue.name}] kvmem serve {' '.join(self.opts.server_flags(self.queue.view))} "
            f"(log: {self.process.log})"
        )
        self.process.__enter__()
        return Api(self.process.url, timeout=REQUEST_TIMEOUT_S)

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            self.process.__exit__(*exc)


def run_queues(
    queues: list[Queue],
    opts: RunOptions,
    journal: Journal,
    parallel: int,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> bool:
    """Every queue, ``parallel`` at a time; returns False when interrupted (Ctrl-C or SIGTERM): the queues stop
    starting sessions, finish the ones in flight and stop their servers."""
    stop = threading.Event()
    with ThreadPoolExecutor(max(1, parallel)) as pool:
        futures = [pool.submit(run_queue, q, opts, journal, stop, log) for q in queues]
        try:
            for f in futures:
                f.result()
        except KeyboardInterrupt:
            stop.set()
            log("interrupted: finishing the sessions in flight")
            for f in futures:
                f.cancel()
            return False
    return True
