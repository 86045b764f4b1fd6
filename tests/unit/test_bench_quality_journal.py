"""The quality runner keeps every outcome: a failed request is a counted error, each session is journaled as it
ends, and ``--resume`` runs only what the journal lacks."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from kvmem_bench.api import Api
from kvmem_bench.quality import Journal, RunOptions, run_queue, run_session, server_error
from kvmem_bench.quality_plan import Cell, Queue, View, make_any_session
from kvmem.serve_process import ServeError, free_port

SESSIONS = tuple(make_any_session(kind, 1000, 0.5, "tuning", 0) for kind in ("kv", "port"))


def test_an_unreachable_server_yields_one_error_outcome_per_method() -> None:
    api = Api(f"http://127.0.0.1:{free_port()}", timeout=5)
    got = run_session(api, SESSIONS[0], View("default", None))
    assert [o.method for o in got] == ["retrieval", "recent", "oracle"]
    assert all(o.error and not o.correct for o in got)
    assert "URLError" in got[0].error and got[2].error == "no gold blocks measured"


def test_the_journal_appends_each_session_and_resumes_from_it(tmp_path: Path) -> None:
    path = tmp_path / "outcomes.jsonl"
    journal = Journal(path, resume=False)
    api = Api(f"http://127.0.0.1:{free_port()}", timeout=5)
    journal.add("q", run_session(api, SESSIONS[0], View("default", None)))
    assert len(path.read_text().splitlines()) == 3 and json.loads(path.read_text().splitlines()[0])["queue"] == "q"
    again = Journal(path, resume=True)
    assert again.done == {("1000/default", SESSIONS[0].id)} and len(again.outcomes) == 3
    other_shard = Queue(Cell(1000), View("default", None), 3, SESSIONS)
    assert again.has(other_shard, SESSIONS[0]) and not again.has(other_shard, SESSIONS[1])
    assert not again.has(Queue(Cell(1000), View("1/8", 128), 0, SESSIONS), SESSIONS[0])
    assert Journal(path, resume=False).outcomes == [] and not path.exists()  # a fresh run starts a fresh journal


def test_a_queue_past_its_deadline_starts_nothing_and_a_done_queue_no_server(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "outcomes.jsonl", resume=False)
    queue = Queue(Cell(1000), View("default", None), 0, SESSIONS)
    lines: list[str] = []
    opts = RunOptions(tmp_path, url=f"http://127.0.0.1:{free_port()}", deadline=0.0)
    run_queue(queue, opts, journal, threading.Event(), lines.append)
    assert journal.outcomes == [] and lines == ["[1000/default/0] stopped before 2 sessions"]
    journal.done.update((queue.cell_view, s.id) for s in SESSIONS)
    run_queue(queue, RunOptions(tmp_path / "never"), journal, threading.Event(), lines.append)  # nothing left to run
    assert not (tmp_path / "never").exists()


def test_a_server_that_cannot_start_records_its_cause_not_its_config() -> None:
    log = 'config: {"ctx": 32768, ' + '"knob": 1, ' * 80 + "}\nkvmem: engine failed to load: unknown backend 'torch'\n"
    got = server_error(ServeError("kvmem serve exited 1:\n" + log))
    assert got.startswith("server: kvmem serve exited 1:") and got.endswith("unknown backend 'torch'")
    assert len(got) < 400
